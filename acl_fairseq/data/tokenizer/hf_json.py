"""The project's text encoding as a Hugging Face fast tokenizer (``tokenizer.json``), for the
``transformers`` export (``hf_bert.export``) and the early-exit bundle (``inference.bundle``).

``tokenizer.json`` reproduces ``ExampleEncoder``: the tokenizer recorded at preparation (BERT
WordPiece, GPT-2 byte-level BPE, SentencePiece unigram), the fairseq dictionary's ids, and the
framing of ``--init-token`` / ``--separator-token`` / ``</s>``. ``AutoTokenizer`` then gives the
ids that ``acl-fairseq-predict`` feeds the model. Tokens the tokenizer produces but the
dictionary lacks get ids after the dictionary's, on the ``<unk>`` row
(``exported_vocab``); dictionary symbols the tokenizer never produces keep their rows
under a name it does not produce. One difference, for GPT-2 none: a text holding a special
token's string (``<s>``, ``[CLS]``) reads it as that token, as ``transformers`` tokenizers do
(WordPiece in training did too; SentencePiece read unknown pieces).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...atomic_write import write_json, write_text, write_with
from ...errors import ConversionError
from .kinds import TokenizerConfig, WordPieceTokenizer

__all__ = [
    "ExportedVocab",
    "Framing",
    "HfTokenizer",
    "exported_vocab",
    "hf_tokenizer",
    "write_tokenizer",
]

#: fairseq's special symbols and the ``transformers`` role each one plays.
FAIRSEQ_ROLES = {
    "<s>": "cls_token",
    "</s>": "sep_token",
    "<pad>": "pad_token",
    "<unk>": "unk_token",
    "<mask>": "mask_token",
}
COVERED = ("wordpiece", "gpt2", "sentencepiece")
#: SentencePiece ``ModelProto.SentencePiece.Type``: the pieces ``encode`` produces.
SPM_NORMAL, SPM_USER_DEFINED, SPM_BYTE = 1, 4, 6
SPM_UNIGRAM = 1  # ``TrainerSpec.ModelType``


@dataclass(frozen=True)
class ExportedVocab:
    """A fairseq dictionary as a tokenizer's vocabulary: token ``tokens[i]`` has id ``i`` and
    the embedding row ``rows[i]`` of the fairseq model. The first ids are the dictionary's, in
    its order; then come the tokens the tokenizer can produce that the dictionary lacks, on
    the ``<unk>`` row (fairseq encodes them as ``<unk>``)."""

    tokens: list[str]
    rows: list[int]

    @property
    def ids(self) -> dict[str, int]:
        return {token: i for i, token in enumerate(self.tokens)}


def exported_vocab(
    symbols: Sequence[str],
    unk: int,
    names: Mapping[str, str],
    keep: Collection[str],
    producible: Iterable[str],
) -> ExportedVocab:
    """The dictionary ``symbols`` (``Dictionary.symbols``; ``unk``: the ``<unk>`` index) as the
    vocabulary of a tokenizer that produces the tokens ``producible``: each symbol renamed by
    ``names`` (``<s>`` -> ``[CLS]``, a GPT-2 id -> its byte-level token; a produced token
    stands for the symbol named so, else for itself); a symbol no produced token stands for
    (and not in ``keep``, the specials) becomes ``<unreachable_ID>``, which the tokenizer does
    not produce either; then the producible tokens the dictionary lacks."""
    producible = list(dict.fromkeys(producible))
    reachable = set(producible)
    symbol_of = {token: symbol for symbol, token in names.items()}
    tokens = []
    for i, symbol in enumerate(symbols):
        token = names.get(symbol, symbol)
        if symbol not in keep and (token not in reachable or symbol_of.get(token, token) != symbol):
            token = f"<unreachable_{i}>"
            while token in reachable:
                token = "_" + token
        tokens.append(token)
    seen: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if token in seen:
            raise ConversionError(
                f"the dictionary holds {token!r} twice (ids {seen[token]} and {i}, as "
                f"{symbols[seen[token]]!r} and {symbols[i]!r}): a tokenizer vocabulary needs "
                "one id per token"
            )
        seen[token] = i
    rows = list(range(len(tokens)))
    for token in producible:
        if token not in seen:
            seen[token] = len(tokens)
            tokens.append(token)
            rows.append(unk)
    return ExportedVocab(tokens, rows)


@dataclass(frozen=True)
class Framing:
    """How an example's ids are framed (``ExampleEncoder``): ``init`` (``--init-token``) first,
    ``eos`` after each text, ``separator`` (``--separator-token``) before the second text;
    dictionary ids, None: none."""

    init: int | None
    separator: int | None
    eos: int


@dataclass
class HfTokenizer:
    """A ``tokenizers`` backend on the exported vocabulary and what ``tokenizer_config.json``
    says about it."""

    backend: Any  # tokenizers.Tokenizer
    vocab: ExportedVocab
    specials: dict[str, str]  # transformers role -> token
    split_special_tokens: bool  # a special token's string in the text is text (not WordPiece)
    wordpiece: bool  # also write vocab.txt (BERT's format, read by acl-fairseq-convert-bert)


def hf_tokenizer(config: TokenizerConfig, symbols: Sequence[str], framing: Framing) -> HfTokenizer:
    """The tokenizer of ``config`` on the dictionary ``symbols`` (``Dictionary.symbols``)."""
    if config.kind not in COVERED:
        raise ConversionError(f"tokenizer {config.kind!r}: covered are {', '.join(COVERED)}")
    if "<unk>" not in symbols:
        raise ConversionError("the dictionary has no <unk>: not a fairseq dictionary")
    unk = list(symbols).index("<unk>")
    keep = [s for s in FAIRSEQ_ROLES if s in symbols]
    build = {"wordpiece": _wordpiece, "gpt2": _gpt2, "sentencepiece": _sentencepiece}
    tokenizer = build[config.kind](config, symbols, unk, keep)
    tokenizer.backend.post_processor = _template(framing, tokenizer.vocab)
    tokenizer.backend.no_truncation()
    tokenizer.backend.no_padding()
    return tokenizer


def _wordpiece(
    config: TokenizerConfig, symbols: Sequence[str], unk: int, keep: Sequence[str]
) -> HfTokenizer:
    """The recorded WordPiece tokenizer (normalizer, pre-tokenizer, added tokens as the project
    builds them) on the dictionary's ids; BERT's specials name fairseq's."""
    assert config.vocab
    project = WordPieceTokenizer(config.vocab, config.lowercase)
    backend = getattr(project.tokenizer, "_tokenizer", project.tokenizer)  # unwrap an impl.
    data = json.loads(backend.to_str())
    model = data["model"]
    names = {fairseq: bert for bert, fairseq in project.specials.items()}
    names["<unk>"] = model["unk_token"]
    added = [token["content"] for token in data.get("added_tokens", [])]
    producible = [t for t in [*model["vocab"], *added] if t]
    vocab = exported_vocab(symbols, unk, names, keep, producible)
    model["vocab"] = vocab.ids
    for token in data.get("added_tokens", []):
        token["id"] = vocab.ids[token["content"]]
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(json.dumps(data))
    specials = {FAIRSEQ_ROLES[s]: names.get(s, s) for s in keep}
    return HfTokenizer(backend, vocab, specials, split_special_tokens=False, wordpiece=True)


def gpt2_merges(vocab_bpe: str | Path) -> list[tuple[str, str]]:
    """The merges of ``vocab.bpe`` read as fairseq's GPT-2 encoder reads them (first and last
    lines dropped)."""
    lines = Path(vocab_bpe).read_text(encoding="utf-8").split("\n")[1:-1]
    return [tuple(line.split()) for line in lines]  # type: ignore[misc]


def _gpt2(
    config: TokenizerConfig, symbols: Sequence[str], unk: int, keep: Sequence[str]
) -> HfTokenizer:
    """GPT-2 byte-level BPE (``encoder.json``, ``vocab.bpe``) on the dictionary's ids: the
    dictionary holds GPT-2 ids as strings, the vocabulary their byte-level tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    assert config.gpt2_encoder_json and config.gpt2_vocab_bpe
    encoder = json.loads(Path(config.gpt2_encoder_json).read_text(encoding="utf-8"))
    names = {str(i): token for token, i in encoder.items()}
    vocab = exported_vocab(symbols, unk, names, keep, encoder)
    backend = Tokenizer(models.BPE(vocab.ids, gpt2_merges(config.gpt2_vocab_bpe)))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = {FAIRSEQ_ROLES[s]: s for s in keep}
    return HfTokenizer(backend, vocab, specials, split_special_tokens=True, wordpiece=False)


def _sentencepiece(
    config: TokenizerConfig, symbols: Sequence[str], unk: int, keep: Sequence[str]
) -> HfTokenizer:
    """A SentencePiece unigram model (its pieces and scores, its normalizer) on the
    dictionary's ids: the same lattice, the same best segmentation. Symbols that are no piece
    (the specials, padding words) get the lowest piece score."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    assert config.spm_model
    proto = _spm_proto(config.spm_model)
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    user = [p.piece for p in proto.pieces if p.type == SPM_USER_DEFINED]
    if spec.model_type != SPM_UNIGRAM or user or not norm.escape_whitespaces:
        what = "user-defined symbols" if user else "not a unigram model with escaped spaces"
        raise ConversionError(f"{config.spm_model}: {what}; only unigram models are covered")
    produced = (SPM_NORMAL, SPM_BYTE) if spec.byte_fallback else (SPM_NORMAL,)
    scores = {p.piece: p.score for p in proto.pieces if p.type in produced}
    vocab = exported_vocab(symbols, unk, {}, keep, scores)
    lowest = min(scores.values())
    pieces = [(token, scores.get(token, lowest)) for token in vocab.tokens]
    backend = Tokenizer(models.Unigram(pieces, unk_id=unk, byte_fallback=spec.byte_fallback))
    steps = []
    if norm.precompiled_charsmap:
        steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:
        steps += [
            normalizers.Strip(left=False, right=True),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    backend.normalizer = normalizers.Sequence(steps)
    prepend = "always" if norm.add_dummy_prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace("\u2581", prepend_scheme=prepend, split=False)
    backend.decoder = decoders.Metaspace("\u2581", prepend_scheme=prepend, split=False)
    specials = {FAIRSEQ_ROLES[s]: s for s in keep}
    return HfTokenizer(backend, vocab, specials, split_special_tokens=False, wordpiece=False)


def _spm_proto(path: str) -> Any:
    """The ``ModelProto`` of a SentencePiece model file (needs ``protobuf``)."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError as e:
        raise ConversionError(
            f"reading {path} needs protobuf ({e}): pip install protobuf"
        ) from None
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(path).read_bytes())
    return proto


def _template(framing: Framing, vocab: ExportedVocab) -> Any:
    """``TemplateProcessing``: ``[init] A eos`` and ``[init] A eos [separator] B eos``."""
    from tokenizers import processors

    name = vocab.tokens.__getitem__
    single = ([f"{name(framing.init)}:0"] if framing.init is not None else []) + [
        "$A:0",
        f"{name(framing.eos)}:0",
    ]
    second = [f"{name(framing.separator)}:1"] if framing.separator is not None else []
    pair = [*single, *second, "$B:1", f"{name(framing.eos)}:1"]
    ids = [i for i in (framing.init, framing.separator, framing.eos) if i is not None]
    specials = list({name(i): i for i in ids}.items())
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def write_tokenizer(tokenizer: HfTokenizer, out_dir: Path, max_length: int) -> list[str]:
    """Writes ``tokenizer.json``, ``tokenizer_config.json`` (``PreTrainedTokenizerFast``: the
    json as it is), ``special_tokens_map.json`` and, for WordPiece, ``vocab.txt``; returns the
    file names."""
    write_with(out_dir / "tokenizer.json", tokenizer.backend.save)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": int(max_length),
        "padding_side": "right",  # BERT's positions count from the left
        "truncation_side": "right",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": tokenizer.split_special_tokens,
        **tokenizer.specials,
    }
    files = {
        "tokenizer_config.json": config,
        "special_tokens_map.json": tokenizer.specials,
    }
    for name, content in files.items():
        write_json(out_dir / name, content, indent=2)
    names = ["tokenizer.json", *files]
    if tokenizer.wordpiece:
        lines = "".join(f"{token}\n" for token in tokenizer.vocab.tokens)
        write_text(out_dir / "vocab.txt", lines)
        names.append("vocab.txt")
    return names
