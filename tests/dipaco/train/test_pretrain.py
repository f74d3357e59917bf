"""`dipaco pretrain`: what it reports of the run."""

from __future__ import annotations

import re

from dipaco.run import Run


def test_the_reported_loss_says_it_is_the_mean_over_the_run(run_cfg, capsys):
    """Issue 34: `[pretrain] loss 6.4` was a mean over every step, and did not say so."""
    capsys.readouterr()
    Run(run_cfg).pretrain()
    out = capsys.readouterr().out
    steps = run_cfg.pretrain.steps
    assert re.search(rf"^\[pretrain\] mean loss over the {steps} steps \d+\.\d{{3}}, ", out, re.MULTILINE), out
