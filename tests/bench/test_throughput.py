"""bench/throughput.py's timing pieces (issue 48): blocks of at least a given length with the same steps on
both sides, the calibration, and the profile of a side. The whole comparison runs in tests/scripts/test_gpu_check.py
(the GPU check's tiny dry run)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from bench import throughput as bt

STEP_S = {"dipaco_path": 0.004, "best_handwritten": 0.002}  # fake sides: seconds per step, on a fake clock


class FakeClock:
    """bench.throughput's clock (its ``time``), moved only by the fake sides' steps: the timing logic is checked
    with durations a loaded machine cannot stretch (real sleeps overslept there and changed what ran)."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(bt, "time", fake)
    return fake


def fake_sides(calls: dict[str, list[int]], clock: FakeClock) -> dict:
    def side(name: str):
        def run(n: int) -> None:
            calls[name].append(n)
            clock.now += n * STEP_S[name]
        return run

    return {name: side(name) for name in STEP_S}


def test_a_block_shorter_than_the_minimum_runs_again_longer_on_both_sides(clock):
    calls: dict[str, list[int]] = {name: [] for name in STEP_S}
    timing = bt.run_blocks(fake_sides(calls, clock), torch.device("cpu"), blocks=2, steps=2, min_block_s=0.05)
    # 2 steps of the faster side last 4 ms: that block runs again, once, with enough steps for 0.05 s (and a
    # margin), and so do the rest
    assert timing["reruns"] == 1 and calls["dipaco_path"] == calls["best_handwritten"]
    steps = timing["steps_per_block"]
    calls_made = calls["best_handwritten"]
    assert steps == [math.ceil(2 * bt.BLOCK_MARGIN * 0.05 / 0.004)] * 2 and calls_made == [2, *steps]
    assert steps[0] * STEP_S["best_handwritten"] >= 0.05
    for name, took in timing["seconds"].items():
        assert took == pytest.approx([steps[0] * STEP_S[name]] * 2)


def test_without_a_minimum_the_blocks_are_the_given_steps(clock):
    calls: dict[str, list[int]] = {name: [] for name in STEP_S}
    timing = bt.run_blocks(fake_sides(calls, clock), torch.device("cpu"), blocks=3, steps=2, min_block_s=0.0)
    assert timing["steps_per_block"] == [2, 2, 2] and timing["reruns"] == 0
    assert calls["dipaco_path"] == calls["best_handwritten"] == [2, 2, 2]


def test_calibration_measures_each_sides_step(clock):
    calls: dict[str, list[int]] = {name: [] for name in STEP_S}
    step_s = bt.calibrate(fake_sides(calls, clock), torch.device("cpu"), first_steps=1, min_block_s=0.1)
    for name, seconds in step_s.items():
        assert seconds == pytest.approx(STEP_S[name])
        # doubled what ran until a quarter of the block length had run, and no further
        assert sum(calls[name]) * seconds >= 0.1 / 4 > sum(calls[name][:-1]) * seconds
        assert calls[name] == [1] + [2**k for k in range(len(calls[name]) - 1)]


def test_the_profile_of_a_side_ranks_its_ops():
    x = torch.randn(64, 64)

    def run(n: int) -> None:
        for _ in range(n):
            y = x @ x
        y.sum().item()

    p = bt.profile_side(torch.device("cpu"), run, steps=3)
    assert p["steps"] == 3 and p["top10_by"] == "self CPU time" and 0 < len(p["top10"]) <= 10
    mm = next(r for r in p["top10"] if r["name"] == "aten::mm")
    assert mm["calls"] == 3 and mm["self_us"] > 0
    assert p["scalar_reads"] == 1 and p["device_busy"] is None and p["host_syncs"] is None
    json.dumps(p, allow_nan=False)  # what the record writes


def test_a_run_writes_the_layout_of_the_recorded_figures(tmp_path):
    """docs/bench_throughput*.json hold device, threads and torch at the top and a row per size: the moved benchmark
    writes the same, with the harness's machine record and the command beside them."""
    out = tmp_path / "figures.json"
    argv = ["--steps", "1", "--blocks", "2", "--warmup", "1", "--profile-steps", "0", "--batch", "2", "--data", "memory",
            "--out", str(out)]
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        assert bt.main(argv) == 0
    finally:  # main sets what `dipaco train` sets (deterministic algorithms on CPU): not the next test's business
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
    written = json.loads(out.read_text())
    env = written["environment"]
    assert (written["device"], written["threads"], written["torch"]) == (env["device"], env["threads"], env["torch"])
    assert written["device"].startswith("cpu (") and written["command"] == "python -m bench throughput " + " ".join(argv)
    (size,) = written["sizes"]
    assert size["size"] == "demo" and size["batch"] == 2 and size["steps_per_block"] == [1, 1]
    assert set(size["tokens_per_s_median"]) == {"dipaco_path", "best_handwritten"} and size["ratio"] > 0
