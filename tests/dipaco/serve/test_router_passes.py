"""The router's passes: prompts waiting at once share a pass without changing anyone's scores, in this
process or the router's own."""

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dipaco.errors import DipacoError
from dipaco.serve.pipeline import Pipeline
from dipaco.serve.router_passes import RouterBatcher, RouterOptions, lm_prefix_scores, parse_cpus, router_cpus

PROMPTS = [
    "The government said on Tuesday that the economy had grown faster than expected in the last quarter",
    "The striker scored twice in the second half as the champions came from behind to win the cup final",
    "Shares in the bank rose after the results showed profits up by a fifth on the year before",
    "In the beginning of the war the army moved north across the river towards the city",
    "A short one",
    "Another short",
]


@pytest.fixture(scope="module")
def pipe(served_run) -> Pipeline:
    return Pipeline.from_run(served_run.run.dir, cache_size=4)


@pytest.fixture(scope="module")
def pipe_with_process(served_run):
    pipe = Pipeline.from_run(served_run.run.dir, cache_size=4, router=RouterOptions(in_child=True))
    yield pipe
    pipe.close()


def test_prompts_scored_together_get_their_scores_alone_bit_for_bit(pipe):
    batch = [pipe.encode(text) for text in PROMPTS]
    assert len({min(len(ids), 32) for ids in batch}) > 1  # lengths that share a forward and lengths that do not
    alone = [lm_prefix_scores(pipe.router, pipe.featurizer_model, [ids], pipe.precision)[0] for ids in batch]
    for size in (2, 3, len(batch)):
        together = lm_prefix_scores(pipe.router, pipe.featurizer_model, batch[:size], pipe.precision)
        for a, b in zip(alone, together):
            assert torch.equal(a, b)


def test_the_router_process_scores_as_this_process_does(pipe, pipe_with_process):
    assert pipe_with_process.featurizer_model is None  # the model lives in the child only
    for text in PROMPTS:
        assert pipe_with_process.route(text) == pipe.route(text)
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(pipe_with_process.route, PROMPTS * 3))
    assert together == [pipe.route(text) for text in PROMPTS * 3]
    stats = pipe_with_process.router_stats
    assert stats.requests >= 24 and 1 <= stats.passes <= stats.requests


def test_a_killed_router_process_is_started_again(pipe, pipe_with_process):
    child = pipe_with_process.router_process
    assert child is not None
    before = list(child._pool._processes)
    os.kill(before[0], signal.SIGKILL)
    assert pipe_with_process.route(PROMPTS[0]) == pipe.route(PROMPTS[0])
    assert list(child._pool._processes) != before


def test_a_run_the_router_process_cannot_load_fails_at_start(served_run, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(served_run.run.dir, run)
    shutil.rmtree(run / "pretrain")
    with pytest.raises(DipacoError, match="no pretrained model"):
        Pipeline.from_run(run, router=RouterOptions(in_child=True))


def test_waiting_prompts_share_a_pass_and_each_gets_its_own_answer():
    started, release = threading.Event(), threading.Event()
    passes: list[list[list[int]]] = []

    def score_many(batch: list[list[int]]) -> list[torch.Tensor]:
        started.set()
        release.wait(10)
        passes.append(batch)
        return [torch.tensor([float(sum(ids))]) for ids in batch]

    batcher = RouterBatcher(score_many, max_rows=4)
    try:
        with ThreadPoolExecutor(6) as pool:
            answers = [pool.submit(batcher.scores, [0, 0])]
            assert started.wait(10)  # the first prompt is in its pass: the next five wait for the router
            answers += [pool.submit(batcher.scores, [i, i]) for i in range(1, 6)]
            deadline = time.monotonic() + 10
            while batcher._waiting.qsize() < 5 and time.monotonic() < deadline:
                time.sleep(0.01)
            release.set()
            assert [a.result(10).item() for a in answers] == [2.0 * i for i in range(6)]
    finally:
        batcher.close()
    assert [len(b) for b in passes] == [1, 4, 1]  # every waiting prompt, up to max_rows, per pass
    assert batcher.stats.passes == 3 and batcher.stats.requests == 6


def test_a_failed_pass_reaches_its_callers_and_the_router_goes_on():
    calls = []

    def score_many(batch: list[list[int]]) -> list[torch.Tensor]:
        calls.append(batch)
        if len(calls) == 1:
            raise RuntimeError("the router's forward failed")
        return [torch.zeros(2) for _ in batch]

    batcher = RouterBatcher(score_many)
    try:
        with pytest.raises(RuntimeError, match="forward failed"):
            batcher.scores([1])
        assert torch.equal(batcher.scores([1]), torch.zeros(2))
    finally:
        batcher.close()


def test_a_router_batch_below_one_is_a_clear_error():
    with pytest.raises(DipacoError, match="--router-batch must be >= 1"):
        RouterBatcher(lambda batch: [], max_rows=0)


def test_a_router_process_outlives_no_killed_server(served_run):
    import subprocess
    import sys

    script = (
        "import sys, time\n"
        "from dipaco.serve.pipeline import Pipeline\n"
        "from dipaco.serve.router_passes import RouterOptions\n"
        "if __name__ == '__main__':\n"
        "    pipe = Pipeline.from_run(sys.argv[1], router=RouterOptions(in_child=True))\n"
        "    print(*pipe.router_process._pool._processes, flush=True)\n"
        "    time.sleep(600)\n"
    )
    server = subprocess.Popen([sys.executable, "-c", script, str(served_run.run.dir)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(server.stdout.readline())
        os.kill(child, 0)  # alive
    finally:
        server.kill()
        server.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if not running(child):
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the router process was still running 30 s after its server was killed")


def running(pid: int) -> bool:
    """Whether ``pid`` runs: not gone, and not a zombie waiting for a parent that does not reap it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_router_cpus_pin_the_router_process_and_routing_is_unchanged(pipe, served_run):
    cpu = max(os.sched_getaffinity(0))
    pinned = Pipeline.from_run(served_run.run.dir, cache_size=4, router=RouterOptions(in_child=True, cpus=(cpu,)))
    try:
        assert pinned.router_process is not None
        assert pinned.router_process._pool.submit(os.sched_getaffinity, 0).result() == {cpu}
        # no more torch threads than its CPUs; routes as in this process, whatever its thread count
        assert pinned.router_process._pool.submit(torch.get_num_threads).result() == 1
        assert [pinned.route(text) for text in PROMPTS] == [pipe.route(text) for text in PROMPTS]
    finally:
        pinned.close()


@pytest.mark.parametrize("text, cpus", [("0", (0,)), ("1,0", (0, 1)), ("0-1", (0, 1)), (" 0 - 0 ", None)])
def test_router_cpus_take_taskset_lists(text, cpus):
    if cpus is None:  # spaces inside a range are not taskset's syntax either
        with pytest.raises(DipacoError, match="expected CPU numbers and ranges"):
            parse_cpus(text)
    elif max(cpus) < (os.cpu_count() or 1):
        assert parse_cpus(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "1-0", "-1", "0,,1"])
def test_router_cpus_that_are_not_a_list_are_a_clear_error(text):
    with pytest.raises(DipacoError, match="expected CPU numbers and ranges"):
        parse_cpus(text)


def test_router_cpus_auto_is_the_last_cpu_for_a_router_process_when_there_are_two(monkeypatch):
    from dipaco.serve import router_passes

    monkeypatch.setattr(router_passes.os, "sched_getaffinity", lambda pid: {0, 2, 5})
    assert router_cpus("auto", in_child=True) == (5,)
    assert router_cpus("auto", in_child=False) is None  # routed in the server: nothing to place
    assert router_cpus("none", in_child=True) is None
    assert router_cpus("0", in_child=True) == (0,)
    monkeypatch.setattr(router_passes.os, "sched_getaffinity", lambda pid: {3})
    assert router_cpus("auto", in_child=True) is None  # one CPU: the router cannot have one of its own


def test_router_cpus_beyond_the_machine_or_without_a_router_process_are_refused(served_run, capsys):
    from dipaco.cli import main

    with pytest.raises(DipacoError, match=f"this machine has CPUs 0-{(os.cpu_count() or 1) - 1}"):
        parse_cpus(str(os.cpu_count()))
    assert main(["serve", "--run", str(served_run.run.dir), "--router-cpus", "0", "--no-router-process"]) == 2
    assert "it needs --router-process" in capsys.readouterr().err


def test_cpus_the_os_refuses_are_a_clear_error_naming_the_cpus_allowed(monkeypatch):
    from dipaco.serve import router_passes

    def refuse(pid, cpus):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(router_passes.os, "sched_setaffinity", refuse)
    allowed = sorted(os.sched_getaffinity(0))
    with pytest.raises(DipacoError, match=r"--router-cpus 0: the router process cannot run there .*CPUs "
                       + re.escape(str(allowed))):
        router_passes._run_on((0,))


def test_the_server_leaves_the_routers_cpus_with_every_thread_it_has_and_starts():
    import subprocess
    import sys

    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    last = max(allowed)
    script = (  # in a process of its own: pytest's CPUs stay as they are
        "import os, threading, torch\n"
        "from dipaco.serve.router_passes import leave_cpus\n"
        f"torch.set_num_threads({len(allowed)})\n"
        "gate = threading.Event()\n"
        "before = threading.Thread(target=gate.wait); before.start()\n"
        f"print(sorted(leave_cpus(({last},))))\n"
        "after = threading.Thread(target=gate.wait); after.start()\n"
        "print(sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir('/proc/self/task')}))\n"
        "print(torch.get_num_threads())\n"
        "gate.set()\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split("\n")
    rest = sorted(allowed - {last})
    assert out[0] == str(rest) and out[1] == str([tuple(rest)])  # both threads and the main one
    assert out[2] == str(len(rest))  # torch's threads: no more than the CPUs left


def test_a_server_with_only_the_routers_cpus_stays_where_it_is():
    from dipaco.serve.router_passes import leave_cpus

    allowed = os.sched_getaffinity(0)
    assert leave_cpus(tuple(allowed)) is None and os.sched_getaffinity(0) == allowed


def test_the_start_up_line_says_where_the_router_and_the_server_run():
    from dipaco.serve.http import router_placement

    threads = torch.get_num_threads()
    assert router_placement(False, (1,), None) == ""  # routed in the server
    assert router_placement(True, None, None) == " (own process)"
    assert router_placement(True, (1,), (0,)) == \
        f" (own process, CPUs 1; the server on 0, {threads} torch thread{'s' if threads > 1 else ''})"
