"""Byte-level BPE tokenizer: train one on the corpus, save/load it, tokenize a dataset.

The tokenizer is trained with HF `tokenizers` and saved with `save_pretrained`, so
`transformers.AutoTokenizer.from_pretrained(out_dir)` loads it offline. Byte-level means every
string round-trips exactly (no unknown tokens). Encoding never adds BOS/EOS: the packer puts
one EOS after each document itself.

Very long documents (over ``MAX_PIECE_CHARS`` characters) are trained on and encoded in pieces
cut just before a single space between two words, so memory stays bounded: a tokenizer handed a
53 MB string at once holds every pre-token and offset of it (gigabytes). A byte-level BPE never
merges across such a cut (its pre-tokens never end in a space before a word), so the pieces give
exactly the tokens of the whole text; another tokenizer (``tokenizer.path``) may differ at a cut.

Tokenizing a corpus encodes with tiktoken's engine where that provably gives this tokenizer's ids
(:mod:`dipaco.data.fast_bpe`: the byte-level BPE trained here qualifies), else with HF's own.
"""

from __future__ import annotations

import itertools
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import datasets
import numpy as np
import pyarrow as pa
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dipaco.data.fast_bpe import tiktoken_bpe
from dipaco.data.reading import WRITER_BATCH_ROWS, SplitReader, release_mappings
from dipaco.errors import ConfigError, DataError

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN]  # ids 0 and 1
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte, plus the special tokens
LOG_EVERY_S = 10.0  # while the trainer reads a large corpus, a line this often
MAX_PIECE_CHARS = 1 << 20  # longer texts are tokenized in pieces of at most this many characters
_CUT = re.compile(r"(?<=\S) (?=\S)")  # a single space between two non-space characters


def text_pieces(text: str, max_chars: int | None = None) -> Iterator[str]:
    """``text`` in consecutive pieces of at most ``max_chars`` (default ``MAX_PIECE_CHARS``)
    characters that join back to it.

    Each cut is just before a single space between two words (searched in the second half of the
    window); a text without one there is cut at ``max_chars``.
    """
    max_chars = max_chars or MAX_PIECE_CHARS
    start, n = 0, len(text)
    while n - start > max_chars:
        end = start + max_chars
        cut = None
        for match in _CUT.finditer(text, start + max_chars // 2, end):
            cut = match.start()
        cut = cut if cut is not None and cut > start else end
        yield text[start:cut]
        start = cut
    yield text[start:]


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, out_dir: str | Path, show_progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> transformers.PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `texts`, save it to `out_dir` and return it.

    The same texts in the same order give the same vocabulary and merges. `log` gets a line every
    LOG_EVERY_S seconds while the texts are read, one when the merges start and one at the end: the
    trainer's own bar (`show_progress`) is drawn only on a terminal.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least {MIN_VOCAB_SIZE}")

    # add_prefix_space=False: decode(encode(s)) == s exactly, with no space added at the start.
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    n_texts, start = 0, time.monotonic()
    say = log or (lambda line: None)

    def counted(items: Iterable[str]) -> Iterable[str]:
        nonlocal n_texts
        last = time.monotonic()
        for text in items:
            n_texts += 1
            yield from text_pieces(text)  # a whole huge text at once costs gigabytes in the trainer
            if time.monotonic() - last >= LOG_EVERY_S:
                say(f"BPE: read {n_texts:,} texts, {time.monotonic() - start:.0f}s")
                last = time.monotonic()
        say(f"BPE: read {n_texts:,} texts in {time.monotonic() - start:.1f}s; computing the merges")

    backend.train_from_iterator(counted(texts), trainer=trainer)
    if n_texts == 0:
        raise DataError("cannot train a tokenizer on no texts")
    say(f"BPE: {backend.get_vocab_size():,} tokens in {time.monotonic() - start:.1f}s")

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,  # byte-level: every input is covered
        add_bos_token=False,
        add_eos_token=False,
    )
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


def load_tokenizer(path: str | Path) -> transformers.PreTrainedTokenizerFast:
    """Load a tokenizer saved by `train_tokenizer`, any local HF tokenizer directory (offline), or a hub model's
    (``org/name``: through the hub's download and cache). One without a pad token pads with its EOS token, so
    no id changes and the vocabulary does not grow."""
    local = Path(path)
    if local.is_dir() and not (local / "tokenizer.json").is_file():
        raise DataError(f"{path} is not a tokenizer directory (no tokenizer.json in it)")
    if not local.is_dir() and (local.exists() or str(path).count("/") != 1):
        raise DataError(f"{path} is not a tokenizer directory (no tokenizer.json in it)")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=local.is_dir())
    except Exception as e:  # a corrupt json or config, or the hub's errors, surface as many exception types
        raise DataError(f"cannot load the tokenizer in {path}: {e}") from e
    if not isinstance(tokenizer, transformers.PreTrainedTokenizerFast) and not hasattr(tokenizer, "backend_tokenizer"):
        raise DataError(f"the tokenizer in {path} is not a fast (Rust) tokenizer; dipaco needs its tokenizer.json")
    if tokenizer.eos_token_id is None:
        raise DataError(f"the tokenizer in {path} has no EOS token; documents are separated by EOS")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked everywhere: EOS serves, no id is added
    return tokenizer


def token_dtype(vocab_size: int) -> str:
    """The narrowest unsigned type that holds every token id: 2 bytes per token for vocabularies of up
    to 65,536 tokens, else 4 (8 before: a token stored as int64 cost 4x the disk and page cache)."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def token_features(features: datasets.Features, vocab_size: int, keep_text: bool = True) -> datasets.Features:
    """``features`` with the two columns tokenization adds (and without ``text`` unless ``keep_text``)."""
    kept = {name: f for name, f in features.items() if keep_text or name != "text"}
    return datasets.Features({**kept, "input_ids": datasets.Sequence(datasets.Value(token_dtype(vocab_size))),
                              "num_tokens": datasets.Value("int64")})


ENCODE_TEXTS = 1000  # texts per call of the HF Rust encoder


def encode_texts(backend: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens added."""
    return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]


EncodeBatch = Callable[[list[str]], list[Any]]  # each text's ids: a list of ints (HF) or a uint32 array (tiktoken)


def available_cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def batch_encoder(tokenizer: transformers.PreTrainedTokenizerBase, threads: int = 1,
                  engine: Literal["auto", "hf"] = "auto") -> tuple[EncodeBatch, str]:
    """The function that gives each text's ids (no special tokens added), and the engine it runs on:
    tiktoken's, where it provably gives the ids of ``tokenizer`` itself (:mod:`dipaco.data.fast_bpe`; faster:
    docs/results.md, "Corpora larger than memory"), on ``threads`` threads; else (or with ``engine="hf"``) HF `tokenizers`'
    own batch call, on its threads."""
    backend = tokenizer.backend_tokenizer
    fast, why = tiktoken_bpe(backend, threads) if engine == "auto" else (None, 'engine="hf" asked for')
    if fast is not None:
        return fast.encode, "tiktoken's BPE engine (the same ids as the HF tokenizer)"

    def hf(texts: list[str]) -> list[list[int]]:
        # 1,000 texts a call: a batch of 10k encoded slower (docs/notes/2026-11-27-corpora-larger-than-memory.md;
        # the map's batches stay 10k rows: fewer headers)
        return [ids for i in range(0, len(texts), ENCODE_TEXTS) for ids in encode_texts(backend, texts[i : i + ENCODE_TEXTS])]

    return hf, f"HF tokenizers (tiktoken not used: {why})"


def decode_batch(tokenizer: transformers.PreTrainedTokenizerBase, ids: list[list[int]]) -> list[str]:
    """``tokenizer.batch_decode(ids)``, through the Rust decoder's own batch call where that gives the
    same texts (no clean-up of spaces): transformers' per-document conversions of the ids took 67 s of a
    166 s route of 1M routing prefixes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or tokenizer.clean_up_tokenization_spaces:
        return tokenizer.batch_decode(ids)
    return backend.decode_batch(ids, skip_special_tokens=False)


def _encoder(tokenizer: transformers.PreTrainedTokenizerBase, keep_text: bool = True,
             ids_of: EncodeBatch | None = None) -> Callable[[pa.Table], pa.Table]:
    """The batch function of tokenization, on an Arrow batch (``with_format("arrow")``): the batch with
    ``input_ids`` and ``num_tokens`` appended. It encodes with :func:`batch_encoder` and builds the Arrow
    column from the flat token array and its offsets, with no numpy array per document; the other columns
    pass through as Arrow. The ids are those of ``tokenizer(texts)``. ``ids_of``: the encoder, if it is
    already made (default: ``batch_encoder(tokenizer, available_cores())``)."""
    dtype = np.dtype(token_dtype(len(tokenizer)))
    encode_batch = ids_of or batch_encoder(tokenizer, available_cores())[0]

    def encode(batch: pa.Table) -> pa.Table:
        texts = batch.column("text").to_pylist()
        long = [i for i, t in enumerate(texts) if len(t) > MAX_PIECE_CHARS]
        input_ids = encode_batch([t if len(t) <= MAX_PIECE_CHARS else "" for t in texts])
        for i in long:  # piece by piece: the tokenizer's memory is bounded by the piece, not the text
            input_ids[i] = np.concatenate([np.asarray(encode_batch([piece])[0], dtype=dtype) for piece in text_pieces(texts[i])])
        lengths = np.fromiter((len(ids) for ids in input_ids), dtype=np.int64, count=len(input_ids))
        offsets = np.zeros(len(input_ids) + 1, dtype=np.int32)  # a batch of text holds < 2**31 characters
        np.cumsum(lengths, out=offsets[1:])
        flat = _flat(input_ids, dtype, int(offsets[-1]))
        dropped = ("input_ids", "num_tokens") if keep_text else ("input_ids", "num_tokens", "text")
        batch = batch.drop_columns([c for c in dropped if c in batch.column_names])
        return (batch.append_column("input_ids", pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat)))
                .append_column("num_tokens", pa.array(lengths)))

    return encode


def _flat(input_ids: list, dtype: np.dtype, n: int) -> np.ndarray:
    """The documents' ids end to end: lists of ints (HF) are read by one iterator, arrays (tiktoken, and
    long documents' pieces) copied whole."""
    if not input_ids:
        return np.zeros(0, dtype=dtype)
    if all(isinstance(ids, np.ndarray) for ids in input_ids):
        return np.concatenate(input_ids).astype(dtype, copy=False)
    return np.fromiter(itertools.chain.from_iterable(input_ids), dtype=dtype, count=n)


def tokenize_corpus(
    ds: datasets.DatasetDict | datasets.Dataset,
    tokenizer: transformers.PreTrainedTokenizerBase,
    batch_size: int = 1000,
    num_proc: int | None = None,
) -> datasets.DatasetDict | datasets.Dataset:
    """Add `input_ids` (token ids, uint16 or uint32: :func:`token_dtype`) and `num_tokens` to every row;
    other columns are kept."""
    if isinstance(ds, datasets.DatasetDict):
        return datasets.DatasetDict({name: tokenize_corpus(split, tokenizer, batch_size, num_proc)
                                     for name, split in ds.items()})
    threads = max(1, available_cores() // (num_proc or 1))
    return ds.with_format("arrow").map(
        _encoder(tokenizer, ids_of=batch_encoder(tokenizer, threads)[0]), batched=True, batch_size=batch_size, num_proc=num_proc,
        features=token_features(ds.features, len(tokenizer)), desc="Tokenizing").with_format(None)


@dataclass(frozen=True)
class TokenizeOptions:
    """How :func:`tokenize_to_disk` splits and runs the work (see its docstring)."""

    num_proc: int = 1
    shard_docs: int = 50_000  # documents per Arrow file
    batch_size: int | None = None  # documents encoded at a time (default WRITER_BATCH_ROWS)
    keep_text: bool = True  # data.keep_text


def tokenize_to_disk(ds: datasets.Dataset, tokenizer: transformers.PreTrainedTokenizerBase, work_dir: Path, name: str,
                     options: TokenizeOptions | None = None, log: Callable[[str], None] | None = None) -> list[Path]:
    """``ds`` tokenized as :func:`tokenize_corpus` does, written shard by shard to Arrow files in
    ``work_dir``; returns the files, in row order. A shard whose file is there is not tokenized again:
    a killed run picks up at the first unfinished shard (datasets writes each file under a temporary
    name, then renames it). No shard is kept open: each open dataset holds pages of its file's
    metadata, which over the shards of a 10M-document corpus came to hundreds of MB.

    ``batch_size`` (default ``WRITER_BATCH_ROWS``) documents are encoded at a time, and each batch is one
    record batch of the file: ``map`` writes a returned batch as it is, and splits but never merges them.
    Opening a file reads every batch's header, each a page fault that maps up to a folio of the file:
    1,000-row batches kept 385-570 MB of the 10M-document train split resident in `dipaco train`.
    ``keep_text=False`` leaves the ``text`` column out of the files (``data.keep_text``)."""
    o = options or TokenizeOptions()
    num_proc, shard_docs, batch_size, keep_text = o.num_proc, o.shard_docs, o.batch_size, o.keep_text
    work_dir.mkdir(parents=True, exist_ok=True)
    features = token_features(ds.features, len(tokenizer), keep_text)
    # a forked worker's share of the cores (HF's own threads are off in a forked worker: it runs on one)
    ids_of, engine = batch_encoder(tokenizer, max(1, available_cores() // max(num_proc, 1)))
    if log is not None:
        log(f"tokenizing {name} with {engine}")
    encode = _encoder(tokenizer, keep_text, ids_of=ids_of)
    n_shards = max(-(-len(ds) // shard_docs), 1)
    files = []
    start = time.monotonic()
    reader = SplitReader(ds)  # each shard read through its own mapping: pages do not pile up over the corpus
    for i in range(n_shards):
        part = reader.dataset(i * shard_docs, min((i + 1) * shard_docs, len(ds)))
        tokenized = part.with_format("arrow").map(
            encode, batched=True, batch_size=batch_size or WRITER_BATCH_ROWS, num_proc=num_proc if num_proc > 1 else None,
            features=features, cache_file_name=str(work_dir / f"{name}-{i:05d}.arrow"), load_from_cache_file=True,
            writer_batch_size=WRITER_BATCH_ROWS,
            desc=f"Tokenizing {name} {i + 1}/{n_shards}")
        files += [Path(f["filename"]) for f in tokenized.cache_files]  # one a process
        del part, tokenized
        release_mappings()
        if log is not None and n_shards > 1:  # the bars are drawn on a terminal only; a log gets a line a shard
            done = min((i + 1) * shard_docs, len(ds))
            log(f"tokenized {name} shard {i + 1}/{n_shards}: {done:,} of {len(ds):,} documents, "
                f"{time.monotonic() - start:.0f}s")
    return files
