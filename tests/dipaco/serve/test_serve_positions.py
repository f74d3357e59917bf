"""How long a served request may be (issue 76): a run imported from an open checkpoint serves the checkpoint's
own positions (its ``max_position_embeddings``), not the ``data.seq_len`` it trained on; a run trained from
scratch keeps ``data.seq_len``. The caps, the 4xx of a request past them, ``/healthz`` and the start-up line."""

import pytest
from open_model import IMPORTED_POSITIONS
from test_serve import PROMPTS, call, health, running

from dipaco.checkpoint.spec import Positions
from dipaco.errors import DipacoError
from dipaco.serve.http import AppOptions, ServeOptions, create_app, resolve_caps
from dipaco.serve.pipeline import Pipeline
from dipaco.serve.router_passes import RouterOptions

FROM_CHECKPOINT = "the checkpoint's max_position_embeddings"
FROM_SCRATCH = "data.seq_len: trained from scratch"


@pytest.fixture(scope="module")
def imported(imported_run):
    return Pipeline.from_run(imported_run.run.dir)


@pytest.fixture(scope="module")
def scratch(served_run):
    return Pipeline.from_run(served_run.run.dir, router=RouterOptions(in_child=False))


def long_ids(pipe: Pipeline, n: int) -> list[int]:
    """``n`` token ids of ordinary text (the prompts, repeated)."""
    ids = pipe.encode(" ".join(PROMPTS))
    return (ids * (n // len(ids) + 1))[:n]


def test_resolve_caps_default_to_the_positions_and_lower_larger_ones_with_a_note():
    positions = Positions(2048, FROM_CHECKPOINT)
    assert resolve_caps(positions, None, None) == (2048, 2048, [])
    assert resolve_caps(positions, 1000, 64) == (1000, 64, [])
    prompt, new, notes = resolve_caps(positions, 9000, 2049)
    assert (prompt, new) == (2048, 2048)
    assert notes == [f"max_prompt_tokens=9000 is above the model's 2048 positions ({FROM_CHECKPOINT}): lowered to 2048",
                     f"max_new_tokens_cap=2049 is above the model's 2048 positions ({FROM_CHECKPOINT}): lowered to 2048"]


def test_a_prompt_and_new_tokens_past_the_positions_are_refused_naming_them():
    positions = Positions(2048, FROM_CHECKPOINT)
    positions.check_fits(2000, 48)
    positions.check_fits(0, 2048)
    with pytest.raises(DipacoError) as refused:
        positions.check_fits(2000, 49, "max_tokens")
    assert str(refused.value) == (f"max_tokens: the prompt's 2000 tokens plus 49 new tokens do not fit the model's "
                                  f"2048 positions ({FROM_CHECKPOINT})")
    with pytest.raises(DipacoError, match="^max_new_tokens: the prompt's 2049 tokens plus 1 new tokens"):
        positions.check_fits(2049, 1)


def test_the_spec_says_which_positions_a_run_serves(imported, scratch):
    assert imported.spec.seq_len == 64 and imported.spec.imported
    assert imported.spec.served_positions() == Positions(IMPORTED_POSITIONS, FROM_CHECKPOINT)
    assert imported.spec.served_positions().limit == imported.loaded.llama_config().max_position_embeddings
    assert not scratch.spec.imported
    assert scratch.spec.served_positions() == Positions(scratch.spec.seq_len, FROM_SCRATCH)


@pytest.mark.parametrize("batching", ["module", "path"])
def test_an_imported_run_serves_prompts_longer_than_its_seq_len(imported, batching):
    seq_len, n = imported.spec.seq_len, 3 * imported.spec.seq_len
    prompt = imported.decode(long_ids(imported, n))
    n = len(imported.encode(prompt))  # decoding and encoding again may join tokens
    assert n > seq_len
    with running(create_app(imported, AppOptions(batching=batching))) as port:
        caps = health(port)
        assert (caps["max_prompt_tokens"], caps["max_new_tokens_cap"]) == (IMPORTED_POSITIONS, IMPORTED_POSITIONS)
        assert (caps["positions"], caps["positions_from"], caps["seq_len"]) == (IMPORTED_POSITIONS, FROM_CHECKPOINT, 64)
        status, body = call(port, "POST", "/v1/completions", {"model": imported.experiment, "prompt": prompt,
                                                              "max_tokens": 6, "temperature": 0})
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == n and body["usage"]["completion_tokens"] == 6
        assert body["choices"][0]["text"] == imported.generate(prompt, max_new_tokens=6).text
        # echo + logprobs over the whole prompt, as lm-eval's loglikelihood requests send it
        status, body = call(port, "POST", "/v1/completions", {"model": imported.experiment, "prompt": long_ids(imported, 500),
                                                              "max_tokens": 0, "echo": True, "logprobs": 0})
        assert status == 200, body
        assert len(body["choices"][0]["logprobs"]["token_logprobs"]) == 500

        # the positions bound the prompt, and the prompt plus its new tokens
        status, body = call(port, "POST", "/v1/completions", {"model": imported.experiment,
                                                              "prompt": long_ids(imported, IMPORTED_POSITIONS + 1)})
        assert status == 400
        assert body["error"]["message"] == f"prompt: {IMPORTED_POSITIONS + 1} tokens, above this server's cap of 2048"
        status, body = call(port, "POST", "/v1/completions", {"model": imported.experiment,
                                                              "prompt": long_ids(imported, 2000), "max_tokens": 49})
        assert status == 400
        assert body["error"]["message"] == ("max_tokens: the prompt's 2000 tokens plus 49 new tokens do not fit the "
                                            f"model's 2048 positions ({FROM_CHECKPOINT})")
        status, body = call(port, "POST", "/v1/completions", {"model": imported.experiment,
                                                              "prompt": long_ids(imported, 2000), "max_tokens": 48})
        assert status == 200 and body["usage"]["prompt_tokens"] == 2000, body


def test_a_run_trained_from_scratch_still_refuses_prompts_above_its_seq_len(scratch):
    seq_len = scratch.spec.seq_len
    with running(create_app(scratch)) as port:
        caps = health(port)
        assert (caps["max_prompt_tokens"], caps["max_new_tokens_cap"]) == (seq_len, seq_len)
        assert (caps["positions"], caps["positions_from"]) == (seq_len, FROM_SCRATCH)
        status, body = call(port, "POST", "/v1/completions", {"model": scratch.experiment,
                                                              "prompt": long_ids(scratch, seq_len + 1)})
        assert status == 400
        assert body["error"]["message"] == f"prompt: {seq_len + 1} tokens, above this server's cap of {seq_len}"
        status, body = call(port, "POST", "/v1/generate", {"prompt": PROMPTS[0], "max_new_tokens": seq_len})
        n = len(scratch.encode(PROMPTS[0]))
        assert status == 422 and body["detail"] == (f"max_new_tokens: the prompt's {n} tokens plus {seq_len} new tokens "
                                                    f"do not fit the model's {seq_len} positions ({FROM_SCRATCH})")


def test_caps_above_the_positions_are_lowered_to_them_with_a_note(imported, scratch, capsys):
    with running(create_app(imported, AppOptions(max_prompt_tokens=1000))) as port:
        assert health(port)["max_prompt_tokens"] == 1000  # above data.seq_len, within the checkpoint's positions
    assert "lowered" not in capsys.readouterr().out
    with running(create_app(imported, AppOptions(max_prompt_tokens=5000, max_new_tokens_cap=3000))) as port:
        caps = health(port)
        assert (caps["max_prompt_tokens"], caps["max_new_tokens_cap"]) == (IMPORTED_POSITIONS, IMPORTED_POSITIONS)
    out = capsys.readouterr().out
    assert (f"[serve] max_prompt_tokens=5000 is above the model's 2048 positions ({FROM_CHECKPOINT}): lowered to 2048"
            in out)
    assert (f"[serve] max_new_tokens_cap=3000 is above the model's 2048 positions ({FROM_CHECKPOINT}): lowered to 2048"
            in out)
    seq_len = scratch.spec.seq_len
    with running(create_app(scratch, AppOptions(max_prompt_tokens=1000))) as port:
        assert health(port)["max_prompt_tokens"] == seq_len
    assert (f"[serve] max_prompt_tokens=1000 is above the model's {seq_len} positions ({FROM_SCRATCH}): "
            f"lowered to {seq_len}") in capsys.readouterr().out


@pytest.mark.parametrize("which, limit, why", [("imported_run", IMPORTED_POSITIONS, FROM_CHECKPOINT),
                                               ("served_run", 64, FROM_SCRATCH)])
def test_the_start_up_line_says_which_positions_apply_and_why(which, limit, why, request, monkeypatch, capsys):
    import uvicorn

    from dipaco.serve import http

    cfg = request.getfixturevalue(which)

    def started(self, sockets=None):  # the line is printed before uvicorn runs: run nothing
        self.started = True

    monkeypatch.setattr(uvicorn.Server, "run", started)
    monkeypatch.setattr(http, "freeze_loaded_objects", lambda: None)  # not the test process's objects
    http.serve(cfg.run.dir, ServeOptions(port=0, router=RouterOptions(in_child=False)))
    [line] = [line for line in capsys.readouterr().out.splitlines() if "positions:" in line]
    assert f"positions: {limit} ({why}); caps: prompt {limit} tokens, {limit} new tokens" in line


def test_dipaco_generate_refuses_a_prompt_past_the_positions(served_run, scratch, tmp_path):
    """`dipaco generate` as a user runs it: a prompt and --max-new-tokens beyond the model's positions are one error
    line naming the limit and why it is that, as the server's 4xx says (before, it generated past them)."""
    import subprocess
    import sys

    from tiny import subprocess_env

    seq_len, n = scratch.spec.seq_len, len(scratch.encode(PROMPTS[0]))
    command = [sys.executable, "-m", "dipaco", "generate", "--run", str(served_run.run.dir), PROMPTS[0],
               "--max-new-tokens", str(seq_len - n + 1)]
    done = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path, timeout=600)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (f"error: --max-new-tokens: the prompt's {n} tokens plus {seq_len - n + 1} new tokens do "
                           f"not fit the model's {seq_len} positions ({FROM_SCRATCH})\n")
    assert done.stdout == ""


def test_dipaco_generate_takes_prompts_up_to_an_imported_runs_positions(imported_run, imported, capsys):
    from dipaco.cli import main

    prompt = imported.decode(long_ids(imported, IMPORTED_POSITIONS - 4))
    n = len(imported.encode(prompt))
    assert imported.spec.seq_len < n <= IMPORTED_POSITIONS - 3
    run = str(imported_run.run.dir)
    assert main(["generate", "--run", run, prompt, "--max-new-tokens", str(IMPORTED_POSITIONS - n + 1)]) == 2
    assert capsys.readouterr().err == (f"error: --max-new-tokens: the prompt's {n} tokens plus "
                                       f"{IMPORTED_POSITIONS - n + 1} new tokens do not fit the model's "
                                       f"{IMPORTED_POSITIONS} positions ({FROM_CHECKPOINT})\n")
    assert main(["generate", "--run", run, prompt, "--max-new-tokens", str(IMPORTED_POSITIONS - n)]) == 0
    out = capsys.readouterr().out
    assert f"tokens: {n} prompt + " in out
