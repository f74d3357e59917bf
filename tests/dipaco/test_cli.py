"""The CLI as a user runs it: clear one-line errors for bad input, and a working pipeline."""

import json
from pathlib import Path

import pytest
from tiny import TINY

from dipaco.cli import main, parse_command_line


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    return path


def words(n: int, seed: int) -> str:
    vocab = ["alpha", "beta", "gamma", "delta", "river", "stone", "market", "vote", "goal", "film"]
    return " ".join(vocab[(i * 7 + seed) % len(vocab)] + str((i * seed) % 13) for i in range(n))


def corpus(tmp_path: Path, extra: list[str] = ()) -> Path:
    return write_jsonl(tmp_path / "c.jsonl", [words(300, s) for s in range(40)] + list(extra))


def run(tmp_path: Path, command: str, corpus_path: Path, *extra: str) -> int:
    return main([command, *TINY, f"run.dir={tmp_path / 'run'}", f"data.corpus={corpus_path}", *extra])


def test_help_for_every_command(capsys):
    for command in ("prepare", "pretrain", "train", "eval", "report"):
        with pytest.raises(SystemExit) as exc:
            main([command, "--help"])
        assert exc.value.code == 0
    assert "--resume" in capsys.readouterr().out


def test_serve_caps_default_to_the_models_positions_and_reach_the_server(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-body-bytes" in text and "default: the experiment's data.seq_len" in text
    seen = {}
    monkeypatch.setattr("dipaco.serve.http.serve", lambda run, options: seen.update(vars(options.app)))
    assert main(["serve", "--run", "somewhere", "--max-body-bytes", "4096", "--max-prompts", "3"]) in (0, None)
    assert seen["max_body_bytes"] == 4096 and seen["max_prompts"] == 3  # the completions endpoint's prompt-list cap
    assert seen["max_prompt_tokens"] is None and seen["max_new_tokens_cap"] is None  # the server picks seq_len


def test_unknown_config_key_is_one_clear_line(tmp_path, capsys):
    assert main(["train", "train.inner_stepz=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: train.inner_stepz") and "Traceback" not in err


def test_empty_document_is_named_and_nothing_is_written(tmp_path, capsys):
    path = corpus(tmp_path, ["   "])
    assert run(tmp_path, "prepare", path) == 2
    err = capsys.readouterr().err
    assert "d40" in err and "data.empty_docs=skip" in err
    assert not (tmp_path / "run" / "data").exists()
    assert run(tmp_path, "prepare", path, "data.empty_docs=skip") == 0


def test_non_utf8_file_is_named(tmp_path, capsys):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps({"id": "x", "text": "caf\u00e9"}).encode("latin-1") + b"\n")
    assert run(tmp_path, "prepare", path) == 2
    assert "latin1.jsonl" in capsys.readouterr().err


def test_short_documents_train_and_are_not_scored(tmp_path, capsys):
    # Documents shorter than the routing prefix are kept for training and score no tokens.
    path = corpus(tmp_path, ["tiny", "two words", "x"] * 5)
    assert run(tmp_path, "prepare", path) == 0
    assert run(tmp_path, "pretrain", path) == 0
    assert run(tmp_path, "train", path) == 0
    assert run(tmp_path, "eval", path) == 0
    report = json.loads((tmp_path / "run" / "train" / "dipaco" / "eval.json").read_text())
    assert report["overall"]["scored_tokens"] > 0
    assert run(tmp_path, "eval", path, "--pretrained") == 0
    assert run(tmp_path, "report", path) == 0
    table = capsys.readouterr().out
    assert "pretrained" in table and "dipaco" in table


def test_train_before_prepare_says_what_to_run(tmp_path, capsys):
    assert run(tmp_path, "train", corpus(tmp_path)) == 2
    assert "dipaco prepare" in capsys.readouterr().err


def test_changed_data_config_after_prepare_is_refused(tmp_path, capsys):
    path = corpus(tmp_path)
    assert run(tmp_path, "prepare", path) == 0
    assert run(tmp_path, "pretrain", path, "tokenizer.vocab_size=600") == 2
    assert "rerun `dipaco prepare`" in capsys.readouterr().err


def test_another_corpus_after_prepare_names_the_key_and_both_values(tmp_path, capsys):
    path = corpus(tmp_path)
    other = write_jsonl(tmp_path / "other.jsonl", [words(300, s) for s in range(40)])
    assert run(tmp_path, "prepare", path) == 0
    capsys.readouterr()
    assert run(tmp_path, "pretrain", other) == 2
    err = capsys.readouterr().err
    assert f"data.corpus: '{path}' when prepared, now '{other}'" in err and err.count("\n") == 1


def test_unknown_corpus_name_is_one_line_without_hub_access(tmp_path, capsys):
    assert main(["prepare", *TINY, f"run.dir={tmp_path / 'run'}", "data.corpus=no_such_corpus_name"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: data.corpus: 'no_such_corpus_name' is not a builtin corpus") and "data.hub=true" in err


def test_levels_that_do_not_hold_the_model_are_refused_by_every_job(tmp_path, capsys):
    """Before, only the jobs that build the bank (train) checked it: `dipaco route` ran on such a config."""
    levels = ["topology.preset=null", "topology.levels=[{blocks: 2, modules: 2}, {blocks: 1, modules: 2}]"]
    for job in ("prepare", "route", "pretrain"):
        assert main([job, *TINY, f"run.dir={tmp_path / 'run'}", *levels]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: topology.levels: the levels hold 3 blocks but model.num_layers=2"), err
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_help_loads_no_torch_and_config_show_prints_every_key(tmp_path):
    """Issue 34: `dipaco --help` took 6-18 s because it imported torch; `dipaco config show` did not exist."""
    import subprocess
    import sys

    code = ("import sys\nfrom dipaco.cli import main\n"
            "for argv in (['--help'], ['train', '--help'], ['config', 'show', 'train.rounds=7']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2]).stdout
    assert out.rstrip().endswith("NO-TORCH")
    assert "--until-round" in out and "(default: None)" in out  # subcommand help shows every option's default
    assert "rounds: 7" in out and "inner_steps: 50" in out and "comm_dtype: fp32" in out


def _eval_row(experiment: str, paths: int, ppl: float) -> str:
    return json.dumps({"experiment": experiment, "topology": f"{paths} paths", "num_paths": paths, "steps_per_path": 10,
                       "params_per_path": 100, "params_total": 100 * paths, "overall": {"ppl": ppl}})


def test_report_reads_json_only_and_a_broken_eval_json_is_one_line(tmp_path):
    """`dipaco report` loaded torch and every component (10 s of CPU in `make demo`) to print a table of
    JSON files; a malformed eval.json was a KeyError traceback."""
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    for sub, row in (("pretrain", _eval_row("pretrained", 1, 300.0)), ("train/dense", _eval_row("dense", 1, 200.0)),
                     ("train/grid", _eval_row("grid", 4, 150.0))):
        (run_dir / sub).mkdir(parents=True)
        (run_dir / sub / "eval.json").write_text(row)
    code = ("import sys\nfrom dipaco.cli import main\n"
            f"rc = main(['report', 'run.dir={run_dir}'])\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', rc)\n")
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo).stdout
    assert out.rstrip().endswith("NO-TORCH 0")
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:5]}
    assert rows["grid"][-2:] == ["4x", "150.00"] and rows["dense"][-2:] == ["1x", "200.00"]

    (run_dir / "train" / "grid" / "eval.json").write_text('{"experiment": "grid"}')
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo)
    assert done.stdout.rstrip().endswith("2") and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: ") and "grid/eval.json is not an eval report" in done.stderr


@pytest.mark.parametrize("text, needle", [
    (b"train:\n\trounds: 2\n", "not valid YAML at line 2"),
    (b"train: [1, 2\n", "not valid YAML"),
    (b"- run\n- train\n", "a config is a mapping of sections"),
    (b"train:\n  name: \xff\xfe\n", "not UTF-8 text"),
])
def test_a_config_file_that_is_not_a_yaml_mapping_is_one_line(tmp_path, capsys, text, needle):
    (tmp_path / "bad.yaml").write_bytes(text)
    assert main(["train", "--config", str(tmp_path / "bad.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1


def test_an_override_typo_is_placed_on_the_command_line(tmp_path, capsys):
    (tmp_path / "my.yaml").write_text("train:\n  rounds: 2\n")
    assert main(["train", "--config", str(tmp_path / "my.yaml"), "train.rouns=3"]) == 2
    err = capsys.readouterr().err
    assert "train.rouns" in err and "(on the command line)" in err and "my.yaml" not in err


def loading_torch(pid: int) -> bool:
    """Whether process ``pid`` has begun importing torch (its library is mapped): dipaco's CLI is then past
    Python's start-up and inside its KeyboardInterrupt guard, and the import has about a second to go."""
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except FileNotFoundError:
        return False


def test_ctrl_c_while_the_imports_load_is_one_line(tmp_path, sigint_from_a_terminal):
    """Issue 34: a Ctrl-C in the first second, while torch and transformers import, printed a traceback."""
    import os
    import signal
    import subprocess
    import sys
    import time

    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-m", "dipaco", "train", f"run.dir={tmp_path / 'run'}"], cwd=repo,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(repo)})
    # Sent once torch's library is mapped, not after a fixed 0.4 s: on a loaded CI machine Python was not yet up
    # then, and the signal killed it (exit -2) before any handler ran.
    deadline = time.monotonic() + 60
    while not loading_torch(proc.pid):
        assert time.monotonic() < deadline and proc.poll() is None, "the CLI never began importing torch"
        time.sleep(0.002)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["interrupted: dipaco train stopped; continue with --resume"], err


def test_overrides_may_follow_the_flags():
    # Issue 48: `dipaco train run.dir=x --resume train.inner_steps=20` was "unrecognized arguments".
    args = parse_command_line(["train", "--config", "c.yaml", "run.dir=x", "--resume", "train.inner_steps=20",
                               "run.dir=y"])
    assert args.resume and args.config == "c.yaml"
    assert args.overrides == ["run.dir=x", "train.inner_steps=20", "run.dir=y"]  # in order: the last one wins


def test_an_unknown_flag_is_still_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_command_line(["train", "run.dir=x", "--bogus", "train.inner_steps=20"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize("override, line", [
    ("train.rounds=null", "error: train.rounds: cannot be null (on the command line); give a value, or leave the key "
                          "out for its default 4"),
    ("model.num_layers=null", "error: model.num_layers=null (on the command line): null unsets a shape key for "
                              "model.init_from's checkpoint to fill in; without model.init_from give a value "
                              "(the default is 4)"),
    ("model.init_from=", "error: model.init_from: no value after '=' (on the command line); give a value, or null to "
                         "unset it"),
])
def test_null_and_empty_values_on_the_command_line_are_one_line(tmp_path, capsys, override, line):
    assert run(tmp_path, "prepare", corpus(tmp_path), override) == 2
    assert capsys.readouterr().err.strip().splitlines() == [line]
    assert not (tmp_path / "run").exists()


def test_the_pipeline_runs_every_job_in_one_process_as_the_jobs_one_by_one(served_run, tmp_path, capsys):
    """`dipaco pipeline --baseline` (what make demo runs): the served run's fixture ran its jobs one by one on
    the same config; the one process gives the same perplexities, and the dense baseline as many steps a path."""
    shape = [*TINY, f"data.corpus={served_run.data.corpus}", "train.sharding=kmeans", "route.featurizer=lm_prefix",
             "route.n_init=1"]
    assert main(["pipeline", *shape, f"run.dir={tmp_path / 'run'}", "--baseline"]) == 0
    out = capsys.readouterr().out
    jobs = [line for line in out.splitlines() if line.startswith("== dipaco ")]
    assert [j.split()[2] for j in jobs] == ["prepare", "pretrain", "eval", "route", "train", "eval", "train", "eval",
                                            "report:"]

    def overall(run_dir: str | Path, sub: str) -> dict:
        return json.loads((Path(run_dir) / sub / "eval.json").read_text())

    weights = "pretrain/model.safetensors"
    assert (tmp_path / "run" / weights).read_bytes() == (Path(served_run.run.dir) / weights).read_bytes()
    assert overall(tmp_path / "run", "train/dipaco")["overall"] == overall(served_run.run.dir, "train/dipaco")["overall"]
    dense, dipaco = overall(tmp_path / "run", "train/dense_1x"), overall(tmp_path / "run", "train/dipaco")
    assert (dense["num_paths"], dipaco["num_paths"]) == (1, 4)
    assert dense["steps_per_path"] == dipaco["steps_per_path"] > 0
    assert all(name in out for name in ("pretrained", "dense_1x", "dipaco"))
