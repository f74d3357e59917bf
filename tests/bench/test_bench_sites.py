"""`python -m bench sites`: time to a target, the table against DDP and compute-only, the refusal without root."""

from __future__ import annotations

import pytest

from bench import sites
from bench.harness import Results


def test_time_to_target_interpolates_between_evaluations_and_says_never():
    curve = [[10.0, 100.0], [20.0, 50.0], [30.0, 40.0]]
    assert sites.time_to(curve, 75.0) == pytest.approx(15.0)
    assert sites.time_to(curve, 100.0) == 10.0
    assert sites.time_to(curve, 30.0) is None


def _row(results: Results, name: str, curve, **extra):
    results.put(name, {}, {"curve": curve, "bytes_per_site": 1e6, "train_seconds": curve[-1][0], **extra})


def test_the_table_compares_each_row_with_ddp_and_with_its_compute_only_run(tmp_path):
    results = Results(tmp_path / "r.json", "sites")
    ddp = {"curve_steps": [10, 20], "steps": 20}
    _row(results, "ddp@unshaped", [[1.0, 80.0], [2.0, 60.0]], seconds_per_step=0.1, **ddp)
    _row(results, "ddp@lan", [[2.0, 80.0], [4.0, 60.0]], seconds_per_step=0.2, **ddp)
    # too slow to reach the target within its budget: extrapolated from its step time
    _row(results, "ddp@poor", [[20.0, 80.0]], seconds_per_step=2.0, **ddp)
    _row(results, "dipaco@unshaped", [[1.0, 70.0], [2.0, 55.0]], wait_share=0.01)
    _row(results, "dipaco@lan", [[1.1, 70.0], [2.2, 55.0]], wait_share=0.02)
    _row(results, "dipaco@poor", [[1.5, 70.0], [3.0, 55.0]], wait_share=0.3)
    table = {(t["row"], t["profile"]): t for t in sites.summarize(results, ["lan", "poor"], ["ddp", "dipaco"])}
    assert table["ddp", "lan"]["target_ppl"] == 60.0  # DDP's final perplexity on the best link
    poor = table["ddp", "poor"]
    assert poor["extrapolated"] and poor["seconds_to_target"] == pytest.approx(40.0)  # 20 steps x 2 s
    assert poor["wait_share"] == pytest.approx(0.95)  # 1 - 0.1 / 2.0: the step time the link adds
    d = table["dipaco", "poor"]
    expected = 1.5 + 1.5 * (70 - 60) / (70 - 55)
    assert d["seconds_to_target"] == pytest.approx(expected)
    assert d["vs_compute_only"] == pytest.approx(expected / (1.0 + 1.0 * (70 - 60) / (70 - 55)))
    assert d["ddp_over_this"] == pytest.approx(40.0 / expected)
    half = {(t["row"], t["profile"]): t for t in sites.summarize(results, ["lan"], ["ddp"], target_fraction=0.5)}
    assert half["ddp", "lan"]["target_ppl"] == 80.0


def test_without_namespaces_it_refuses_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sites, "unavailable", lambda: "network namespaces need root (ip netns add)")
    assert sites.main(["--sites", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "need root" in err[0]


def _replica(path, syncs, committed=None):
    import json

    rows = [{"event": "sync", "round": r, "advanced": committed is None or committed[r - 1] == r, "participants": 2,
             "nll": nll, "tokens": tokens, "round_seconds": secs, "sync_seconds": wait}
            for r, (nll, tokens, secs, wait) in enumerate(syncs, 1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in [*rows, {"event": "end"}]))
    return path


def test_a_torchft_row_reads_as_a_dipaco_row_the_slowest_replica_and_the_summed_scores(tmp_path):
    import math

    a = _replica(tmp_path / "a.jsonl", [(100.0, 20, 2.0, 0.2), (80.0, 20, 2.0, 0.5)])
    b = _replica(tmp_path / "b.jsonl", [(60.0, 10, 3.0, 0.1), (50.0, 10, 1.0, 0.3)])
    fig = sites.torchft_figures([a, b])
    assert [t for t, _ in fig["curve"]] == [3.0, 5.0]  # each sync's slowest replica, summed
    assert fig["curve"][0][1] == pytest.approx(math.exp(160.0 / 30))  # every replica's documents together
    assert fig["curve"][1][1] == pytest.approx(math.exp(130.0 / 30))
    # the last replica to arrive (the shortest sync step) waited on no peer: 0.1 / 3.0 and 0.3 / 1.0
    assert fig["wait_share"] == pytest.approx((0.1 / 3.0 + 0.3 / 1.0) / 2)
    assert fig["participants"] == [2]


def test_a_torchft_sync_that_did_not_commit_fails_the_row(tmp_path):
    a = _replica(tmp_path / "a.jsonl", [(1.0, 1, 1.0, 0.1), (1.0, 1, 1.0, 0.1)], committed=[1, 1])
    b = _replica(tmp_path / "b.jsonl", [(1.0, 1, 1.0, 0.1), (1.0, 1, 1.0, 0.1)])
    with pytest.raises(SystemExit, match="did not commit every sync"):
        sites.torchft_figures([a, b])
    c = _replica(tmp_path / "c.jsonl", [(1.0, 1, 1.0, 0.1)])
    with pytest.raises(SystemExit, match=r"logged \[2, 1\] syncs"):
        sites.torchft_figures([b, c])


def test_the_torchft_rows_refuse_in_one_line_without_the_apis_they_need(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(SystemExit, match=r'need torchft: pip install -e "\.\[peers\]"'):
        sites.torchft_version()
    # a torchft without the fault-tolerant DDP: one line naming what it lacks
    pytest.importorskip("torchft")
    monkeypatch.undo()
    monkeypatch.delattr("torchft.ddp.DistributedDataParallel")
    with pytest.raises(SystemExit, match=r"need torchft\.ddp\.DistributedDataParallel, which torchft \S+ lacks"):
        sites.torchft_version()


def test_the_fairness_check_compares_torchft_with_dipaco_round_by_round(tmp_path):
    results = Results(tmp_path / "r.json", "sites")
    _row(results, "diloco_uniform@unshaped", [[1.0, 100.0], [2.0, 50.0]])
    _row(results, "diloco@unshaped", [[1.0, 101.0], [2.0, 52.0]])
    _row(results, "torchft_diloco@unshaped", [[1.5, 100.2], [3.0, 50.0]])
    fair = {f["dipaco_row"]: f for f in sites.fairness(results)}
    assert fair["diloco_uniform"]["max_rel_diff"] == pytest.approx(0.002)
    assert fair["diloco_uniform"]["within_half_percent"]
    assert fair["diloco"]["max_rel_diff"] == pytest.approx(2 / 52)  # 50 against 52 in round 2
    assert not fair["diloco"]["within_half_percent"]


def test_torchft_ddp_is_compared_with_torch_ddp_evaluation_by_evaluation(tmp_path):
    results = Results(tmp_path / "r.json", "sites")
    _row(results, "ddp@lan", [[1.0, 80.0], [2.0, 60.0]])
    _row(results, "torchft_ddp@lan", [[1.2, 80.0], [2.5, 60.0]])
    [fair] = sites.fairness(results)
    assert (fair["torchft_row"], fair["dipaco_row"], fair["rounds"], fair["max_rel_diff"]) == ("torchft_ddp", "ddp", 2, 0)


def _jsonl(path, records, torn=""):
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in records) + torn)
    return path


def _sync(rnd, *, healed=False, advanced=True, nll=10.0, tokens=5, participants=2):
    return {"event": "sync", "round": rnd, "step": 10 * rnd, "advanced": advanced, "healed": healed,
            "participants": participants, "nll": nll, "tokens": tokens}


def test_a_torchft_fault_counts_the_steps_no_committed_average_kept(tmp_path):
    import math

    steps = lambda n: [{"event": "step"}] * n  # noqa: E731
    # the survivor: 4 rounds of 10 steps, alone in rounds 2 and 3
    survivor = _jsonl(tmp_path / "r0.jsonl", [*steps(10), _sync(1), *steps(10), _sync(2, participants=1),
                                              *steps(10), _sync(3, participants=1), *steps(10), _sync(4, nll=8.0)])
    # killed 6 steps into round 2, a torn last line; back for round 4: 10 steps before the peer healed it
    killed = _jsonl(tmp_path / "r1.jsonl", [*steps(10), _sync(1), *steps(6)], torn='{"event": "st')
    again = _jsonl(tmp_path / "r1.again.jsonl", [*steps(10), _sync(4, healed=True, nll=6.0)])
    fig = sites.torchft_fault_figures([survivor, killed], [tmp_path / "r0.again.jsonl", again], 10)
    assert fig["steps_lost"] == 6 + 10  # the round in flight and the round before the heal
    assert fig["steps_missing"] == 2 * 4 * 10 - 50  # replica 1's rounds 2, 3 and 4 never ran on its shard
    assert fig["final_ppl"] == pytest.approx(math.exp(14.0 / 10))
    assert fig["participants_by_round"] == [2, 1, 1, 2] and fig["healed"] == 1
    # a restarted replica that never met its peer trained a run of its own: refused
    alone = _jsonl(tmp_path / "alone.jsonl", [x for r in range(1, 5) for x in (*steps(10), _sync(r))])
    with pytest.raises(SystemExit, match="never joined a quorum with its peer"):
        sites.torchft_fault_figures([survivor, killed], [tmp_path / "r0.again.jsonl", alone], 10)


def test_the_fault_table_sets_each_killed_row_against_its_uninterrupted_run(tmp_path):
    results = Results(tmp_path / "r.json", "sites")
    fault = {"round": 4, "into_round": 0.5, "down_seconds": 2.0}
    _row(results, "diloco_elastic@wan", [[1.0, 60.0]], wall_seconds=20.0)
    _row(results, "diloco_fault@wan", [[1.0, 60.0]], wall_seconds=29.0, fault=fault, restarts=["round_000003"])
    _row(results, "torchft_diloco@wan", [[1.0, 61.0]], wall_seconds=18.0)
    _row(results, "torchft_diloco_fault@wan", [[None, 64.05]], wall_seconds=23.0, fault=fault, steps_lost=46,
         steps_missing=120)
    table = {t["row"]: t for t in sites.fault_table(results, ["wan"], sites=2, inner_steps=30)}
    d, t = table["diloco_fault"], table["torchft_diloco_fault"]
    assert d["wall_lost"] == pytest.approx(9.0) and t["wall_lost"] == pytest.approx(5.0)
    # round 4 again from round 3's checkpoint: the survivor's whole round, half of the killed site's
    assert d["steps_lost"] == pytest.approx(30 + 15) and not d["steps_lost_measured"]
    assert (t["steps_lost"], t["steps_missing"]) == (46, 120) and t["steps_lost_measured"]
    assert d["final_rel_diff"] == 0 and t["final_rel_diff"] == pytest.approx(0.05)
    assert sites.summarize(results, ["wan"], ["diloco_elastic", "diloco_fault"]) == []  # no DDP: no target


def test_a_work_dir_trains_with_this_invocations_settings_and_refuses_another_model(tmp_path, monkeypatch):
    # bench sites once reused the first invocation's config for every later one: --rounds 16 on a work dir first
    # run with --rounds 8 trained 8 rounds and recorded 16
    from dipaco.config import save_config
    from dipaco.run import load_config

    def prepared_once(work, overrides, corpus, data, docs):  # as lm.prepared_once: made once, without the training
        if not (work / "cfg.yaml").exists():
            save_config(load_config(None, overrides(work / "corpus.jsonl")), work / "cfg.yaml")
        return work / "cfg.yaml"

    monkeypatch.setattr(sites.lm, "prepared_once", prepared_once)
    tmp_path.mkdir(exist_ok=True)
    sites.prepare(sites.parse_args(["--work", str(tmp_path), "--rounds", "8"]), tmp_path)
    rows = sites.prepare(sites.parse_args(["--work", str(tmp_path), "--rounds", "16", "--inner-steps", "7"]), tmp_path)
    cfg = load_config(rows)
    assert (cfg.train.rounds, cfg.train.inner_steps) == (16, 7)
    with pytest.raises(SystemExit, match="prepared with other model settings"):
        sites.prepare(sites.parse_args(["--work", str(tmp_path), "--hidden", "32"]), tmp_path)
