"""Task specs of the preparation: the GLUE task table, TSV reading and the rows rejected."""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import AclFairseqError

logger = logging.getLogger("prepare_glue")

MAX_LISTED_BAD_ROWS = 20


class DataError(AclFairseqError):
    """A user-facing problem with the input data or the arguments (reported without traceback)."""


@dataclass(frozen=True)
class SplitSpec:
    """One input file of a task: where its columns are (1-based, as ``cut -f``)."""

    kind: str  # "train", "valid" or "test"
    filename: str  # relative to GLUE_DIR/TASK, or an absolute path (custom mode)
    text_columns: tuple[int, ...]
    label_column: int | None  # None: unlabeled (GLUE test files)
    num_fields: int | None = None  # official number of tab-separated fields, None: unknown
    header: bool = True


@dataclass(frozen=True)
class TaskSpec:
    """A sentence(-pair) classification or regression task."""

    name: str
    splits: tuple[SplitSpec, ...]
    labels: tuple[str, ...] | None = None  # allowed labels; None: anything seen in train
    regression: bool = False
    label_range: tuple[float, float] | None = None
    label_divisor: float = 1.0  # regression targets are written as value / label_divisor
    strict_num_fields: bool = False  # rows with another field count are bad (QQP, as fairseq)

    @property
    def num_inputs(self) -> int:
        """Number of text inputs (1 or 2)."""
        return len(self.splits[0].text_columns)


def _glue_splits(
    fields: int,
    text_columns: tuple[int, ...],
    label_column: int,
    test_fields: int,
    test_columns: tuple[int, ...],
    header: bool = True,
) -> tuple[SplitSpec, ...]:
    """The usual train.tsv / dev.tsv / test.tsv triple."""
    return (
        SplitSpec("train", "train.tsv", text_columns, label_column, fields, header),
        SplitSpec("valid", "dev.tsv", text_columns, label_column, fields, header),
        SplitSpec("test", "test.tsv", test_columns, None, test_fields, True),
    )


BINARY = ("0", "1")
ENTAILMENT = ("entailment", "not_entailment")

GLUE_TASKS: dict[str, TaskSpec] = {
    "QQP": TaskSpec(
        "QQP", _glue_splits(6, (4, 5), 6, 3, (2, 3)), labels=BINARY, strict_num_fields=True
    ),
    "MNLI": TaskSpec(
        "MNLI",
        (
            SplitSpec("train", "train.tsv", (9, 10), 12, 12),
            SplitSpec("valid", "dev_matched.tsv", (9, 10), 16, 16),
            SplitSpec("valid", "dev_mismatched.tsv", (9, 10), 16, 16),
            SplitSpec("test", "test_matched.tsv", (9, 10), None, 10),
            SplitSpec("test", "test_mismatched.tsv", (9, 10), None, 10),
        ),
        labels=("contradiction", "entailment", "neutral"),
    ),
    "QNLI": TaskSpec("QNLI", _glue_splits(4, (2, 3), 4, 3, (2, 3)), labels=ENTAILMENT),
    "MRPC": TaskSpec("MRPC", _glue_splits(5, (4, 5), 1, 5, (4, 5)), labels=BINARY),
    "RTE": TaskSpec("RTE", _glue_splits(4, (2, 3), 4, 3, (2, 3)), labels=ENTAILMENT),
    "STS-B": TaskSpec(
        "STS-B",
        _glue_splits(10, (8, 9), 10, 9, (8, 9)),
        regression=True,
        label_range=(0.0, 5.0),
        label_divisor=5.0,
    ),
    "SST-2": TaskSpec("SST-2", _glue_splits(2, (1,), 2, 2, (2,)), labels=BINARY),
    # CoLA train/dev have no header line (the test file has one).
    "CoLA": TaskSpec("CoLA", _glue_splits(4, (4,), 2, 2, (2,), header=False), labels=BINARY),
}


def output_split_names(splits: Sequence[SplitSpec]) -> list[str]:
    """fairseq names: the k-th file of a kind is ``kind`` for k=0, else ``kind{k}``."""
    seen: Counter[str] = Counter()
    names = []
    for split in splits:
        k = seen[split.kind]
        names.append(split.kind if k == 0 else f"{split.kind}{k}")
        seen[split.kind] += 1
    return names


def resolve_tasks(value: str) -> list[TaskSpec]:
    """Parse ``--tasks`` (``all`` or a comma list, case- and hyphen-insensitive)."""
    lookup = {name.lower().replace("-", ""): spec for name, spec in GLUE_TASKS.items()}
    if value.strip().lower() == "all":
        return list(GLUE_TASKS.values())
    tasks = []
    for raw in value.split(","):
        key = raw.strip().lower().replace("-", "")
        if key not in lookup:
            raise DataError(
                f"unknown task {raw.strip()!r}; choose from {', '.join(GLUE_TASKS)}, all or custom"
            )
        if lookup[key] not in tasks:
            tasks.append(lookup[key])
    return tasks


# --------------------------------------------------------------------------------------------
# Reading and validating rows
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BadRow:
    """A rejected row, reported as ``file:line: reason``."""

    path: Path
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass
class SplitData:
    """The good rows of one file: texts per input column and labels."""

    name: str  # fairseq split name (train, valid, valid1, test, ...)
    path: Path
    texts: list[list[str]]  # texts[input_index][row]
    labels: list[str] | None
    line_numbers: list[int] = field(default_factory=list)
    extra_field_rows: int = 0
    field_counts: Counter[int] = field(default_factory=Counter)  # tab-separated fields per row
    rows_read: int = 0  # data lines, good and bad

    def __len__(self) -> int:
        return len(self.line_numbers)


def iter_tsv(path: Path, header: bool) -> Iterable[tuple[int, list[str] | None]]:
    """``(line_number, fields)`` of a TSV file's data lines, split on tab without quoting, like
    fairseq's ``cut -f`` (GLUE text has quotes); ``fields`` is None for a line not UTF-8."""
    data = path.read_bytes()
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for index, raw in enumerate(lines):
        if header and index == 0:
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            yield index + 1, None
            continue
        if line.endswith("\r"):
            line = line[:-1]
        yield index + 1, line.split("\t")


def check_label(value: str, task: TaskSpec) -> str | None:
    """Return why ``value`` is not a valid label of ``task`` (None when it is)."""
    if not value:
        return "empty label"
    if task.regression:
        try:
            number = float(value)
        except ValueError:
            return f"label {value!r} is not a number"
        if not math.isfinite(number):
            return f"label {value!r} is not a finite number"
        if task.label_range is not None:
            low, high = task.label_range
            if not low <= number <= high:
                return f"label {value!r} is outside [{low:g}, {high:g}]"
        return None
    if task.labels is not None and value not in task.labels:
        return f"label {value!r} is not one of {', '.join(task.labels)}"
    if any(c.isspace() for c in value):
        return f"label {value!r} contains whitespace"
    return None


def check_row(
    fields: list[str] | None, split: SplitSpec, task: TaskSpec
) -> tuple[list[str], str | None, str | None]:
    """Validate one row; return ``(texts, label, reason)`` where ``reason`` is None if good."""
    if fields is None:
        return [], None, "line is not valid UTF-8"
    if task.strict_num_fields and split.num_fields and len(fields) != split.num_fields:
        return [], None, f"expected {split.num_fields} tab-separated fields, found {len(fields)}"
    columns = list(split.text_columns)
    if split.label_column is not None:
        columns.append(split.label_column)
    needed = max(columns)
    if len(fields) < needed:
        expected = split.num_fields or needed
        return (
            [],
            None,
            (
                f"missing field: expected {expected} tab-separated fields "
                f"(column {needed} needed), found {len(fields)}"
            ),
        )
    texts = [fields[c - 1].strip() for c in split.text_columns]
    for column, text in zip(split.text_columns, texts):
        if not text:
            return [], None, f"empty text in column {column}"
    label = None
    if split.label_column is not None:
        label = fields[split.label_column - 1].strip()
        reason = check_label(label, task)
        if reason:
            return [], None, f"{reason} (column {split.label_column})"
    return texts, label, None


def read_split(
    path: Path, split: SplitSpec, task: TaskSpec, name: str
) -> tuple[SplitData, list[BadRow]]:
    """Read one TSV file, keeping the good rows and returning the bad ones."""
    data = SplitData(
        name=name,
        path=path,
        texts=[[] for _ in split.text_columns],
        labels=[] if split.label_column is not None else None,
    )
    bad: list[BadRow] = []
    for line_number, fields in iter_tsv(path, split.header):
        data.rows_read += 1
        if fields is not None:
            data.field_counts[len(fields)] += 1
        texts, label, reason = check_row(fields, split, task)
        if reason is not None:
            bad.append(BadRow(path, line_number, reason))
            continue
        for column, text in zip(data.texts, texts):
            column.append(text)
        if data.labels is not None:
            data.labels.append(label)  # type: ignore[arg-type]
        data.line_numbers.append(line_number)
        if split.num_fields and fields is not None and len(fields) > split.num_fields:
            data.extra_field_rows += 1
    return data, bad


def split_path(task: TaskSpec, split: SplitSpec, glue_dir: Path | None) -> Path:
    """Where the file of ``split`` lives."""
    path = Path(split.filename)
    if path.is_absolute() or glue_dir is None:
        return path
    return glue_dir / task.name / split.filename


def load_task(task: TaskSpec, glue_dir: Path | None) -> tuple[list[SplitData], list[BadRow]]:
    """Read and validate all files of a task. Train/valid files are required, test optional."""
    names = output_split_names(task.splits)
    paths = [split_path(task, split, glue_dir) for split in task.splits]
    missing = [p for s, p in zip(task.splits, paths) if s.kind != "test" and not p.is_file()]
    if missing:
        raise DataError(f"{task.name}: missing input file(s): {', '.join(map(str, missing))}")
    missing_test = [p for s, p in zip(task.splits, paths) if s.kind == "test" and not p.is_file()]
    if missing_test:
        logger.warning(
            "%s: no test split (missing %s)", task.name, ", ".join(map(str, missing_test))
        )
    splits: list[SplitData] = []
    bad: list[BadRow] = []
    for spec, path, name in zip(task.splits, paths, names):
        if spec.kind == "test" and missing_test:
            continue
        data, split_bad = read_split(path, spec, task, name)
        if splits:
            check_same_layout(task, splits[0], task.splits[0], data, spec)
        if data.labels is not None and not task.regression:
            if task.labels is None:  # listed labels (GLUE, --labels) are taken as written
                check_label_spellings(task.name, [*splits, data])
            if spec.kind == "train":
                check_two_classes(task.name, data)
            else:
                check_classes_in_train(task.name, splits[0], data)
        if len(data) == 0:
            raise DataError(f"{task.name}: {no_usable_rows(data, split_bad, spec)}")
        if spec.kind == "train":
            check_header_row(task, spec, data)
        if data.extra_field_rows:
            logger.warning(
                "%s: %d rows of %s have more than %d fields; columns are taken by position",
                task.name,
                data.extra_field_rows,
                path,
                spec.num_fields,
            )
        splits.append(data)
        bad.extend(split_bad)
    return splits, bad


def no_usable_rows(data: SplitData, bad: Sequence[BadRow], spec: SplitSpec) -> str:
    """Why a file gave no example: empty, or each reason its rows were rejected for."""
    if data.rows_read == 0:
        return f"{data.path} has no data line" + (" after its header" if spec.header else "")
    reasons = Counter(_reason_kind(row.reason) for row in bad)
    first = {}
    for row in bad:
        first.setdefault(_reason_kind(row.reason), row)
    listed = "; ".join(
        f"{n} row(s): {first[kind].reason} (e.g. line {first[kind].line})"
        for kind, n in reasons.most_common(3)
    )
    columns = ",".join(map(str, spec.text_columns))
    return (
        f"none of the {data.rows_read} rows of {data.path} is usable: {listed}. Check "
        f"--text-columns {columns}, --label-column {spec.label_column}"
        f"{', --labels' if spec.label_column else ''} and --header against the file"
    )


def _reason_kind(reason: str) -> str:
    """A reason without its values (``label 'x' is not one of ...`` -> ``label``)."""
    return reason.split("'")[0].split(":")[0].strip()


def check_header_row(task: TaskSpec, spec: SplitSpec, data: SplitData) -> None:
    """A header line read as data: without ``--header`` the first line's label (the label
    column's name, e.g. ``label``) would become a class of its own. Raised when that label
    occurs on no other line of the training file and the labels are not given (``--labels``)."""
    if spec.header or task.labels is not None or task.regression or data.labels is None:
        return
    if len(data) < 2 or data.line_numbers[0] != 1:
        return
    first = data.labels[0]
    if data.labels.count(first) > 1:
        return
    raise DataError(
        f"{task.name}: {data.path} line 1 has the label {first!r}, which no other line has: "
        "it looks like a header line (the column names). Pass --header to skip it; if "
        f"{first!r} is a real class with one example, list every label with --labels"
    )


def _header(path: Path) -> list[str]:
    with open(path, "rb") as f:
        line = f.readline().decode("utf-8", errors="replace").lstrip("\ufeff").rstrip("\r\n")
    return [name.strip().lower() for name in line.split("\t")]


def check_same_layout(
    task: TaskSpec, train: SplitData, train_spec: SplitSpec, data: SplitData, spec: SplitSpec
) -> None:
    """A labelled file laid out unlike the training file (another header, another number of
    columns) is read by the same column numbers, so from the wrong columns: raised for tasks
    of one's own files (GLUE's official files differ on purpose, e.g. MNLI's dev)."""
    if train_spec.num_fields is not None or spec.label_column is None:
        return
    if not train.field_counts or not data.field_counts:
        return
    columns = train.field_counts.most_common(1)[0][0]
    found = data.field_counts.most_common(1)[0][0]
    if found != columns:
        raise DataError(
            f"{task.name}: {data.path} has {found} tab-separated columns, {train.path} has "
            f"{columns}: both are read with the same --text-columns / --label-column, so one "
            "of them would be read from the wrong columns. Give files of one layout"
        )
    if spec.header and train_spec.header and _header(data.path) != _header(train.path):
        raise DataError(
            f"{task.name}: the header of {data.path} ({' | '.join(_header(data.path))}) is not "
            f"the header of {train.path} ({' | '.join(_header(train.path))}): the columns may "
            "be in another order. Give files of one layout"
        )


def label_key(label: str) -> tuple[str, float | str]:
    """What a label means: its number for a number (``1``, ``1.0`` and ``+1`` are one
    value), else its text without case (``pos`` and ``Pos``)."""
    try:
        number = float(label)
    except ValueError:
        return ("text", label.casefold())
    return ("number", number) if math.isfinite(number) else ("text", label.casefold())


def check_label_spellings(task_name: str, splits: Sequence[SplitData]) -> None:
    """Two labels of the files that are one class written two ways (``1`` and ``1.0``,
    ``pos`` and ``Pos``) would become two classes: ``DataError`` naming a line of each."""
    first: dict[tuple[str, float | str], tuple[str, Path, int]] = {}
    for data in splits:
        for label, line in zip(data.labels or [], data.line_numbers):
            seen = first.setdefault(label_key(label), (label, data.path, line))
            if seen[0] != label:
                raise DataError(
                    f"{task_name}: the labels {seen[0]!r} ({seen[1]} line {seen[2]}) and "
                    f"{label!r} ({data.path} line {line}) are one class written two ways, so "
                    "they would be two classes: write each class one way in the label column"
                )


def check_two_classes(task_name: str, train: SplitData) -> None:
    """A training file of one class makes a one-class model, right on every example:
    ``DataError``."""
    found = sorted(set(train.labels or []))
    if len(found) == 1:
        raise DataError(
            f"{task_name}: every row of {train.path} has the label {found[0]!r}: a classifier "
            "needs examples of at least two classes (check the label column)"
        )


def check_classes_in_train(task_name: str, train: SplitData, data: SplitData) -> None:
    """A class of a dev or test file that the training file lacks: the model could never
    predict it, and leaving its rows out would report an accuracy without it. ``DataError``
    naming the class, how many rows have it and the first line (never a skippable bad row)."""
    known = set(train.labels or [])
    missing: dict[str, list[int]] = {}
    for label, line in zip(data.labels or [], data.line_numbers):
        if label not in known:
            missing.setdefault(label, []).append(line)
    if missing:
        listed = ", ".join(
            f"{label!r} ({len(lines)} row(s), e.g. line {lines[0]})"
            for label, lines in sorted(missing.items())
        )
        raise DataError(
            f"{task_name}: {data.path} has the class(es) {listed}, missing from the training "
            f"file {train.path}: a model trained on it could never predict them. Add examples "
            "of each class to the training file (or correct those labels)"
        )


def format_bad_rows(bad: Sequence[BadRow], limit: int = MAX_LISTED_BAD_ROWS) -> str:
    """First ``limit`` bad rows, one per line, plus how many more there are."""
    lines = [f"  {row}" for row in bad[:limit]]
    if len(bad) > limit:
        lines.append(f"  ... and {len(bad) - limit} more")
    return "\n".join(lines)


def tsv_task(
    name: str,
    train: str | Path,
    valid: str | Path,
    test: str | Path | None,
    text_columns: tuple[int, ...],
    label_column: int,
    header: bool = False,
    labels: tuple[str, ...] | None = None,
    regression: bool = False,
    label_divisor: float = 1.0,
    test_unlabeled: bool = False,
) -> TaskSpec:
    """A task of one's own TSV files (``--task custom``): 1-based text and label columns;
    ``labels``: the allowed labels (default: those of train)."""
    splits = [
        SplitSpec("train", str(Path(train).resolve()), text_columns, label_column, header=header),
        SplitSpec("valid", str(Path(valid).resolve()), text_columns, label_column, header=header),
    ]
    if test:
        test_label = None if test_unlabeled else label_column
        splits.append(
            SplitSpec("test", str(Path(test).resolve()), text_columns, test_label, header=header)
        )
    return TaskSpec(
        name,
        tuple(splits),
        labels=None if regression else labels,
        regression=regression,
        label_divisor=label_divisor,
    )
