"""Criterions against an independent computation from the model's raw outputs.

The reference recomputes every term from ``exit_outputs`` / the head's pooled feature with the
loop-based SupCon of ``test_losses`` and ``F.cross_entropy``: no code shared with the
criterions beyond the model.
"""

import pytest
import torch
import torch.nn.functional as F
from test_losses import naive_supcon

from acl_fairseq.tasks.input_checks import check_num_classes

from fairseq_helpers import fairseq_setup

NUM_CLASSES = 3


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    (root / "input0").mkdir()
    (root / "label").mkdir()
    (root / "input0" / "dict.txt").write_text("".join(f"w{i} {100 - i}\n" for i in range(30)))
    (root / "label" / "dict.txt").write_text("".join(f"{c} 1\n" for c in range(NUM_CLASSES)))
    return root


def build(data_dir, criterion: list[str], arch: str = "multi_exit_roberta_tiny"):
    cfg, task, model = fairseq_setup(
        [
            data_dir, "--task", "acl_sentence_prediction", "--num-classes",
            str(NUM_CLASSES), "--max-positions", "64", "--arch", arch,
            "--encoder-layers", "3", "--encoder-embed-dim", "16", "--encoder-ffn-embed-dim",
            "32", "--encoder-attention-heads", "2", "--dropout", "0", "--attention-dropout", "0",
            "--pooler-dropout", "0", "--seed", "3", *criterion,
        ],
        seed=3,
    )  # fmt: skip
    return task, model, task.build_criterion(cfg.criterion)


def sample(n=6, seq=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, 30, (n, seq), generator=g)
    tokens[:, 0] = 0
    tokens[0, -2:] = 1  # some padding
    return {
        "net_input": {"src_tokens": tokens, "src_lengths": torch.full((n,), seq)},
        "target": torch.tensor([0, 1, 2, 0, 1, 1])[:n],
        "ntokens": n * seq,
        "nsentences": n,
    }


def naive_with_labels(features, label_emb, targets, tau):
    return naive_supcon(
        list(features) + list(label_emb), targets.tolist() + list(range(label_emb.size(0))), tau
    )


@pytest.mark.parametrize("exit_head", ["mlp", "linear"])
@pytest.mark.parametrize("weighting", ["layer", "uniform"])
def test_acl_cross_layer_against_reference(data_dir, weighting, exit_head):
    lam, lam_cl, tau = 0.7, 0.4, 0.25
    _, model, crit = build(
        data_dir,
        ["--criterion", "acl_cross_layer", "--contrastive-lambda", str(lam),
         "--cross-layer-lambda", str(lam_cl), "--temperature", str(tau),
         "--exit-weighting", weighting, "--exit-head", exit_head],
    )  # fmt: skip
    kinds = [head.kind for _, head in model.exit_heads()]
    assert kinds == [exit_head] * (len(kinds) - 1) + ["mlp"]  # the final exit keeps RoBERTa's
    model.eval()
    s = sample()
    ce, con, n, log = crit.loss_terms(model, s)

    outs = model.exit_outputs(s["net_input"]["src_tokens"])
    assert [o.layer for o in outs] == [1, 2, 3]
    y = s["target"]
    raw = [1.0, 2.0, 3.0] if weighting == "layer" else [1.0, 1.0, 1.0]
    w = [r / sum(raw) for r in raw]
    ref_ce = sum(wi * F.cross_entropy(o.logits, y, reduction="sum") for wi, o in zip(w, outs))
    t = outs[-1]
    ref_con = 0.0
    for wi, o in zip(w[:-1], outs[:-1]):
        k = NUM_CLASSES
        vectors = list(o.features) + list(o.label_embeddings) + list(t.features)
        vectors += list(t.label_embeddings)
        labels = y.tolist() + list(range(k)) + y.tolist() + list(range(k))
        ref_con += wi * lam_cl * naive_supcon(vectors, labels, tau)
    ref_con += w[-1] * lam * naive_with_labels(t.features, t.label_embeddings, y, tau)
    assert n == 6
    assert ce.item() == pytest.approx(ref_ce.item(), rel=1e-5)
    assert con.item() == pytest.approx(6 * ref_con.item(), rel=1e-4)
    for o in outs:
        assert log[f"ncorrect_exit{o.layer}"].item() == (o.logits.argmax(1) == y).sum().item()
        assert log[f"loss_exit{o.layer}"].item() == pytest.approx(
            F.cross_entropy(o.logits, y, reduction="sum").item(), rel=1e-5
        )


def test_acl_cross_layer_teacher_gets_no_cross_layer_gradient(data_dir):
    _, model, crit = build(
        data_dir, ["--criterion", "acl_cross_layer", "--contrastive-lambda", "0"]
    )
    model.train()
    _, con, _, _ = crit.loss_terms(model, sample())
    con.backward()
    final = model.classification_heads["sentence_classification_head"]
    shallow = model.classification_heads["sentence_classification_head_exit1"]
    assert (
        final.out_proj.weight.grad is None or torch.count_nonzero(final.out_proj.weight.grad) == 0
    )
    assert torch.count_nonzero(shallow.out_proj.weight.grad) > 0


def save_checkpoint(model_state: dict, path) -> None:
    """The fields of a fairseq checkpoint that ``load_checkpoint_to_cpu`` reads."""
    history = [{"criterion_name": "x", "optimizer_name": "adam", "lr_scheduler_state": {},
                "num_updates": 0}]  # fmt: skip
    torch.save(
        {"model": model_state, "optimizer_history": history, "extra_state": {}, "cfg": None}, path
    )


def _cross_layer_reference(outs, teacher, y, w_con, lam, lam_cl, tau):
    """sum_l w_l * lambda_cl * SupCon(student_l + teacher) + w_L * lambda * ACL-Embed(last)."""
    ref = 0.0
    for wi, o in zip(w_con[:-1], outs[:-1]):
        vectors = list(o.features) + list(o.label_embeddings) + list(teacher.features)
        vectors += list(teacher.label_embeddings)
        labels = y.tolist() + list(range(NUM_CLASSES)) + y.tolist() + list(range(NUM_CLASSES))
        ref += wi * lam_cl * naive_supcon(vectors, labels, tau)
    last = outs[-1]
    return ref + w_con[-1] * lam * naive_with_labels(last.features, last.label_embeddings, y, tau)


def test_acl_cross_layer_frozen_teacher_and_uniform_contrastive_weights(data_dir, tmp_path):
    """--frozen-teacher: the targets come from the checkpoint's model in eval mode (here a
    model with other weights than the live one, so a live teacher would give another loss);
    --cross-layer-weighting uniform weights the contrastive terms 1/3 while CE keeps 1:2:3."""
    lam, lam_cl, tau = 0.7, 0.4, 0.25
    _, snapshot, _ = build(data_dir, ["--criterion", "acl_cross_layer", "--seed", "9"])
    with torch.no_grad():
        for p in snapshot.parameters():
            p.add_(0.3 * torch.randn_like(p))
    path = tmp_path / "stage1.pt"
    save_checkpoint(snapshot.state_dict(), path)
    _, model, crit = build(
        data_dir,
        ["--criterion", "acl_cross_layer", "--contrastive-lambda", str(lam),
         "--cross-layer-lambda", str(lam_cl), "--temperature", str(tau),
         "--cross-layer-weighting", "uniform", "--frozen-teacher", str(path)],
    )  # fmt: skip
    model.eval()
    s = sample()
    ce, con, _, _ = crit.loss_terms(model, s)
    tokens, y = s["net_input"]["src_tokens"], s["target"]
    outs = model.exit_outputs(tokens)
    snapshot.eval()
    teacher = snapshot.exit_outputs(tokens)[-1]
    w_ce = [1 / 6, 2 / 6, 3 / 6]
    ref_ce = sum(wi * F.cross_entropy(o.logits, y, reduction="sum") for wi, o in zip(w_ce, outs))
    ref_con = _cross_layer_reference(outs, teacher, y, [1 / 3] * 3, lam, lam_cl, tau)
    live_con = _cross_layer_reference(outs, outs[-1], y, [1 / 3] * 3, lam, lam_cl, tau)
    assert ce.item() == pytest.approx(ref_ce.item(), rel=1e-5)
    assert con.item() == pytest.approx(6 * ref_con.item(), rel=1e-4)
    assert abs(con.item() - 6 * live_con.item()) > 1e-3

    # the snapshot is frozen, in eval mode, not a parameter of the criterion, and stays put
    model.train()
    frozen = crit.frozen_teacher(model)
    assert not frozen.training and not any(p.requires_grad for p in frozen.parameters())
    assert list(crit.parameters()) == []
    _, con, _, _ = crit.loss_terms(model, s)
    con.backward()
    assert all(p.grad is None for p in frozen.parameters())
    for name, p in frozen.state_dict().items():
        assert torch.equal(p, snapshot.state_dict()[name])


def test_acl_cross_layer_frozen_teacher_errors_name_the_flag(data_dir, tmp_path):
    with pytest.raises(ValueError, match="--frozen-teacher .*no such file"):
        build(data_dir, ["--criterion", "acl_cross_layer", "--frozen-teacher", "missing.pt"])
    _, untrained, _ = build(data_dir, ["--criterion", "acl_cross_layer"])
    state = {
        k: v for k, v in untrained.state_dict().items() if "sentence_classification_head." not in k
    }
    save_checkpoint(state, tmp_path / "no_head.pt")
    _, model, crit = build(
        data_dir,
        ["--criterion", "acl_cross_layer", "--frozen-teacher", str(tmp_path / "no_head.pt")],
    )
    with pytest.raises(ValueError, match="has no trained head"):
        crit.loss_terms(model, sample())


# weights of the exits at layers 1, 2, 3 by --exit-weighting, written out by hand
HAND_WEIGHTS = {"layer": [1, 2, 3], "uniform": [1, 1, 1], "reverse": [3, 2, 1]}


@pytest.mark.parametrize("weighting", [None, *HAND_WEIGHTS])
def test_multi_exit_ce_is_weighted_ce(data_dir, weighting):
    flags = [] if weighting is None else ["--exit-weighting", weighting]
    _, model, crit = build(data_dir, ["--criterion", "multi_exit_ce", *flags])
    model.eval()
    s = sample()
    loss, n, log = crit(model, s)
    outs = model.exit_outputs(s["net_input"]["src_tokens"])
    raw = HAND_WEIGHTS[weighting or "layer"]  # the default is PABEE's
    ref = sum(
        r * F.cross_entropy(o.logits, s["target"], reduction="sum") for r, o in zip(raw, outs)
    ) / sum(raw)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert log["contrastive_loss"].item() == 0.0
    assert crit.acl_grad is None  # ACL-Grad off: fairseq's own train_step


def test_reverse_exit_weights_mirror_the_layer_index():
    from acl_fairseq.criterions.multi_exit_ce import exit_weights

    assert exit_weights([2, 4, 6], "reverse") == pytest.approx([5 / 9, 3 / 9, 1 / 9])
    assert exit_weights([2, 4, 6], "layer") == pytest.approx([2 / 12, 4 / 12, 6 / 12])
    with pytest.raises(ValueError, match="--exit-weighting must be one of"):
        exit_weights([1, 2], "first")


def test_uniform_weights_are_gradient_equilibrium_under_adam():
    """The claim behind ``uniform`` standing for Li et al.'s (2019) gradient equilibrium (GE):
    GE rescales the gradient at exit i's branch by 1/(L-i+1) and on the main path by
    (L-i)/(L-i+1), so layer k receives the mean of the gradients of the exits it feeds; that
    is the uniform weights' sum times a constant per layer, which Adam normalises away. Here a
    4-layer network with an exit per layer, trained 30 Adam steps both ways."""
    from acl_fairseq.criterions.multi_exit_ce import exit_weights

    class Rescale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, scale):
            ctx.scale = scale
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad * ctx.scale, None

    depth = 4

    def run(ge: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(depth))
        heads = torch.nn.ModuleList(torch.nn.Linear(8, 3) for _ in range(depth))
        params = [*layers.parameters(), *heads.parameters()]
        opt = torch.optim.Adam(params, lr=1e-2, eps=1e-12)
        weights = exit_weights(list(range(1, depth + 1)), "uniform")
        data = torch.Generator().manual_seed(1)
        for _ in range(30):
            x, y = torch.randn(16, 8, generator=data), torch.randint(0, 3, (16,), generator=data)
            losses = []
            for i, (layer, head) in enumerate(zip(layers, heads), start=1):
                x = torch.tanh(layer(x))
                if ge:
                    losses.append(F.cross_entropy(head(Rescale.apply(x, 1 / (depth - i + 1))), y))
                    x = Rescale.apply(x, (depth - i) / (depth - i + 1))
                else:
                    losses.append(F.cross_entropy(head(x), y))
            opt.zero_grad()
            loss = sum(losses) if ge else sum(w * li for w, li in zip(weights, losses))
            loss.backward()
            opt.step()
        return [p.detach().clone() for p in params]

    ge, uniform = run(True), run(False)
    torch.manual_seed(0)  # the runs' common start: they moved away from it
    start = [p for m in (torch.nn.Linear(8, 8),) for p in m.parameters()]
    assert (ge[0] - start[0]).abs().max() > 0.05
    for a, b in zip(ge, uniform):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("criterion", ["multi_exit_ce", "acl_cross_layer"])
def test_alternate_exits_trains_the_final_exit_alone_on_odd_updates(data_dir, criterion):
    """--alternate-exits (BERxiT): the 1st, 3rd, ... update (0-based 0, 2, ...) is the final
    exit's CE (weight 1) and contrastive term alone, so no gradient reaches a shallow head;
    the other updates and validation are the plain criterion's."""
    lam, tau = 0.7, 0.25
    flags = ["--criterion", criterion, "--exit-weighting", "uniform"]
    flags += ["--contrastive-lambda", str(lam), "--temperature", str(tau)] * (
        criterion == "acl_cross_layer"
    )
    _, model, plain = build(data_dir, flags)
    _, _, alternating = build(data_dir, [*flags, "--alternate-exits"])
    s = sample()
    y = s["target"]
    model.train()  # dropout is 0: training forwards are deterministic
    outs = model.exit_outputs(s["net_input"]["src_tokens"])
    for update in (0, 1, 2, 5):
        alternating.set_num_updates(update)
        model.zero_grad()
        ce, con, n, log = alternating.loss_terms(model, s)
        ce0, con0, _, log0 = plain.loss_terms(model, s)
        assert log.keys() == log0.keys()  # every exit is still scored
        if update % 2:
            assert torch.equal(ce, ce0) and torch.equal(con, con0)
            continue
        last = outs[-1]
        assert ce.item() == pytest.approx(F.cross_entropy(last.logits, y, reduction="sum").item())
        if criterion == "acl_cross_layer":
            ref = lam * naive_with_labels(last.features, last.label_embeddings, y, tau)
            assert con.item() == pytest.approx(n * ref.item(), rel=1e-4)
        else:
            assert con.item() == 0.0
        (ce + con).backward()
        heads = model.classification_heads
        for name in ("sentence_classification_head_exit1", "sentence_classification_head_exit2"):
            assert all(p.grad is None for p in heads[name].parameters())
        assert torch.count_nonzero(heads["sentence_classification_head"].out_proj.weight.grad)
    model.eval()  # validation: every exit, whatever the update
    alternating.set_num_updates(0)
    ce, con, _, _ = alternating.loss_terms(model, s)
    ce0, con0, _, _ = plain.loss_terms(model, s)
    assert torch.equal(ce, ce0) and torch.equal(con, con0)


def test_the_task_passes_the_update_number_to_the_criterion(data_dir):
    """fairseq's train_step path (no ACL-Grad): update 0 trains the final exit alone."""
    task, model, crit = build(data_dir, ["--criterion", "multi_exit_ce", "--alternate-exits"])

    class Backward:
        def backward(self, loss):
            loss.backward()

    shallow = model.classification_heads["sentence_classification_head_exit1"].out_proj.weight
    for update, reaches_shallow in ((0, False), (1, True)):
        model.zero_grad()
        task.train_step(sample(), model, crit, Backward(), update)
        assert crit.num_updates == update
        assert (shallow.grad is not None) == reaches_shallow


@pytest.mark.parametrize("name", ["acl_embed", "ce_scl"])
def test_single_exit_criterions_against_reference(data_dir, name):
    lam, tau = 0.3, 0.2
    _, model, crit = build(
        data_dir,
        ["--criterion", name, "--contrastive-lambda", str(lam), "--temperature", str(tau)],
        arch="roberta",
    )
    model.eval()
    s = sample()
    ce, con, n, _ = crit.loss_terms(model, s)
    head = model.classification_heads["sentence_classification_head"]
    x, _ = model(**s["net_input"], features_only=True)
    h = torch.tanh(head.dense(x[:, 0, :]))  # RobertaClassificationHead, dropout off
    logits = head.out_proj(h)
    y = s["target"]
    assert ce.item() == pytest.approx(F.cross_entropy(logits, y, reduction="sum").item(), rel=1e-5)
    if name == "acl_embed":
        ref = naive_with_labels(h, head.out_proj.weight, y, tau)
    else:
        ref = naive_supcon(list(h), y.tolist(), tau)
    assert con.item() == pytest.approx(lam * 6 * ref.item(), rel=1e-4)


def test_freeze_backbone_leaves_only_shallow_exits_trainable(data_dir):
    _, model, _ = build(data_dir, ["--criterion", "multi_exit_ce", "--freeze-backbone"])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("_exit" in n for n in trainable)
    assert {n.split(".")[1] for n in trainable} == {
        "sentence_classification_head_exit1",
        "sentence_classification_head_exit2",
    }


@pytest.mark.parametrize("criterion", ["acl_embed", "ce_scl", "sentence_prediction"])
def test_freeze_backbone_with_a_final_exit_criterion_is_refused_at_set_up(data_dir, criterion):
    """Such a criterion's loss reaches no trainable weight: torch's "element 0 of tensors does
    not require grad" at the first update, without this check."""
    with pytest.raises(ValueError) as info:
        build(data_dir, ["--criterion", criterion, "--freeze-backbone"])
    assert str(info.value) == (
        f"--freeze-backbone trains only the shallow exits' heads, but --criterion {criterion} "
        "trains the final exit only, so nothing would train. Use --criterion multi_exit_ce or "
        "acl_cross_layer (a stage that refits the exits, docs/usage.md), or drop "
        "--freeze-backbone"
    )
    for multi_exit in ("multi_exit_ce", "acl_cross_layer"):  # these train the shallow heads
        build(data_dir, ["--criterion", multi_exit, "--freeze-backbone"])


def test_cross_layer_on_a_model_without_exits_is_a_clear_error(data_dir):
    # the task checks the model it built when it builds the criterion (fairseq's order) ...
    with pytest.raises(ValueError, match="acl_cross_layer needs a multi-exit model"):
        build(data_dir, ["--criterion", "acl_cross_layer"], arch="roberta")
    # ... and the criterion checks whatever model it is given
    _, model, crit = build(data_dir, ["--criterion", "acl_embed"], arch="roberta")
    _, _, cross_layer = build(data_dir, ["--criterion", "acl_cross_layer"])
    with pytest.raises(ValueError, match="acl_cross_layer needs a multi-exit model"):
        cross_layer.loss_terms(model, sample())


def test_num_classes_mismatch_is_a_clear_error(data_dir):
    task, _, _ = build(data_dir, ["--criterion", "multi_exit_ce"])
    with pytest.raises(ValueError, match="--num-classes 2 does not match .* lists 3 labels"):
        check_num_classes(2, task.label_dictionary, str(data_dir))


def naive_self_distill(outs, weight, tau):
    """W * sum over shallow exits and examples of T^2 * KL(p_final || p_exit), from the formula."""
    total = 0.0
    teacher = outs[-1].logits.double()
    for o in outs[:-1]:
        for zs, zt in zip(o.logits.double(), teacher):
            p, q = F.softmax(zt / tau, -1), F.softmax(zs / tau, -1)
            total += tau**2 * float((p * (p.log() - q.log())).sum())
    return weight * total


@pytest.mark.parametrize("criterion", ["multi_exit_ce", "acl_cross_layer"])
def test_self_distillation_against_reference(data_dir, criterion):
    weight, tau = 0.8, 2.0
    _, model, plain = build(data_dir, ["--criterion", criterion])
    _, model_sd, crit = build(
        data_dir,
        ["--criterion", criterion, "--self-distill-weight", str(weight),
         "--self-distill-temperature", str(tau)],
    )  # fmt: skip
    model_sd.load_state_dict(model.state_dict())
    model.eval(), model_sd.eval()
    s = sample()
    ce0, con0, _, log0 = plain.loss_terms(model, s)
    ce, con, n, log = crit.loss_terms(model_sd, s)
    ref = naive_self_distill(model.exit_outputs(s["net_input"]["src_tokens"]), weight, tau)
    assert ref > 0
    assert torch.equal(ce, ce0)  # CE untouched; the term is in the auxiliary group
    assert con.item() == pytest.approx(con0.item() + ref, rel=1e-5)
    assert log["self_distill_loss"].item() == pytest.approx(ref, rel=1e-5)
    assert log["contrastive_loss"].item() == pytest.approx(log0["contrastive_loss"].item())
    assert log["loss"].item() == pytest.approx((ce + con).item())
    assert "self_distill_loss" not in log0


@pytest.mark.parametrize("criterion", ["multi_exit_ce", "acl_cross_layer"])
def test_self_distillation_weight_0_is_the_plain_criterion(data_dir, criterion):
    _, model, plain = build(data_dir, ["--criterion", criterion])
    _, _, zero = build(
        data_dir,
        ["--criterion", criterion, "--self-distill-weight", "0",
         "--self-distill-temperature", "3"],
    )  # fmt: skip
    model.eval()
    s = sample()
    (ce0, con0, n0, log0), (ce, con, n, log) = plain.loss_terms(model, s), zero.loss_terms(model, s)
    assert torch.equal(ce, ce0) and torch.equal(con, con0) and n == n0
    assert log.keys() == log0.keys() and torch.equal(log["loss"], log0["loss"])


def test_self_distillation_gives_the_final_exit_no_gradient(data_dir):
    _, model, crit = build(data_dir, ["--criterion", "multi_exit_ce", "--self-distill-weight", "1"])
    model.train()
    _, aux, _, _ = crit.loss_terms(model, sample())
    aux.backward()  # the self-distillation term alone (multi_exit_ce has no contrastive term)
    heads = model.classification_heads
    final = heads["sentence_classification_head"]
    for p in final.parameters():
        assert p.grad is None or torch.count_nonzero(p.grad) == 0
    for name in ("sentence_classification_head_exit1", "sentence_classification_head_exit2"):
        assert torch.count_nonzero(heads[name].out_proj.weight.grad) > 0
