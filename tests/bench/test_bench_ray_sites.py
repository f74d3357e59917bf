"""`python -m bench ray_sites`: its table against the first row, its argument checks, the refusal without root (the
runs themselves need root and minutes: tests/dipaco/train/test_ray_sites.py runs the same cluster in CI)."""

from __future__ import annotations

import pytest

from bench import ray_sites
from bench.harness import Results


def test_each_row_is_compared_with_the_first_per_task(tmp_path):
    results = Results(tmp_path / "r.json", "ray_sites")
    for k, per_task in ((1, 6e6), (8, 3e6)):
        results.put(f"sync_every_{k}@wan", {}, {"sync_every": k, "bytes_per_task": per_task})
    results.put("sync_every_8@poor", {}, {"sync_every": 8, "bytes_per_task": 1.0})  # another profile: not in wan's table
    table = ray_sites.summarize(results, "wan", [1, 8, 16])  # 16 not run yet: left out
    assert [(t["sync_every"], t["profile"], t["vs_first"]) for t in table] == [(1, "wan", 1.0), (8, "wan", 0.5)]


@pytest.mark.parametrize("every, message", [("1,x", "comma-separated integers"), ("0,8", "each must be >= 1")])
def test_a_bad_sync_every_is_one_line(monkeypatch, every, message):
    monkeypatch.setattr(ray_sites, "unavailable", lambda: None)
    with pytest.raises(SystemExit, match=message):
        ray_sites.main(["--sync-every", every])


def test_without_namespaces_it_refuses_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(ray_sites, "unavailable", lambda: "network namespaces need root (ip netns add)")
    assert ray_sites.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "need root" in err[0]
