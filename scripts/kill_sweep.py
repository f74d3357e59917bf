"""SIGKILL `dipaco train` at random moments, resume it, and check it ends bit-exactly (issue 48).

    python scripts/kill_sweep.py --attempts 20 --out docs/kill_sweep.json

A tiny 2x2 run (the tests' corpus slice and model) is prepared and pretrained in a temporary directory and
trained once without interruption. Then, ``--attempts`` times: `dipaco train` starts in a subprocess with
background checkpoints (the default); once its first round checkpoint is in place it is SIGKILLed after a
random delay (uniform over the time an uninterrupted run takes from that checkpoint to its end, so kills
fall during inner steps, during background writes and between them); `dipaco train --resume` finishes it. Every tensor of the
resumed run's last checkpoint (the bank, the outer state, each path's parameters and AdamW state, the RNG)
must equal the uninterrupted run's, and every round must be logged exactly once.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "tests" / "dipaco"))

from compare_checkpoints import checkpoint_tensors  # noqa: E402

from dipaco import json_text  # noqa: E402


def train(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dipaco", "train", *args], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def latest(exp_dir: Path) -> Path:
    from dipaco.checkpoint.store import CheckpointManager

    found = CheckpointManager(exp_dir / "checkpoints").latest()
    assert found is not None, f"{exp_dir}: no checkpoint"
    return found


def sweep(attempts: int, seed: int, rounds: int, inner_steps: int) -> dict:
    from tiny import TINY, write_corpus_slice

    from dipaco.metrics import read_metrics
    from dipaco.run import Run, load_config

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "dipaco")]),
           "OMP_NUM_THREADS": "1"}
    rng = random.Random(seed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus_slice(Path(tmp) / "corpus.jsonl")
        base = [*TINY, f"run.dir={tmp}/run", f"data.corpus={corpus}", f"train.rounds={rounds}",
                f"train.inner_steps={inner_steps}"]
        cfg = load_config(None, base)
        Run(cfg).prepare()
        Run(cfg).pretrain()
        proc = train([*base, "train.name=straight"], env)
        first_straight = Path(tmp) / "run" / "train" / "straight" / "checkpoints" / "round_000001"
        while not first_straight.exists() and proc.poll() is None:
            time.sleep(0.005)
        start = time.perf_counter()
        assert proc.wait() == 0, proc.stderr.read() if proc.stderr else ""
        straight_s = time.perf_counter() - start  # from round 1's checkpoint to the end: where the kills fall
        want = checkpoint_tensors(latest(Path(tmp) / "run" / "train" / "straight"))
        print(f"[kill_sweep] uninterrupted: {straight_s:.1f} s from round 1's checkpoint to the end; {attempts} attempts",
              flush=True)
        for attempt in range(attempts):
            name = f"killed{attempt:02d}"
            exp_dir = Path(tmp) / "run" / "train" / name
            first = exp_dir / "checkpoints" / "round_000001"
            proc = train([*base, f"train.name={name}"], env)
            while not first.exists() and proc.poll() is None:
                time.sleep(0.005)
            delay = rng.uniform(0.0, straight_s)
            time.sleep(delay)
            finished_first = proc.poll() is not None
            proc.kill()
            proc.wait()
            killed_at = sorted(p.name for p in (exp_dir / "checkpoints").glob("round_*"))
            resumed = train([*base, f"train.name={name}", "--resume"], env)
            rc = resumed.wait()
            got = checkpoint_tensors(latest(exp_dir))
            same = rc == 0 and set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
            logged = [r["round"] for r in read_metrics(exp_dir / "metrics.jsonl", "outer")]
            once = logged == list(range(1, rounds + 1))
            rows.append({"attempt": attempt, "delay_s": delay, "killed_with": killed_at, "already_done": finished_first,
                         "resume_rc": rc, "bit_exact": same, "rounds_logged_once": once})
            print(f"  {name}: killed {delay:.2f} s after round 1's checkpoint (checkpoints then: {killed_at})"
                  f"{' (it had finished)' if finished_first else ''}; resumed rc {rc}, bit-exact {same}, "
                  f"rounds logged once {once}", flush=True)
    return {"attempts": attempts, "rounds": rounds, "inner_steps": inner_steps, "uninterrupted_s": straight_s,
            "bit_exact": sum(r["bit_exact"] for r in rows), "logged_once": sum(r["rounds_logged_once"] for r in rows),
            "killed_mid_run": sum(not r["already_done"] for r in rows), "rows": rows,
            "command": " ".join(["python", "scripts/kill_sweep.py", *sys.argv[1:]])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attempts", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--inner-steps", type=int, default=40)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = sweep(args.attempts, args.seed, args.rounds, args.inner_steps)
    print(f"[kill_sweep] {result['bit_exact']}/{args.attempts} bit-exact, {result['logged_once']}/{args.attempts} "
          f"with every round logged once; {result['killed_mid_run']} killed before the run finished")
    if args.out:
        args.out.write_text(json_text.dumps(result, indent=1) + "\n")
    if result["bit_exact"] != args.attempts or result["logged_once"] != args.attempts:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
