"""bench/tokenize.py: both engines on the same texts, their speeds and whether their ids agree."""

from __future__ import annotations

import json

import pytest

from bench import tokenize as bench


def corpus(tmp_path, n: int = 300):
    path = tmp_path / "corpus.jsonl"
    words = "the routed path trains its modules while the outer step averages them over every path".split()
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": str(i), "text": " ".join(words[(i * j) % len(words)] for j in range(5 + i % 40))}) + "\n")
    return path


def test_both_engines_run_and_agree(tmp_path, capsys):
    out = tmp_path / "result.json"
    assert bench.main(["--corpus", str(corpus(tmp_path)), "--skip", "20", "--docs", "250", "--batch", "100",
                       "--rounds", "2", "--vocab-size", "300", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["texts"] == 250 and result["same_ids"]
    engines = [r["engine"] for r in result["runs"]]
    assert len(engines) == 4 and engines[0].startswith("HF") and engines[1].startswith("tiktoken")
    assert all(r["tokens"] == result["runs"][0]["tokens"] > 0 and r["tokens_per_s"] > 0 for r in result["runs"])
    assert set(result["median_tokens_per_s"]) == set(engines) and result["ratio"] > 0
    assert "ids the same" in capsys.readouterr().out
    assert result["command"].startswith("python -m bench tokenize --corpus") and result["environment"]["cpus"] >= 1


def test_ids_that_differ_fail_the_run(tmp_path, monkeypatch):
    real = bench.batch_encoder

    def off_by_one(tokenizer, threads, engine="auto"):
        encode, name = real(tokenizer, threads, engine)
        if engine == "hf":
            return encode, name
        return (lambda texts: [ids[:-1] if len(ids) else ids for ids in encode(texts)]), name

    monkeypatch.setattr(bench, "batch_encoder", off_by_one)
    assert bench.main(["--corpus", str(corpus(tmp_path)), "--docs", "50", "--rounds", "1", "--vocab-size", "300"]) == 1


def test_an_empty_selection_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--corpus", str(corpus(tmp_path, 10)), "--skip", "10"])
    assert exit_.value.code == 2
    assert "no texts" in capsys.readouterr().err
