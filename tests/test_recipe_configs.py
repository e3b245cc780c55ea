"""The recipes' documents and configs: scripts/glue/README.md's dry run and table, the hydra
configs of configs/ (composed and checked against the recipe), scripts/install.sh."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from acl_fairseq.experiment.recipe import (
    METHODS as RECIPE_METHODS,
)
from acl_fairseq.experiment.recipe import glue_commands, glue_recipe

from fairseq_helpers import REPO, USER_DIR
from recipe_helpers import CONFIGS, CONFIGS_README, METHODS, TASKS, glue

GLUE_README = REPO / "scripts" / "glue" / "README.md"


def test_the_glue_readme_shows_a_dry_run_as_it_prints():
    """scripts/glue/README.md's dry run (its ``console`` block) is what the command prints."""
    (block,) = re.findall(r"^```console\n\$ (.*?)\n(.*?)^```", GLUE_README.read_text(), re.M | re.S)
    words = shlex.split(block[0])
    env = dict(w.split("=", 1) for w in words[: words.index("scripts/glue/train.sh")])
    args = words[words.index("scripts/glue/train.sh") + 1 :]
    code, out, err = glue(*args, **{**env, "DATA_DIR": None, "FAIRSEQ_TRAIN": None}, cwd=REPO)
    assert code == 0, err
    assert out == block[1]


def test_the_glue_readme_table_is_the_recipe():
    rows = re.findall(r"^\| ([A-Za-z0-9-]+) \| (\S+) \| (\d+) \| (\d+) \| (\d+) \| (\d)",
                      GLUE_README.read_text(), re.M)  # fmt: skip
    assert sorted(r[0] for r in rows) == sorted(TASKS)
    for task, lr, batch, updates, warmup, classes in rows:
        recipe = glue_recipe(task)
        assert float(lr) == float(recipe.lr), task
        assert (int(batch), int(updates), int(warmup), int(classes)) == (
            recipe.batch_size,
            recipe.updates,
            recipe.warmup,
            recipe.num_classes,
        ), task


# ----------------------------------------------------------------------------- the configs


def readme_method_overrides() -> dict[str, list[list[str]]]:
    """method -> the hydra overrides of each of its stages, from configs/README.md's table."""
    rows = re.findall(
        r"^\| `(\w+)` \|\s*(\d?)\s*\| (.*) \|$", CONFIGS_README.read_text(encoding="utf-8"), re.M
    )
    stages: dict[str, list[list[str]]] = {}
    for method, _, cell in rows:
        stages.setdefault(method, []).append(" ".join(re.findall(r"`([^`]*)`", cell)).split())
    return stages


# configs/README.md's roberta.base name for the recipe's --arch (the same architecture)
HYDRA_ARCH = {"roberta_base": "roberta", "multi_exit_roberta_base": "multi_exit_roberta"}


def hydra_groups(cfg) -> dict[str, dict]:
    """A composed config's groups as fairseq reads them: the registries' defaults added,
    interpolations resolved."""
    from fairseq.criterions import CRITERION_DATACLASS_REGISTRY
    from fairseq.dataclass.utils import merge_with_parent
    from fairseq.optim import OPTIMIZER_DATACLASS_REGISTRY
    from fairseq.optim.lr_scheduler import LR_SCHEDULER_DATACLASS_REGISTRY
    from fairseq.tasks import TASK_DATACLASS_REGISTRY

    registries = {
        "task": TASK_DATACLASS_REGISTRY,
        "criterion": CRITERION_DATACLASS_REGISTRY,
        "optimizer": OPTIMIZER_DATACLASS_REGISTRY,
        "lr_scheduler": LR_SCHEDULER_DATACLASS_REGISTRY,
    }
    full = OmegaConf.to_container(cfg, resolve=False)
    for group, registry in registries.items():
        merged = merge_with_parent(registry[cfg[group]._name](), cfg[group])
        full[group] = OmegaConf.to_container(merged, resolve=False)
    return OmegaConf.to_container(OmegaConf.create(full), resolve=True)


def command_groups(argv: list[str], groups: list[str]):
    """(``groups``, argparse namespace) of a fairseq-train command line as fairseq reads it."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    args = options.parse_args_and_arch(options.get_training_parser(), argv[1:])
    cfg = convert_namespace_to_omegaconf(args)
    return {g: OmegaConf.to_container(cfg[g], resolve=True) for g in groups}, args


def compose_config(name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    # version_base 1.1, as fairseq's own initialize() (convert_namespace_to_omegaconf) expects
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.1"):
        return compose(name, overrides)


def test_the_readme_lists_every_method_with_its_stages():
    stages = readme_method_overrides()
    assert list(stages) == list(RECIPE_METHODS)
    for method, overrides in stages.items():
        commands = glue_commands("rte", method, "D", "P", "S")
        assert len(overrides) == len(commands), method


def hydra_cases() -> list:
    """Every task x method; fast: every task's ``ce``, every method on RTE, STS-B's refusals."""
    return [
        pytest.param(task, method, marks=[] if fast else [pytest.mark.slow])
        for task in TASKS
        for method in METHODS
        for fast in [method == "ce" or task in ("RTE", "STS-B")]
    ]


@pytest.mark.parametrize("task,method", hydra_cases())
def test_hydra_config_trains_the_recipe(task, method):
    """Stage by stage: the task's yaml with the method's overrides of configs/README.md,
    composed as fairseq-hydra-train composes it, is the configuration fairseq reads from the
    recipe's fairseq-train command (fp16 on), field by field in every group the yaml writes;
    the model's architecture by its README name (stage 1 of a multi-exit method: the plain
    model for the recipe's multi-exit one with --exit-layers none)."""
    from fairseq.criterions import CRITERION_DATACLASS_REGISTRY
    from fairseq.dataclass.initialize import hydra_init
    from fairseq.dataclass.utils import merge_with_parent

    import acl_fairseq  # noqa: F401  (registers the plugin)
    from acl_fairseq.criterions.base import validate_criterion_config

    name = TASKS[task][0]
    hydra_init(name)  # what fairseq-hydra-train does: the schema of the config
    groups = [g for g in OmegaConf.load(CONFIGS / f"{name}.yaml") if g not in ("hydra", "model")]
    stages = readme_method_overrides()[method]
    base = [f"task.data=/data/{task}-bin", "checkpoint.restore_file=/pretrained/model.pt",
            "checkpoint.save_dir=/ck", f"common.user_dir={USER_DIR}"]  # fmt: skip
    if task == "STS-B" and method != "ce":
        cfg = compose_config(name, [*base, *stages[-1]])
        crit = merge_with_parent(CRITERION_DATACLASS_REGISTRY[cfg.criterion._name](),
                                 cfg.criterion)  # fmt: skip
        with pytest.raises(ValueError, match="is for classification"):
            validate_criterion_config(crit, method)  # as the criterion is built
        return
    commands = glue_commands(task, method, "/data", "/pretrained/model.pt", "/ck",
                             fp16=True, user_dir=USER_DIR)  # fmt: skip
    for stage, (overrides, argv) in enumerate(zip(stages, commands, strict=True), start=1):
        cfg = compose_config(name, [*base, *(o.replace("DIR", "/ck") for o in overrides)])
        expected, args = command_groups(argv, groups)
        composed = hydra_groups(cfg)
        for group, fields in expected.items():
            assert composed[group] == fields, (stage, group)
        stage1_of_multi_exit = len(commands) == 2 and stage == 1
        arch = args.arch.removeprefix("multi_exit_") if stage1_of_multi_exit else args.arch
        assert cfg.model._name == HYDRA_ARCH.get(arch, arch), stage
        assert (getattr(args, "exit_layers", None) == "none") == stage1_of_multi_exit
        for key, value in cfg.model.items():
            assert key == "_name" or getattr(args, key) == value, (stage, key)


# the criterion hyper-parameters of configs/README.md, with the method they go with
README_HYPER_PARAMETERS = {
    "ce_scl": ["++criterion.acl_grad=true", "++criterion.temperature=0.1"],
    "acl": ["++criterion.contrastive_lambda=0.3", "++criterion.acl_grad_threshold=80",
            "++criterion.acl_grad_scope=head", "++task.acl_grad_log=angles.tsv"],
    "multi_exit_joint": ["++criterion.exit_weighting=uniform", "++model.exit_layers=[4,8]",
                         "++model.exit_pooling=mean"],
    "acl_cl": ["++criterion.cross_layer_lambda=0.2", "++criterion.acl_grad=false",
               "++model.freeze_backbone=true"],
}  # fmt: skip


def test_hydra_hyper_parameters_name_real_fields():
    from fairseq.dataclass.initialize import hydra_init

    import acl_fairseq  # noqa: F401  (registers the plugin)

    readme = CONFIGS_README.read_text(encoding="utf-8")
    hydra_init("rte")
    stages = readme_method_overrides()
    for method, extra in README_HYPER_PARAMETERS.items():
        for override in extra:
            assert override.split("=")[0] in readme, override
        cfg = compose_config("rte", ["task.data=D", "checkpoint.restore_file=x",
                                     *stages[method][-1], *extra])  # fmt: skip
        composed = hydra_groups(cfg)  # an unknown field stops the merge
        for override in extra:
            group, key = override[2:].split("=")[0].split(".")
            if group != "model":
                assert key in composed[group], override


CPU_OVERRIDES = "common.cpu=true common.fp16=false"


def test_configs_document_the_cpu_overrides():
    for path in sorted(CONFIGS.glob("*.yaml")):
        header = path.read_text().split("\nhydra:")[0]
        assert f"on a CPU-only machine add  {CPU_OVERRIDES}" in header, path
        assert "fp16: true" in path.read_text(), path  # still fp16 on a GPU
    assert CPU_OVERRIDES in CONFIGS_README.read_text()


# ----------------------------------------------------------------------------- install.sh


def test_install_sh_installs_fairseq_last_without_dependency_checks():
    """pip reports fairseq-fixed's missing torchaudio whenever a later install touches one of
    fairseq's dependencies; pip skips that report for --no-deps, so fairseq goes last."""
    text = (REPO / "scripts" / "install.sh").read_text().replace("\\\n", " ")
    lines = text.splitlines()  # a command continued over lines (\) on one line
    installs = [i for i, line in enumerate(lines) if "$PIP install" in line]
    fairseq = [i for i in installs if "fairseq-fixed" in lines[i]]
    assert len(fairseq) == 1 and fairseq[0] == installs[-1]
    assert "--no-deps" in lines[fairseq[0]] and "--no-build-isolation" in lines[fairseq[0]]
    assert not any("torchaudio" in lines[i] for i in installs)
    assert "tensorboardX" in "\n".join(lines[installs[0] :])
    # the extensions compile on every core and without debug information
    assert "build_ext -j" in lines[fairseq[0]] and "-g0" in lines[fairseq[0]]


def test_install_sh_writes_the_bytecode_of_what_the_commands_import(tmp_path: Path):
    """scripts/compile_imported.py, which install.sh runs on acl_fairseq: every module of a
    package compiled where PYTHONDONTWRITEBYTECODE is set, its __main__ not run, a module that
    fails to import skipped."""
    assert '/compile_imported.py" acl_fairseq' in (REPO / "scripts" / "install.sh").read_text()
    package = tmp_path / "pkgx"
    (package / "sub").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py"):
        (package / name).write_text("X = 1\n")
    (package / "broken.py").write_text("import no_such_module_anywhere\n")
    (package / "__main__.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(tmp_path)}

    def compiled() -> list[str]:
        return sorted(
            (p.parent.parent / p.name.split(".")[0]).relative_to(package).as_posix()
            for p in package.rglob("*.pyc")
        )

    subprocess.run([sys.executable, "-c", "import pkgx.a"], env=env, check=True)
    assert compiled() == []  # the control: imported, nothing kept
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "compile_imported.py"), "pkgx"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "bytecode written for 4 modules" in proc.stdout
    # broken.py compiles, then fails to run: skipped
    assert compiled() == ["__init__", "a", "broken", "sub/__init__", "sub/b"]
    assert not (tmp_path / "ran").exists()
