"""The pure Schedule of DiLoCo's exchanges: plain DiLoCo, Streaming DiLoCo's fragments, DiLoCoX's delay."""

from dataclasses import replace

import pytest

from dipaco.sync.schedule import Schedule


def test_plain_diloco_is_one_fragment_of_every_slice_at_the_end_of_the_round():
    plan = Schedule.diloco(inner_steps=6, rounds=3, slices=4)
    assert plan.fragments == ((0, 1, 2, 3),) and plan.leaves == (6,)
    assert (plan.delay, plan.alpha, plan.restart, plan.eager) == (0, 0.0, False, False)
    assert plan.sync_points() == (6,)
    for r in range(3):
        assert plan.departures(r) == [(6, 0, (r, 6))]  # lands where it leaves
        assert plan.leaving(r, 6) == [(0, (r, 6))]
        assert plan.leaving(r, 3) == []  # nothing leaves between the sync points


def test_plain_diloco_at_several_offsets_leaves_and_lands_at_each():
    plan = Schedule.diloco(inner_steps=6, rounds=2, slices=3, at=(3, 6))
    assert plan.fragments == ((0, 1, 2), (0, 1, 2))
    assert plan.sync_points() == (3, 6)
    assert plan.leaving(1, 3) == [(0, (1, 3))] and plan.leaving(1, 6) == [(1, (1, 6))]


def test_streaming_fragments_land_tau_steps_later_and_the_last_round_lands_at_once():
    # H = 6, F = 3 fragments leaving at 6 (fragment 0), 2, 4; tau = 1
    plan = Schedule(6, 3, ((0, 3), (1, 4), (2, 5)), (6, 2, 4), delay=1, alpha=0.5)
    assert plan.departures(0) == [(2, 1, (0, 3)), (4, 2, (0, 5)), (6, 0, (1, 1))]
    assert plan.sync_points() == (1, 2, 3, 4, 5, 6)
    assert plan.departures(2)[-1] == (6, 0, (2, 6))  # would land in round 3, after the run: clamped
    assert plan.landing(1, 2) == (1, 3) and plan.landing(1, 6) == (2, 1)


def test_a_delay_of_rounds_lands_rounds_later_clamped_to_the_last_sync_point():
    plan = replace(Schedule.diloco(4, 4, 2), delay=2 * 4, restart=True)
    assert plan.sync_points() == (4,)
    assert [plan.landing(r, 4) for r in range(4)] == [(2, 4), (3, 4), (3, 4), (3, 4)]
    assert replace(plan, delay=0).landing(1, 4) == (1, 4)  # delay 0: DiLoCo


def test_landing_counts_inner_steps_across_rounds():
    plan = Schedule(4, 10, ((0,),), (4,), delay=3)
    assert plan.landing(0, 4) == (1, 3)
    assert plan.sync_points() == (3, 4)
    assert Schedule(4, 10, ((0,), (1,)), (4, 2), delay=1).landing(5, 2) == (5, 3)


@pytest.mark.parametrize("kwargs,match", [
    (dict(fragments=((0,), (1,)), leaves=(4,)), "2 fragments but 1 offsets"),
    (dict(fragments=((0,),), leaves=(5,)), r"not all in 1\.\.4"),
    (dict(fragments=((0,),), leaves=(0,)), r"not all in 1\.\.4"),
    (dict(fragments=((0,),), leaves=(4,), delay=-1), "a delay of -1"),
    (dict(fragments=((0,),), leaves=(4,), eager=True), "eager schedule restarts"),
    (dict(fragments=((0,),), leaves=(2,)), "offset 4, the round's last step, is not a sync point"),
    (dict(fragments=(), leaves=()), "without fragments"),
])
def test_inconsistent_schedules_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Schedule(inner_steps=4, rounds=2, **kwargs)


def test_the_schedule_is_pure():
    import dipaco.sync.schedule as module

    source = open(module.__file__).read()
    assert "import torch" not in source and "ModuleBank" not in source
