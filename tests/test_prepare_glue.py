"""acl-fairseq-prepare (``acl_fairseq.cli.prepare``) on tiny files in the official GLUE formats."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from acl_fairseq.cli import prepare as prepare_cli
from acl_fairseq.data import prepared, task_specs
from acl_fairseq.data.tokenizer import kinds as tokenizers
from acl_fairseq.data.tokenizer import parallel as tokenize

WORDS = "the a cat dog sat ran on under mat table big small red blue quickly slowly".split()
NUM_TRAIN, NUM_DEV, NUM_TEST = 8, 5, 3


def sentence(seed: int, n: int = 6) -> str:
    """A deterministic ASCII sentence."""
    words = [WORDS[(seed * 7 + k * 3) % len(WORDS)] for k in range(n)]
    return " ".join(words) + f" number{seed} ."


# Official headers (from the GLUE download).
QQP_HEADER = ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"]
MNLI_PREFIX = ["index", "promptID", "pairID", "genre", "sentence1_binary_parse",
               "sentence2_binary_parse", "sentence1_parse", "sentence2_parse",
               "sentence1", "sentence2"]  # fmt: skip
MNLI_TRAIN_HEADER = MNLI_PREFIX + ["label1", "gold_label"]
MNLI_DEV_HEADER = MNLI_PREFIX + ["label1", "label2", "label3", "label4", "label5", "gold_label"]
STSB_PREFIX = ["index", "genre", "filename", "year", "old_index", "source1", "source2",
               "sentence1", "sentence2"]  # fmt: skip

LABELS = {
    "CoLA": ["0", "1"],
    "SST-2": ["0", "1"],
    "MRPC": ["0", "1"],
    "QQP": ["0", "1"],
    "RTE": ["entailment", "not_entailment"],
    "QNLI": ["entailment", "not_entailment"],
    "MNLI": ["contradiction", "entailment", "neutral"],
}
PAIR_TASKS = {"QQP", "MNLI", "QNLI", "MRPC", "RTE", "STS-B"}


def row(task: str, i: int, s1: str, s2: str, label: str | None, kind: str) -> list[str]:
    """One line of ``task``'s ``kind`` (train/dev/test) file in the official column layout."""
    if task == "QQP":
        return [str(i), str(2 * i), str(2 * i + 1), s1, s2, label] if label else [str(i), s1, s2]
    if task == "MNLI":
        prefix = [str(i), str(100 + i), f"{100 + i}n", "fiction", f"( {s1} )", f"( {s2} )",
                  f"(ROOT {s1})", f"(ROOT {s2})", s1, s2]  # fmt: skip
        if label is None:
            return prefix
        return prefix + ([label] * 6 if kind == "dev" else [label, label])
    if task in ("QNLI", "RTE"):
        return [str(i), s1, s2] + ([label] if label else [])
    if task == "MRPC":
        return [label if label else str(i), str(1000 + i), str(2000 + i), s1, s2]
    if task == "STS-B":
        prefix = [str(i), "main-captions", "MSRvid", "2012test", f"{i:04d}", "none", "none", s1, s2]
        return prefix + ([label] if label else [])
    if task == "SST-2":
        return [s1, label] if label else [str(i), s1]
    if task == "CoLA":
        return ["gj04", label, "" if label == "1" else "*", s1] if label else [str(i), s1]
    raise AssertionError(task)


def header(task: str, kind: str) -> list[str] | None:
    """The header line of ``task``'s ``kind`` file (None for CoLA train/dev)."""
    labelled = kind != "test"
    if task == "QQP":
        return QQP_HEADER if labelled else ["id", "question1", "question2"]
    if task == "MNLI":
        return {"train": MNLI_TRAIN_HEADER, "dev": MNLI_DEV_HEADER, "test": MNLI_PREFIX}[kind]
    if task in ("QNLI",):
        return ["index", "question", "sentence"] + (["label"] if labelled else [])
    if task == "RTE":
        return ["index", "sentence1", "sentence2"] + (["label"] if labelled else [])
    if task == "MRPC":
        return ["Quality" if labelled else "index", "#1 ID", "#2 ID", "#1 String", "#2 String"]
    if task == "STS-B":
        return STSB_PREFIX + (["score"] if labelled else [])
    if task == "SST-2":
        return ["sentence", "label"] if labelled else ["index", "sentence"]
    if task == "CoLA":
        return None if labelled else ["index", "sentence"]
    raise AssertionError(task)


def write_glue_task(glue_dir: Path, task: str) -> dict[str, list[tuple[str, str, str | None]]]:
    """Write train/dev/test files of ``task``; return the expected (s1, s2, label) per split."""
    folder = glue_dir / task
    folder.mkdir(parents=True)
    files = {"train": "train.tsv", "valid": "dev.tsv", "test": "test.tsv"}
    if task == "MNLI":
        files = {"train": "train.tsv", "valid": "dev_matched.tsv", "valid1": "dev_mismatched.tsv",
                 "test": "test_matched.tsv", "test1": "test_mismatched.tsv"}  # fmt: skip
    counts = {"train": NUM_TRAIN, "valid": NUM_DEV, "valid1": NUM_DEV + 1}
    expected = {}
    for offset, (split, filename) in enumerate(files.items()):
        kind = "train" if split == "train" else "test" if split.startswith("test") else "dev"
        rows, lines = [], []
        if header(task, kind):
            lines.append("\t".join(header(task, kind)))
        for i in range(counts.get(split, NUM_TEST)):
            seed = 100 * offset + i
            s1, s2 = sentence(seed), sentence(seed + 50, 4)
            label = None
            if kind != "test":
                label = f"{(i * 0.7) % 5:.3f}" if task == "STS-B" else LABELS[task][i % 3 % 2]
                if task == "MNLI":
                    label = LABELS[task][i % 3]
            lines.append("\t".join(row(task, i, s1, s2, label, kind)))
            rows.append((s1, s2 if task in PAIR_TASKS else None, label))
        (folder / filename).write_text("\n".join(lines) + "\n", encoding="utf-8")
        expected[split] = rows
    return expected


def decode_pieces(dictionary, tensor) -> str:
    """SentencePiece pieces back to text."""
    return dictionary.string(tensor).replace(" ", "").replace("\u2581", " ").strip()


def load(prefix: Path):
    from fairseq.data import Dictionary, data_utils

    dictionary = Dictionary.load(str(prefix.parent / "dict.txt"))
    dataset = data_utils.load_indexed_dataset(str(prefix), dictionary)
    assert dataset is not None, prefix
    return dictionary, dataset


def check_task(out_dir: Path, task: str, expected: dict) -> None:
    """Assert the binarized layout and content of ``OUT/TASK-bin``."""
    bin_dir = out_dir / f"{task}-bin"
    pair = task in PAIR_TASKS
    for name in ("input0", "input1"):
        if name == "input1" and not pair:
            assert not (bin_dir / name).exists()
            continue
        assert (bin_dir / name / "dict.txt").is_file()
        for split, rows in expected.items():
            for ext in ("bin", "idx"):
                assert (bin_dir / name / f"{split}.{ext}").is_file(), (task, name, split)
            dictionary, dataset = load(bin_dir / name / split)
            assert len(dataset) == len(rows), (task, name, split)
            column = 0 if name == "input0" else 1
            for i in (0, len(rows) - 1):
                assert decode_pieces(dictionary, dataset[i]) == rows[i][column], (task, split)
    # the two inputs share one dictionary
    if pair:
        dicts = [(bin_dir / f"input{i}/dict.txt").read_text() for i in (0, 1)]
        assert dicts[0] == dicts[1]
    labelled = {s: rows for s, rows in expected.items() if not s.startswith("test")}
    meta = json.loads((bin_dir / prepared.META_FILE).read_text())
    if task == "STS-B":
        assert not (bin_dir / "label/dict.txt").exists()
        assert meta["regression"] and meta["num_classes"] == 1
        for split, rows in labelled.items():
            values = (bin_dir / f"label/{split}.label").read_text().split("\n")[:-1]
            assert [float(v) for v in values] == pytest.approx([float(r[2]) / 5 for r in rows])
            assert all(0.0 <= float(v) <= 1.0 for v in values)
        assert not (bin_dir / "label/test.label").exists()
        return
    label_dict = (bin_dir / "label/dict.txt").read_text().split("\n")
    symbols = {line.split()[0] for line in label_dict if line and not line.startswith("madeup")}
    assert symbols == set(LABELS[task])
    assert meta["num_classes"] == len(LABELS[task])
    for split, rows in labelled.items():
        dictionary, dataset = load(bin_dir / "label" / split)
        assert [dictionary.string(dataset[i]) for i in range(len(rows))] == [r[2] for r in rows]
    assert not (bin_dir / "label/test.bin").exists()


def run_main(argv: list[str]) -> int:
    return prepare_cli.main([str(a) for a in argv])


SPM_ARGS = ["--tokenizer", "sentencepiece", "--spm-vocab-size", "200", "--workers", "1"]


def test_glue_mnli_stsb_sst2(tmp_path: Path) -> None:
    """Pair task with matched/mismatched dev, regression, single-sentence task."""
    glue, out = tmp_path / "glue", tmp_path / "out"
    expected = {t: write_glue_task(glue, t) for t in ("MNLI", "STS-B", "SST-2")}
    argv = ["--glue-dir", glue, "--out-dir", out, "--tasks", "MNLI,sts-b,SST2"] + SPM_ARGS
    assert run_main(argv) == 0
    for task, rows in expected.items():
        check_task(out, task, rows)
    meta = json.loads((out / "MNLI-bin" / prepared.META_FILE).read_text())
    assert set(meta["splits"]) == {"train", "valid", "valid1", "test", "test1"}
    assert meta["splits"]["valid1"]["file"].endswith("dev_mismatched.tsv")
    assert (out / "MNLI-bin/sentencepiece.model").is_file()
    # intermediate files are removed
    assert sorted(p.name for p in out.iterdir()) == ["MNLI-bin", "SST-2-bin", "STS-B-bin"]


def test_meta_reader_rebuilds_the_recorded_tokenizer(tmp_path: Path) -> None:
    """``read_meta`` returns prepare_glue.json; ``meta_tokenizer`` encodes text as it was."""
    glue, out = tmp_path / "glue", tmp_path / "out"
    rows = write_glue_task(glue, "SST-2")["train"]
    assert run_main(["--glue-dir", glue, "--out-dir", out, "--tasks", "SST-2"] + SPM_ARGS) == 0
    bin_dir = out / "SST-2-bin"
    meta = prepared.read_meta(bin_dir)
    recorded = json.loads((bin_dir / prepared.META_FILE).read_text())
    assert {k: v for k, v in meta.items() if k != "tokenizer"} == {
        k: v for k, v in recorded.items() if k != "tokenizer"
    }
    # recorded relative to the folder, read back as a path that exists
    assert recorded["tokenizer"]["spm_model"] == "sentencepiece.model"
    assert meta["tokenizer"]["spm_model"] == str(bin_dir / "sentencepiece.model")
    assert recorded["splits"]["train"]["file"] == "../../glue/SST-2/train.tsv"
    assert meta["tokenizer"]["kind"] == "sentencepiece" and meta["num_classes"] == 2
    tokenizer = prepared.meta_tokenizer(bin_dir)
    dictionary, dataset = load(bin_dir / "input0" / "train")
    for i in range(len(rows)):
        assert " ".join(tokenizer.tokenize(rows[i][0])) == dictionary.string(dataset[i])
    with pytest.raises(task_specs.DataError, match="not found"):
        prepared.read_meta(tmp_path)


def test_glue_all_tasks(tmp_path: Path) -> None:
    """All 8 GLUE tasks in their official formats."""
    glue, out = tmp_path / "glue", tmp_path / "out"
    expected = {task: write_glue_task(glue, task) for task in task_specs.GLUE_TASKS}
    assert run_main(["--glue-dir", glue, "--out-dir", out, "--tasks", "all"] + SPM_ARGS) == 0
    for task, rows in expected.items():
        check_task(out, task, rows)


def test_glue_table_matches_fairseq_recipe() -> None:
    """Columns of fairseq's examples/roberta/preprocess_GLUE_tasks.sh."""
    recipe = {  # task: (input columns, label column, test input columns)
        "QQP": ((4, 5), 6, (2, 3)),
        "MNLI": ((9, 10), 12, (9, 10)),
        "QNLI": ((2, 3), 4, (2, 3)),
        "MRPC": ((4, 5), 1, (4, 5)),
        "RTE": ((2, 3), 4, (2, 3)),
        "STS-B": ((8, 9), 10, (8, 9)),
        "SST-2": ((1,), 2, (2,)),
        "CoLA": ((4,), 2, (2,)),
    }
    for name, (inputs, label, test_inputs) in recipe.items():
        spec = task_specs.GLUE_TASKS[name]
        train = spec.splits[0]
        assert (train.text_columns, train.label_column) == (inputs, label), name
        assert all(s.text_columns == test_inputs for s in spec.splits if s.kind == "test"), name
        assert train.header == (name != "CoLA")
    assert [s.label_column for s in task_specs.GLUE_TASKS["MNLI"].splits[1:3]] == [16, 16]
    assert task_specs.output_split_names(task_specs.GLUE_TASKS["MNLI"].splits) == [
        "train", "valid", "valid1", "test", "test1"
    ]  # fmt: skip


def write_bad_rte(glue: Path) -> Path:
    folder = glue / "RTE"
    folder.mkdir(parents=True)
    labels = ("entailment", "not_entailment")  # a training file of one class is refused
    good = [f"{i}\t{sentence(i)}\t{sentence(i + 9)}\t{labels[i % 2]}" for i in range(4)]
    train = ["index\tsentence1\tsentence2\tlabel"] + good[:2]
    train.append("2\tonly one sentence")  # line 4: missing fields
    train.append(f"3\t{sentence(3)}\t{sentence(4)}\tmaybe")  # line 5: bad label
    train.append(f"4\t{sentence(5)}\t   \tnot_entailment")  # line 6: empty text
    train += good[2:]
    (folder / "train.tsv").write_text("\n".join(train) + "\n", encoding="utf-8")
    dev = ["index\tsentence1\tsentence2\tlabel"] + good[:3]
    (folder / "dev.tsv").write_text("\n".join(dev) + "\n", encoding="utf-8")
    return folder


def test_bad_rows_reported_then_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture
) -> None:
    glue, out = tmp_path / "glue", tmp_path / "out"
    folder = write_bad_rte(glue)
    argv = ["--glue-dir", glue, "--out-dir", out, "--tasks", "RTE"] + SPM_ARGS
    with caplog.at_level(logging.WARNING, logger="prepare_glue"):
        assert run_main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("acl-fairseq-prepare: error: ")
    message = caplog.text + error
    train = str(folder / "train.tsv")
    assert "3 bad row(s)" in message
    assert f"{train}:4: missing field" in message
    assert f"{train}:5: label 'maybe' is not one of entailment, not_entailment" in message
    assert f"{train}:6: empty text in column 3" in message
    assert "Traceback" not in message
    assert not (out / "RTE-bin").exists()

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prepare_glue"):
        assert run_main(argv + ["--skip-bad-rows"]) == 0
    assert "skipping 3 bad row(s)" in caplog.text and f"{train}:5:" in caplog.text
    assert "no test split" in caplog.text
    meta = json.loads((out / "RTE-bin" / prepared.META_FILE).read_text())
    assert meta["splits"]["train"]["rows"] == 4 and meta["skipped_bad_rows"] == 3
    _, dataset = load(out / "RTE-bin/input0/train")
    assert len(dataset) == 4


def test_row_validation_units(tmp_path: Path) -> None:
    """No quoting, CRLF, BOM, strict field count for QQP, bad-row listing limit."""
    path = tmp_path / "x.tsv"
    path.write_bytes(b"\xef\xbb\xbfsentence\tlabel\r\n\"it's \t1\r\nbad \xff\t0\n\n")
    rows = list(task_specs.iter_tsv(path, header=True))
    assert rows == [(2, ["\"it's ", "1"]), (3, None), (4, [""])]
    sst = task_specs.GLUE_TASKS["SST-2"]
    texts, label, reason = task_specs.check_row(rows[0][1], sst.splits[0], sst)
    assert (texts, label, reason) == (["\"it's"], "1", None)
    assert "UTF-8" in task_specs.check_row(None, sst.splits[0], sst)[2]
    assert "missing field" in task_specs.check_row([""], sst.splits[0], sst)[2]
    qqp = task_specs.GLUE_TASKS["QQP"]
    seven_fields = ["1", "2", "3", "q1", "q2", "0", "x"]
    assert "expected 6" in task_specs.check_row(seven_fields, qqp.splits[0], qqp)[2]
    stsb = task_specs.GLUE_TASKS["STS-B"]
    assert task_specs.check_label("5.000", stsb) is None
    assert "outside" in task_specs.check_label("5.2", stsb)
    assert "not a number" in task_specs.check_label("high", stsb)
    bad = [task_specs.BadRow(path, i, "r") for i in range(25)]
    text = task_specs.format_bad_rows(bad)
    assert text.count("x.tsv:") == 20 and "and 5 more" in text


def test_custom_wordpiece(tmp_path: Path) -> None:
    """Custom TSV mode with a BERT vocab: no [CLS]/[SEP], [UNK] -> <unk>, labelled test."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokens = ["the", "movie", "was", "great", "bad", "!", "plot", "##s", "good", "."]
    (tmp_path / "vocab.txt").write_text("\n".join(specials + tokens) + "\n")
    (tmp_path / "dict.txt").write_text("".join(f"{t} 1\n" for t in tokens))  # converter format
    rows = [("The movie was great!", "pos"), ("Bad plots .", "neg"), ("the movie was good", "pos")]
    for name in ("train", "dev", "test"):
        lines = ["text\tsentiment"] + [f"{t}\t{lab}" for t, lab in rows]
        (tmp_path / f"{name}.tsv").write_text("\n".join(lines) + "\n")
    (tmp_path / "dev.tsv").write_text("text\tsentiment\nthe zebra was great\tneg\n")
    out = tmp_path / "out"
    argv = [
        "--task",
        "custom",
        "--name",
        "reviews",
        "--train",
        tmp_path / "train.tsv",
        "--valid",
        tmp_path / "dev.tsv",
        "--test",
        tmp_path / "test.tsv",
        "--text-columns",
        "1",
        "--label-column",
        "2",
        "--header",
        "--out-dir",
        out,
        "--tokenizer",
        "wordpiece",
        "--vocab",
        tmp_path / "vocab.txt",
        "--srcdict",
        tmp_path / "dict.txt",
        "--workers",
        "1",
        "--keep-intermediate",
        "--allow-overlap",
    ]  # fmt: skip  (test: train's rows)
    assert run_main(argv) == 0
    tok = (out / "reviews-tok/train.input0").read_text().split("\n")
    assert tok[:2] == ["the movie was great !", "bad plot ##s ."]
    assert (out / "reviews-tok/valid.input0").read_text() == "the <unk> was great\n"
    dictionary, dataset = load(out / "reviews-bin/input0/valid")
    words = ("the", "<unk>", "was", "great")
    assert dataset[0].tolist() == [dictionary.index(w) for w in words] + [dictionary.eos()]
    assert dictionary.unk() in dataset[0].tolist()
    _, test = load(out / "reviews-bin/label/test")  # custom test files keep their labels
    assert len(test) == 3
    assert not (out / "reviews-bin/input1").exists()

    # the tokenizer travels with the data: the folder moved, the vocabulary gone
    meta = json.loads((out / "reviews-bin" / prepared.META_FILE).read_text())
    assert meta["tokenizer"]["vocab"] == "tokenizer/vocab.txt"
    moved = tmp_path / "elsewhere" / "reviews-bin"
    moved.parent.mkdir()
    (out / "reviews-bin").rename(moved)
    (tmp_path / "vocab.txt").unlink()
    tokenizer = prepared.meta_tokenizer(moved)
    assert tokenizer.tokenize("The movie was great!") == ["the", "movie", "was", "great", "!"]
    # an older meta file with an absolute path that no longer exists: the copy is used
    meta["tokenizer"]["vocab"] = str(tmp_path / "vocab.txt")
    (moved / prepared.META_FILE).write_text(json.dumps(meta))
    assert prepared.meta_tokenizer_config(moved).vocab == str(moved / "tokenizer/vocab.txt")
    (moved / "tokenizer/vocab.txt").unlink()
    with pytest.raises(task_specs.DataError, match="tokenizer file .*vocab.txt .* not found"):
        prepared.meta_tokenizer(moved)


def test_srcdict_of_another_vocabulary_stops(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A --srcdict that does not belong to the tokenizer: most tokens would be <unk>."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokens = ["the", "movie", "was", "great", "bad", "!", "plot", "##s", "good", "."]
    (tmp_path / "vocab.txt").write_text("\n".join(specials + tokens) + "\n")
    (tmp_path / "other.txt").write_text("".join(f"{t} 1\n" for t in ["the", "was", "x", "y"]))
    lines = ["text\tlabel"] + [f"The movie was great!\t{i % 2}" for i in range(6)]
    (tmp_path / "train.tsv").write_text("\n".join(lines) + "\n")
    argv = [
        "--task",
        "custom",
        "--train",
        tmp_path / "train.tsv",
        "--valid",
        tmp_path / "train.tsv",
        "--text-columns",
        "1",
        "--label-column",
        "2",
        "--header",
        "--out-dir",
        tmp_path / "out",
        "--tokenizer",
        "wordpiece",
        "--vocab",
        tmp_path / "vocab.txt",
        "--workers",
        "1",
        "--allow-overlap",
    ]  # fmt: skip  (dev is train)
    assert run_main(argv + ["--srcdict", tmp_path / "other.txt"]) == 2
    error = capsys.readouterr().err
    # 3 of the 5 tokens of every line (movie, great, !) are not in other.txt
    assert error.startswith("acl-fairseq-prepare: error: custom: 60.0% of the train tokens (18 "
                            "of 30) are not in --srcdict")  # fmt: skip
    assert "(--tokenizer wordpiece --vocab)" in error
    assert "Use the dict.txt that matches the tokenizer" in error
    assert not (tmp_path / "out/custom-bin/input0/train.bin").exists()
    # the matching dictionary passes
    (tmp_path / "dict.txt").write_text("".join(f"{t} 1\n" for t in tokens))
    assert run_main(argv + ["--srcdict", tmp_path / "dict.txt"]) == 0


def test_wordpiece_special_tokens_and_lowercase(tmp_path: Path) -> None:
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "The"]) + "\n")
    lower = tokenizers.WordPieceTokenizer(str(vocab), None)
    assert lower.tokenize("The [SEP] Zebra [UNK]") == ["the", "</s>", "<unk>", "<unk>"]
    cased = tokenizers.WordPieceTokenizer(str(vocab), False)
    assert cased.tokenize("The the") == ["The", "the"]
    # a tokenizer.json carries its own lowercase setting; the flag overrides it
    lower.tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert tokenizers.wordpiece_lowercase_default(str(tmp_path / "tokenizer.json")) is True
    from_json = tokenizers.WordPieceTokenizer(str(tmp_path / "tokenizer.json"), False)
    assert from_json.tokenize("The") == ["The"]


def test_gpt2_tokenizer(tmp_path: Path) -> None:
    """fairseq's GPT-2 encoder with a tiny byte-level vocabulary: ids as strings."""
    from fairseq.data.encoders.gpt2_bpe_utils import bytes_to_unicode

    byte_chars = list(bytes_to_unicode().values())
    encoder = {c: i for i, c in enumerate(byte_chars)}
    encoder["Ġt"], encoder["Ġth"] = 256, 257
    (tmp_path / "encoder.json").write_text(json.dumps(encoder))
    (tmp_path / "vocab.bpe").write_text("#version: 0.2\nĠ t\nĠt h\n")
    tok = tokenizers.Gpt2Tokenizer(str(tmp_path / "encoder.json"), str(tmp_path / "vocab.bpe"))
    ids = tok.tokenize("a the")
    assert ids == [str(encoder["a"]), "257", str(encoder["e"])]
    assert tok.bpe.decode([int(i) for i in ids]) == "a the"


def test_parallel_tokenization_keeps_order(tmp_path: Path) -> None:
    """The multiprocessing path returns lines in input order."""
    corpus = [sentence(i) for i in range(30)]
    model = tokenize.train_sentencepiece(corpus, tmp_path / "sp", 100, 1.0, 1)
    config = tokenizers.TokenizerConfig("sentencepiece", spm_model=str(model))
    columns = [corpus[:17], corpus[17:]]
    lines, lengths = tokenize.tokenize_texts(config, columns, workers=2, chunk_size=4)
    serial, _ = tokenize.tokenize_texts(config, columns, workers=1, chunk_size=4)
    assert lines == serial
    assert [len(c) for c in lines] == [17, 13]
    assert lengths[0][0] == len(lines[0][0].split())
    assert lines[1][0].replace(" ", "").replace("\u2581", " ").strip() == corpus[17]


def test_argument_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    def error(*argv) -> str:
        assert run_main(["--out-dir", tmp_path, *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("acl-fairseq-prepare: error: ") and err.count("\n") == 1, err
        return err

    assert "needs --gpt2-encoder-json" in error("--tokenizer", "gpt2", "--glue-dir", tmp_path)
    assert "unknown task 'XX'" in error("--tokenizer", "sentencepiece", "--tasks", "XX",
                                        "--glue-dir", tmp_path)  # fmt: skip
    assert "missing input file" in error("--tokenizer", "sentencepiece", "--tasks", "RTE",
                                         "--glue-dir", tmp_path)  # fmt: skip
    assert "--task custom needs" in error("--tokenizer", "sentencepiece", "--task", "custom")
