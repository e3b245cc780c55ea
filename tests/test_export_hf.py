"""``acl-fairseq-export-hf``: a fine-tuned checkpoint as a Hugging Face ``transformers`` folder.

The folder is loaded by the stock ``AutoModelForSequenceClassification`` / ``AutoTokenizer``
(local files only, no remote code) and must give the fairseq model's numbers: the tokenizer the
ids of the project's ``ExampleEncoder`` (equal), the model its logits (``TINY_TOL`` on the tiny
models, ``MINILM_TOL`` on MiniLM-L6 and real sentences). The fast tests use tiny models and
hand-made WordPiece / GPT-2 vocabularies; the slow ones train through ``fairseq-train``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from acl_fairseq.data.text_encoder import ExampleEncoder, TextEncoder
from acl_fairseq.data.tokenizer.hf_json import Framing, exported_vocab
from acl_fairseq.data.tokenizer.kinds import TokenizerConfig, build_tokenizer
from acl_fairseq.hf_bert.export import export_model
from acl_fairseq.hf_bert.state import ConversionError

from tiny_models import HEAD, build_with_task

TINY_TOL = 1e-5  # max |logit difference|, tiny models
LABELS = ["neg", "neutral", "pos"]
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = [f"w{i}" for i in range(30)]
REAL_TEXTS = [
    "A gripping, beautifully acted film.",
    "The plot is thin and the jokes fall flat.",
    "It's not great, but it's not bad either!",
]
SENTENCES = [
    "w1 w2 W3 w4s, film w5.",
    "w29 zebra w7 w7 w7 w0 [MASK] w12",
    "A gripping, beautifully acted film!",
    "w3",
    "Ñandú w8 café w9 日本 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19",
]


def hf_auto(folder: Path):
    """(tokenizer, model in eval mode) as the stock ``Auto*`` classes load ``folder``: local
    files only, no remote code."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    kwargs = {"local_files_only": True, "trust_remote_code": False}
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    model = AutoModelForSequenceClassification.from_pretrained(folder, **kwargs)
    return tokenizer, model.eval()


def perturb(model) -> None:
    """Random weights everywhere (default inits have zero biases and unit LayerNorms, which
    would hide a mapping mistake)."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if "layer_norm" in name or "layernorm" in name:
                param.copy_(1 + 0.2 * noise if name.endswith("weight") else 0.2 * noise)
            else:
                param.copy_(0.3 * noise)


def padded(rows: list[torch.Tensor], pad: int) -> torch.Tensor:
    tokens = torch.full((len(rows), max(len(r) for r in rows)), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = row
    return tokens


def as_fairseq(ids: torch.Tensor, dictionary) -> list[int]:
    """Exported ids as the dictionary's: the ids after the dictionary's are tokens it lacks,
    which fairseq reads as ``<unk>`` (their rows are ``<unk>``'s)."""
    return [i if i < len(dictionary) else dictionary.unk() for i in ids.tolist()]


def exit_logits(model, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    """``{layer: B x K logits}`` of every exit of the fairseq model."""
    with torch.no_grad():
        return {o.layer: o.logits for o in model.exit_outputs(tokens, HEAD)}


def encoder_of(config: TokenizerConfig, task, framing: Framing, inputs: int) -> ExampleEncoder:
    """The project's encoder of raw text for ``task``'s dictionary (what predict uses)."""
    return ExampleEncoder(
        text=TextEncoder(build_tokenizer(config)),
        dictionary=task.source_dictionary,
        num_inputs=inputs,
        init_token=framing.init,
        separator_token=framing.separator,
        max_positions=64,
        truncate=False,
    )


def check_export(
    folder: Path, model, task, config, framing: Framing, examples: list, layer: int = 4
) -> tuple[list[torch.Tensor], dict]:
    """The stock classes on ``folder`` against the fairseq ``model``: the ids of the project's
    encoder for ``examples`` (texts, or pairs), the logits of the exit at ``layer``; returns
    (the project's ids, the tokenizer's batch)."""
    tokenizer, hf = hf_auto(folder)
    d = task.source_dictionary
    pairs = not isinstance(examples[0], str)
    encoder = encoder_of(config, task, framing, 2 if pairs else 1)
    expected = [encoder.encode(list(e) if pairs else [e]) for e in examples]
    texts = [list(t) for t in zip(*examples)] if pairs else [examples]
    batch = tokenizer(*texts, padding=True, return_tensors="pt")
    for i, ids in enumerate(expected):
        assert as_fairseq(batch["input_ids"][i, : len(ids)], d) == ids.tolist(), examples[i]
        assert batch["attention_mask"][i].sum() == len(ids)
    with torch.no_grad():
        got = hf(**batch).logits
    want = exit_logits(model, padded(expected, d.pad()))[layer]
    assert want.abs().max() > 0.5  # not vacuous
    assert (got - want).abs().max() < TINY_TOL
    return expected, batch


# ----------------------------------------------------------------------------- vocabulary


def test_exported_vocab_renames_keeps_and_appends():
    symbols = ["<s>", "<pad>", "</s>", "<unk>", "w0", "zzz", "##s", "[CLS]", "<mask>"]
    names = {"<s>": "[CLS]", "<pad>": "[PAD]", "</s>": "[SEP]", "<unk>": "[UNK]"}
    names["<mask>"] = "[MASK]"
    producible = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "w0", "##s", "film", "w0"]
    vocab = exported_vocab(symbols, 3, names, ["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                           producible)  # fmt: skip
    # zzz: never produced; the literal [CLS] symbol: a produced [CLS] stands for <s>
    assert vocab.tokens == ["[CLS]", "[PAD]", "[SEP]", "[UNK]", "w0", "<unreachable_5>", "##s",
                            "<unreachable_7>", "[MASK]", "film"]  # fmt: skip
    assert vocab.rows == [0, 1, 2, 3, 4, 5, 6, 7, 8, 3]  # film: <unk>'s row
    assert vocab.ids["film"] == 9
    with pytest.raises(ConversionError, match="holds '\\[UNK\\]' twice"):
        exported_vocab(["<unk>", "x"], 0, {"<unk>": "[UNK]", "x": "[UNK]"}, ["<unk>", "x"], [])


# ----------------------------------------------------------------------------- tiny models


def write_wordpiece(root: Path, words: list[str] = WORDS) -> TokenizerConfig:
    """``root/vocab.txt`` (BERT's specials, ``words``, ``##s``, ``film``: not in the model's
    dictionary) and ``root/input0/dict.txt`` (``words`` in another order, and ``zzz``, which
    the tokenizer never produces), ``root/label/dict.txt``."""
    vocab = [*BERT_SPECIALS, *words, "##s", "film", ",", ".", "!"]
    (root / "vocab.txt").write_text("".join(f"{t}\n" for t in vocab), encoding="utf-8")
    (root / "input0").mkdir(parents=True)
    (root / "label").mkdir()
    symbols = [*reversed(words), "zzz", "##s", ",", "."]
    (root / "input0" / "dict.txt").write_text("".join(f"{s} 1\n" for s in symbols))
    (root / "label" / "dict.txt").write_text("".join(f"{c} 1\n" for c in LABELS))
    return TokenizerConfig("wordpiece", vocab=str(root / "vocab.txt"), lowercase=True)


@pytest.fixture(scope="module")
def wordpiece_model(tmp_path_factory):
    """(tiny 4-layer multi-exit model with random weights, its task, its WordPiece config)."""
    root = tmp_path_factory.mktemp("wordpiece")
    config = write_wordpiece(root)
    model, task = build_with_task(root)  # 4 layers, an exit after each
    perturb(model)
    return model, task, config


def export(model, task, config, out: Path, framing: Framing, layer=None, labels=LABELS):
    return export_model(model, out, config, task.source_dictionary.symbols, framing, 64,
                        labels, layer=layer)  # fmt: skip


@pytest.mark.parametrize("layer", [None, 1, 3])
def test_wordpiece_export_gives_the_models_ids_and_logits(wordpiece_model, tmp_path, layer):
    model, task, config = wordpiece_model
    framing = Framing(init=0, separator=None, eos=task.source_dictionary.eos())
    summary = export(model, task, config, tmp_path, framing, layer)
    assert summary.layer == (layer or 4) and summary.num_layers == 4
    assert summary.unknown_tokens == 2  # film and "!": in vocab.txt, not in the dictionary
    _, hf = hf_auto(tmp_path)
    assert type(hf).__name__ == "BertForSequenceClassification"
    assert hf.config.num_hidden_layers == (layer or 4)
    assert hf.config.id2label == dict(enumerate(LABELS)) and hf.config.label2id["pos"] == 2
    assert "auto_map" not in json.loads((tmp_path / "config.json").read_text())
    expected, batch = check_export(tmp_path, model, task, config, framing, SENTENCES, layer or 4)
    d = task.source_dictionary
    assert (expected[1] == d.unk()).sum() == 1  # zebra
    assert batch["input_ids"].max() >= len(d)  # film: in vocab.txt, not in the dictionary


def test_sentence_pairs_are_framed_as_in_training(wordpiece_model, tmp_path):
    """``<s> a </s> </s> b </s>`` (``--init-token 0 --separator-token 2``): BERT's ``[CLS] a
    [SEP] [SEP] b [SEP]``, from ``tokenizer(a, b)``."""
    model, task, config = wordpiece_model
    d = task.source_dictionary
    framing = Framing(init=d.bos(), separator=d.eos(), eos=d.eos())
    export(model, task, config, tmp_path, framing)
    pairs = [(SENTENCES[0], SENTENCES[1]), (SENTENCES[3], SENTENCES[4])]
    _, batch = check_export(tmp_path, model, task, config, framing, pairs)
    tokenizer, _ = hf_auto(tmp_path)
    text = tokenizer.convert_ids_to_tokens(batch["input_ids"][1].tolist())
    assert text[:4] == ["[CLS]", "w3", "[SEP]", "[SEP]"]


@pytest.mark.parametrize(
    ("extra", "layer", "message"),
    [
        (("--exit-pooling", "mean"), None, "--exit-pooling mean: no stock transformers"),
        (("--exit-head", "linear"), 2, "linear head (--exit-head linear)"),
        (("--pooler-activation-fn", "relu"), None, "--pooler-activation-fn relu"),
        (("--encoder-normalize-before",), None, "pre-norm"),
        ((), 5, "--exit 5: the model has exits at layers 1, 2, 3, 4"),
    ],
)
def test_what_a_stock_bert_cannot_hold_is_refused(tmp_path, extra, layer, message):
    config = write_wordpiece(tmp_path)
    model, task = build_with_task(tmp_path, extra=extra)
    framing = Framing(0, None, task.source_dictionary.eos())
    with pytest.raises(ConversionError, match="^exit |^--exit ") as info:
        export(model, task, config, tmp_path / "out", framing, layer)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_a_linear_model_still_exports_its_final_exit(tmp_path):
    config = write_wordpiece(tmp_path)
    model, task = build_with_task(tmp_path, extra=("--exit-head", "linear"))
    perturb(model)
    framing = Framing(0, None, task.source_dictionary.eos())
    export(model, task, config, tmp_path / "out", framing)
    check_export(tmp_path / "out", model, task, config, framing, SENTENCES)


def test_sentencepiece_export_gives_the_models_ids_and_logits(tmp_path):
    """A unigram model trained as ``acl-fairseq-prepare`` trains it, its dictionary (every
    piece, padded with ``madeupword``s): the same segmentation, unknown characters included."""
    from acl_fairseq.data.tokenizer.parallel import sentencepiece_dictionary, train_sentencepiece

    from fairseq_helpers import write_tsv

    texts = [row[0] for row in write_tsv(tmp_path / "train.tsv", 200, 0)] + REAL_TEXTS
    spm = train_sentencepiece(texts, tmp_path / "sp", 150, 1.0, 1)
    config = TokenizerConfig("sentencepiece", spm_model=str(spm))
    lines = [TextEncoder(build_tokenizer(config)).encode(t) for t in texts]
    (tmp_path / "input0").mkdir()
    (tmp_path / "label").mkdir()
    sentencepiece_dictionary(spm, lines, tmp_path / "input0" / "dict.txt")
    (tmp_path / "label" / "dict.txt").write_text("".join(f"{c} 1\n" for c in LABELS))
    model, task = build_with_task(tmp_path)
    perturb(model)
    d = task.source_dictionary
    framing = Framing(init=d.bos(), separator=d.eos(), eos=d.eos())
    export(model, task, config, tmp_path / "out", framing)
    pairs = [(SENTENCES[i], SENTENCES[-1 - i]) for i in range(len(SENTENCES))]
    pairs += [("  Good3   bad1\tw2  ", "Ｆｕｌｌ　ｗｉｄｔｈ ﬁne 😀 qq"), ("x", " ")]
    expected, _ = check_export(tmp_path / "out", model, task, config, framing, pairs)
    assert any((e == d.unk()).any() for e in expected)  # unknown characters


# ----------------------------------------------------------------------------- GPT-2 BPE


GPT2_WORDS = ["good", "bad", "film", "the", "acted", "café"]


def write_gpt2(root: Path) -> TokenizerConfig:
    """A GPT-2 byte-level BPE that spells ``GPT2_WORDS`` (with and without a leading space) in
    whole tokens, and a fairseq dictionary of some of its ids (RoBERTa's kind): not every
    byte, and ``madeupword0000`` as RoBERTa's dictionaries have."""
    from fairseq.data.encoders.gpt2_bpe_utils import bytes_to_unicode

    byte_char = bytes_to_unicode()  # byte -> its character
    encoder = {c: i for i, c in enumerate(byte_char.values())}
    merges: list[str] = []
    for word in GPT2_WORDS:
        for spelled in (word, " " + word):  # a space is the byte-level "Ġ"
            chars = "".join(byte_char[b] for b in spelled.encode("utf-8"))
            left = chars[0]
            for ch in chars[1:]:
                if f"{left} {ch}" not in merges:
                    merges.append(f"{left} {ch}")
                left += ch
                encoder.setdefault(left, len(encoder))
    (root / "encoder.json").write_text(json.dumps(encoder), encoding="utf-8")
    (root / "vocab.bpe").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    ids = sorted(encoder.values(), key=lambda i: (-(i >= 256), i))  # words first, then bytes
    kept = [i for i in ids if i % 7 != 3]  # some bytes are not in the dictionary: <unk>
    (root / "input0").mkdir(parents=True)
    (root / "label").mkdir()
    lines = [f"{i} {1000 - n}\n" for n, i in enumerate(kept)] + ["madeupword0000 0\n"]
    (root / "input0" / "dict.txt").write_text("".join(lines))
    (root / "label" / "dict.txt").write_text("".join(f"{c} 1\n" for c in LABELS))
    return TokenizerConfig("gpt2", gpt2_encoder_json=str(root / "encoder.json"),
                           gpt2_vocab_bpe=str(root / "vocab.bpe"))  # fmt: skip


def test_gpt2_export_gives_the_models_ids_and_logits_on_pairs(tmp_path):
    config = write_gpt2(tmp_path)
    model, task = build_with_task(tmp_path)
    perturb(model)
    d = task.source_dictionary
    framing = Framing(init=d.bos(), separator=d.eos(), eos=d.eos())
    summary = export(model, task, config, tmp_path / "out", framing)
    assert summary.unknown_tokens > 0  # the bytes the dictionary lacks
    pairs = [
        ("the film, good!", " bad  acted\tfilm"),
        ("Café <s> the\n film", "x"),  # a special token's string is text, as in fairseq
        ("good", "the bad café, 1999 ✓"),
    ]
    expected, _ = check_export(tmp_path / "out", model, task, config, framing, pairs)
    assert any((e == d.unk()).any() for e in expected) and d.index("madeupword0000") > 3


# ----------------------------------------------------------------------------- end to end

MINILM_TOL = 1e-5  # max |logit difference| on MiniLM-L6 and real sentences


def trained_checkpoint(root: Path, hf_dir: Path, rows: dict[str, list[list[str]]]) -> Path:
    """``hf_dir`` converted (``acl-fairseq-convert-bert``), ``rows`` prepared with its
    WordPiece tokenizer, and a multi-exit model fine-tuned from it for a few updates
    (``fairseq-train``); returns ``root/ckpt/checkpoint_last.pt``."""
    from acl_fairseq.experiment.demo_assets import prepare_tsv
    from acl_fairseq.experiment.recipe import multi_exit_arch
    from acl_fairseq.hf_bert.convert import convert

    from fairseq_helpers import fairseq_train, train_args

    convert(hf_dir, root / "M")
    (root / "raw").mkdir()
    for split, split_rows in rows.items():
        lines = "".join("\t".join(r) + "\n" for r in split_rows)
        (root / "raw" / f"{split}.tsv").write_text(lines, encoding="utf-8")
    data = prepare_tsv(root / "raw", "task", root / "M", root / "data")
    flags = multi_exit_arch((root / "M" / "fairseq_args.txt").read_text().split())
    args = train_args(flags, criterion="multi_exit_ce", max_update=4, no_epoch_checkpoints=True)
    fairseq_train(data, root / "ckpt", *args, "--restore-file", str(root / "M" / "model.pt"),
                  "--reset-optimizer")  # fmt: skip
    return root / "ckpt" / "checkpoint_last.pt"


def fairseq_exits(checkpoint: Path, examples: list):
    """(``{layer: logits}`` of the checkpoint's exits, its labels, the ids of each example: a
    text, or a list of texts)."""
    from acl_fairseq.inference.loader import load_for_inference

    loaded = load_for_inference(checkpoint, text="required")
    ids = [loaded.examples.encode([e] if isinstance(e, str) else e) for e in examples]
    tokens = padded(ids, loaded.task.source_dictionary.pad())
    return exit_logits(loaded.model, tokens), loaded.labels, ids


def hf_logits(folder: Path, examples: list) -> torch.Tensor:
    """The exported model's logits of ``examples`` (texts, or pairs of texts)."""
    tokenizer, hf = hf_auto(folder)
    texts = [examples] if isinstance(examples[0], str) else [list(t) for t in zip(*examples)]
    with torch.no_grad():
        return hf(**tokenizer(*texts, padding=True, return_tensors="pt")).logits


@pytest.fixture(scope="module")
def tiny_trained(tmp_path_factory) -> dict:
    """A tiny BERT (tests/tiny_bert.py) fine-tuned as a 2-layer multi-exit model on the
    sentiment TSV of fairseq_helpers; its test sentences and a few real ones."""
    from fairseq_helpers import write_tsv
    from tiny_bert import tiny_bert

    root = tmp_path_factory.mktemp("export_e2e")
    rows = {s: write_tsv(root / f"{s}.tsv", n, seed) for s, n, seed in
            [("train", 64, 0), ("dev", 16, 1), ("test", 24, 2)]}  # fmt: skip
    ckpt = trained_checkpoint(root, tiny_bert(root / "hf"), rows)
    return {"root": root, "ckpt": ckpt, "sentences": [r[0] for r in rows["test"]] + REAL_TEXTS}


def run_predict(*argv: str, stdin: str) -> list[list[str]]:
    import io

    from acl_fairseq.cli import predict

    out, err = io.StringIO(), io.StringIO()
    assert predict.main(list(argv), io.StringIO(stdin), out, err) == 0, err.getvalue()
    return [line.split("\t") for line in out.getvalue().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize(("layer", "policy"), [(None, "none"), (1, "patience:0")])
def test_the_command_exports_what_predict_predicts(tiny_trained, tmp_path, layer, policy):
    """``acl-fairseq-export-hf CKPT OUT [--exit 1]``: the stock classes give the labels and
    probabilities of ``acl-fairseq-predict`` (full depth; ``patience:0`` leaves every
    sentence at exit 1), and the checkpoint's exit logits."""
    from acl_fairseq.cli import export_hf as cli

    ckpt, sentences = tiny_trained["ckpt"], tiny_trained["sentences"]
    argv = [str(ckpt), str(tmp_path / "hf"), *(["--exit", str(layer)] if layer else [])]
    assert cli.main(argv) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    exits, labels, _ = fairseq_exits(ckpt, sentences)
    assert config["id2label"] == {str(i): n for i, n in enumerate(labels)}
    assert sorted(labels) == ["neg", "pos"]
    assert config["acl_fairseq"]["exit_layer"] == (layer or 2)
    got = hf_logits(tmp_path / "hf", sentences)
    assert (got - exits[layer or 2]).abs().max() < TINY_TOL
    predicted = run_predict(str(ckpt), "--policy", policy, stdin="\n".join(sentences) + "\n")
    probs = got.softmax(-1)
    assert len(predicted) == len(sentences)
    for (label, prob, exit_layer), p in zip(predicted, probs, strict=True):
        assert label == labels[int(p.argmax())]
        assert abs(float(prob) - float(p.max())) < 1e-4 and int(exit_layer) == (layer or 2)


@pytest.mark.slow
def test_the_round_trip_through_convert_bert_predicts_the_same(tiny_trained, tmp_path):
    """export -> ``acl-fairseq-convert-bert`` -> a fairseq model on the converted folder,
    encoding text with its tokenizer and dictionary as preparation would: the same logits."""
    from fairseq import checkpoint_utils

    from acl_fairseq.cli import convert_bert as convert_cli
    from acl_fairseq.data.tokenizer.flags import model_folder_tokenizer

    from fairseq_helpers import fairseq_setup

    ckpt, sentences = tiny_trained["ckpt"], tiny_trained["sentences"]
    assert export_checkpoint_main(ckpt, tmp_path / "hf") == 0
    assert convert_cli.main([str(tmp_path / "hf"), str(tmp_path / "back"), "--quiet"]) == 0
    back = tmp_path / "back"
    data = tmp_path / "data"
    (data / "input0").mkdir(parents=True)
    (data / "label").mkdir()
    (data / "input0" / "dict.txt").write_text((back / "dict.txt").read_text())
    (data / "label" / "dict.txt").write_text("0 1\n1 1\n")
    flags = (back / "fairseq_args.txt").read_text().split()
    task_flags = ["--task", "sentence_prediction", "--criterion", "sentence_prediction"]
    cfg, task, model = fairseq_setup([data, *task_flags, "--num-classes", "2", *flags])
    state = checkpoint_utils.load_checkpoint_to_cpu(str(back / "model.pt"))
    model.load_state_dict(state["model"], strict=True, model_cfg=cfg.model)
    config, _ = model_folder_tokenizer(back)
    d = task.source_dictionary
    encoder = encoder_of(config, task, Framing(d.bos(), None, d.eos()), 1)
    ids = [encoder.encode([s]) for s in sentences]
    with torch.no_grad():
        got = model.eval()(padded(ids, d.pad()), classification_head_name=HEAD)[0]
    exits, _, original = fairseq_exits(ckpt, sentences)
    assert [len(i) for i in ids] == [len(i) for i in original]
    assert (got - exits[2]).abs().max() < TINY_TOL
    assert got.argmax(-1).tolist() == exits[2].argmax(-1).tolist()


def export_checkpoint_main(ckpt: Path, out: Path, *flags: str) -> int:
    from acl_fairseq.cli import export_hf as cli

    return cli.main([str(ckpt), str(out), *flags])


@pytest.mark.slow
def test_minilm_on_real_sentences(tmp_path):
    """MiniLM-L6 (the demo's BERT) fine-tuned a few updates on the demo's movie sentences,
    exported at its final exit and at exit 3: the logits of the real test sentences within
    ``MINILM_TOL`` of the fairseq model's (the same float32 math in another order)."""
    from acl_fairseq.experiment.demo_assets import fetch_assets, polarity_rows

    hf_dir, snippets = fetch_assets(tmp_path)
    rows = [[text, label] for text, label in polarity_rows(snippets)[:112]]
    splits = {"train": rows[:64], "dev": rows[64:80], "test": rows[80:]}
    ckpt = trained_checkpoint(tmp_path, hf_dir, splits)
    sentences = [r[0] for r in splits["test"]]
    exits, _, ids = fairseq_exits(ckpt, sentences)
    assert sum(int((i == 3).sum()) for i in ids) < len(sentences)  # real words, few <unk>
    for layer in (None, 3):
        out = tmp_path / f"hf{layer}"
        assert export_checkpoint_main(ckpt, out, *(["--exit", "3"] if layer else [])) == 0
        got = hf_logits(out, sentences)
        diff = float((got - exits[layer or 6]).abs().max())
        print(f"MiniLM exit {layer or 6}: max |logit difference| {diff:.2e}")
        assert diff < MINILM_TOL
        assert got.argmax(-1).tolist() == exits[layer or 6].argmax(-1).tolist()


@pytest.mark.slow
def test_a_sentencepiece_pair_checkpoint_trained_from_scratch(tmp_path):
    """The tests' usual checkpoint: sentence pairs prepared with SentencePiece, a tiny
    multi-exit model trained from scratch with ``--separator-token 2``; every exit."""
    from fairseq_helpers import TINY_MULTI_EXIT, fairseq_train, prepare_tsv_task, train_args

    data, rows = prepare_tsv_task(tmp_path, pair=True)
    args = train_args(TINY_MULTI_EXIT, criterion="multi_exit_ce", max_update=4,
                      no_epoch_checkpoints=True)  # fmt: skip
    fairseq_train(data, tmp_path / "ckpt", *args, "--separator-token", "2")
    ckpt = tmp_path / "ckpt" / "checkpoint_last.pt"
    examples = [row[:2] for row in rows] + [["Ünïcode ✓ text", "  spaced   out  "]]
    exits, _, _ = fairseq_exits(ckpt, examples)
    for layer in (1, 2, 3, 4):
        assert export_checkpoint_main(ckpt, tmp_path / f"hf{layer}", "--exit", str(layer)) == 0
        got = hf_logits(tmp_path / f"hf{layer}", examples)
        assert (got - exits[layer]).abs().max() < TINY_TOL
