import math

import pytest
import torch

from dipaco.paths.lr_schedule import build_scheduler, warmup_cosine


def test_warmup_then_cosine_to_min_ratio():
    f = lambda s: warmup_cosine(s, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)  # noqa: E731
    assert f(0) == pytest.approx(0.1)
    assert f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(110) == pytest.approx(0.1)
    assert f(500) == pytest.approx(0.1)  # past the end: held at the minimum


def test_scheduler_state_round_trip():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_scheduler(opt, 3, 20, 0.0)
    for _ in range(7):
        opt.step(), sched.step()
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched2 = build_scheduler(opt2, 3, 20, 0.0)
    sched2.load_state_dict(sched.state_dict())
    opt2.step(), sched2.step(), opt.step(), sched.step()
    assert sched2.get_last_lr() == sched.get_last_lr()
