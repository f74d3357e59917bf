"""The round scheduler: lock-step rounds of every path's inner steps and the outer sync, under torchrun.

A single process is the world_size=1 case of the same code: its one rank owns every path and holds
every module, so no module is communicated. Under ``torchrun`` every rank trains its own paths and
holds only the modules they go through (DiPaCo, arXiv 2403.10616, section 2.3). The paths of a rank
advance in segments: each runs up to the sync's next sync point, then the sync updates the modules
and the path models (:mod:`dipaco.sync`)::

    for point in sync.sync_points():            # offsets within the round, e.g. (inner_steps,) for DiLoCo
        for p, loop in loops.items():           # this rank's paths, each up to the sync point
            loop.run(point - done)
        sync.at(round_index, point, models)     # outer step(s); writes the new modules into the paths

Every path keeps its own model and AdamW state across rounds. After each round the ranks gather
their reports and the trainer (:mod:`dipaco.train.trainer`) checkpoints the round, then logs it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass

from tqdm.auto import tqdm
from transformers import PreTrainedModel

from dipaco.comm.accounting import ddp_bytes
from dipaco.metrics import MetricsLogger, echo
from dipaco.paths.early_stopping import PathEarlyStopping
from dipaco.paths.inner import InnerStats
from dipaco.paths.validation import PathValidation, validation_record
from dipaco.runtime import Terminated
from dipaco.sync.base import OuterSync, SyncReport
from dipaco.sync.deltas import path_agreement
from dipaco.train.experiment import BuiltExperiment
from dipaco.train.trainer import Progress


@dataclass(frozen=True)
class RoundOptions:
    """What the round scheduler reports, and how."""

    log_every: int = 10  # train.log_every: inner steps between loss records
    progress: bool = True  # run.progress: a progress bar on rank 0
    comm_dtype: str = "fp32"  # dist.comm_dtype: named in the communication figures
    report_dropped: bool = False  # outer.drop_prob > 0: log the dropped paths
    diagnostics: bool = False  # train.diagnostics: the paths' agreement per level


class RoundScheduler:
    """Lock-step rounds: every path of every rank does ``inner_steps`` steps, with the sync at its points."""

    driver = "torchrun"

    def __init__(self, experiment: BuiltExperiment, sync: OuterSync, options: RoundOptions,
                 early_stopping: PathEarlyStopping | None = None, validation: PathValidation | None = None) -> None:
        self.sync, self.loops, self.bank = sync, experiment.loops, experiment.bank
        self.topology, self.world = experiment.topology, experiment.world
        self.rounds, self.inner_steps = experiment.rounds, experiment.inner_steps
        self.log_every, self.progress, self.comm_dtype = options.log_every, options.progress, options.comm_dtype
        self.report_dropped, self.diagnostics = options.report_dropped, options.diagnostics
        self.early_stopping, self.validation = early_stopping, validation
        self.resume_at: dict | None = None  # a step checkpoint's place in its round (load_state_dict)
        self.stopped_at: dict | None = None  # where a signal stopped the round in progress (state_dict)

    def describe(self) -> str:
        return f"{self.rounds} rounds x {self.inner_steps} inner steps"

    def run(self, start: int, until_round: int) -> Iterator[Progress]:
        """Rounds ``start`` .. ``until_round`` - 1; yields each one's reports, gathered from every rank.

        Once a round is timed, the collectives of the next ones wait what ``dist.round_timeout_*`` allows
        (:class:`dipaco.comm.liveness.RoundTimeout`), so a lost site is noticed within a few rounds' time."""
        slowest = 0.0
        for r in range(start, until_round):
            reports = self.world.all_gather_object(self.run_round(r), f"round {r + 1} report")
            slowest = max(slowest, *(rep["comm"]["round_seconds"] for rep in reports))
            self.world.timed_round(slowest)  # every rank gathered the same reports: the same timeout everywhere
            yield Progress(r + 1, reports)

    def run_round(self, round_index: int) -> dict:
        """This rank's paths, advanced in segments up to each sync point of the round; returns what rank 0 logs.

        A path's place in the round is its step count (``loop.step``): each segment runs every path up to
        the point's step, so a round resumed from a step checkpoint (``resume_at``) runs only what is left.
        A signal between two steps stops the round there (``stopped_at``: the syncs done and the stats of
        the steps each path did) and the KeyboardInterrupt goes on to the trainer, which checkpoints it."""
        start = time.perf_counter()
        bar = tqdm(total=self.inner_steps * len(self.loops), desc=f"round {round_index + 1}/{self.rounds}",
                   disable=not self.progress or self.world.rank != 0, dynamic_ncols=True, leave=False)
        resume = self.resume_at if self.resume_at is not None and self.resume_at["round"] == round_index else None
        self.resume_at = None
        segments: dict[int, list[InnerStats]] = {p: [] for p in self.loops}
        syncs_done = 0
        if resume is not None:
            syncs_done = resume["syncs_done"]
            for p, parts in resume["segments"].items():
                if int(p) not in segments:  # another rank's path: the step checkpoint holds every rank's
                    continue
                segments[int(p)] = [InnerStats(**{**part, "loss_curve": tuple(part["loss_curve"]),
                                                 "loss_curve_steps": tuple(part["loss_curve_steps"])})
                                    for part in parts]
        syncs: list[SyncReport] = []
        agreement: dict[str, dict] = {}
        for k, point in enumerate(self.sync.sync_points()):
            if k < syncs_done:
                continue
            target = round_index * self.inner_steps + point
            for p, loop in self.loops.items():
                bar.set_description(f"round {round_index + 1}/{self.rounds} path {p}")
                try:
                    if loop.step < target:
                        segments[p].append(loop.run(target - loop.step, progress=bar, log_every=self.log_every))
                except KeyboardInterrupt as exc:
                    if hasattr(exc, "stats"):  # stopped between two steps: the round so far is kept
                        segments[p].append(exc.stats)
                        self._stop_here(round_index, k, segments)
                        self._agree_to_stop(type(exc))  # the other ranks stop at their next sync point
                    bar.close()
                    raise
            stop = self._agree_to_stop(None)  # a signal stopped another rank: every rank stops before this sync
            if stop is not None:
                self._stop_here(round_index, k, segments)
                bar.close()
                raise stop()
            models = {p: loop.model for p, loop in self.loops.items()}
            if self.diagnostics and point == self.inner_steps:  # the round's whole change, before the outer step
                agreement = self._agreement(models)
            syncs.append(self.sync.at(round_index, point, models))
        bar.close()
        records = []
        for p, stats in segments.items():
            total = InnerStats.combine(stats)
            offload = {"swap_seconds": total.swap_seconds} if self.loops[p].offload is not None else {}
            records.append(dict(step=self.loops[p].step, round=round_index + 1, path=p, loss=total.loss,
                                tokens_per_s=total.tokens_per_s, lr=total.lr, tokens=total.tokens,
                                inner_loss=list(total.loss_curve), inner_loss_steps=list(total.loss_curve_steps),
                                **offload))
        heldout_ppl = self.early_stopping.update(self.bank, round_index + 1) if self.early_stopping else {}
        validation = self.validation.score(self.bank, round_index + 1) if self.validation else {}
        norms = {name: v for report in syncs for name, v in report.norms.items()}
        dropped = sorted({p for report in syncs for p in report.dropped})
        return {"paths": records, "norms": norms, "dropped": dropped, "heldout_ppl": heldout_ppl, "validation": validation,
                "agreement": agreement, "comm": self._comm_record(syncs, time.perf_counter() - start)}

    def _stop_here(self, round_index: int, syncs_done: int, segments: dict[int, list[InnerStats]]) -> None:
        self.stopped_at = {"round": round_index, "syncs_done": syncs_done,
                           "segments": {p: [asdict(s) for s in parts] for p, parts in segments.items()}}

    def _agree_to_stop(self, kind: type[KeyboardInterrupt] | None) -> type[KeyboardInterrupt] | None:
        """Whether a signal stopped any rank (and which: SIGTERM's Terminated or Ctrl-C's KeyboardInterrupt).
        Every rank asks at every sync point, and a rank a signal stopped asks at once: no rank enters the
        outer step's collectives while another writes its step checkpoint."""
        if self.world.size == 1:
            return None
        names = self.world.all_gather_object(None if kind is None else kind.__name__, "stop agreement")
        name = next((n for n in names if n is not None), None)
        return None if name is None else (Terminated if name == Terminated.__name__ else KeyboardInterrupt)

    def _agreement(self, models: Mapping[int, PreTrainedModel]) -> dict[str, dict]:
        """Module name -> the paths of this rank through it, their mean pairwise cosine and mean change norm."""
        out = {}
        for part in self.topology.parts:
            for m, a in path_agreement(self.bank, part, models).items():
                out[self.bank.module_name(m)] = {"paths": a.paths, "cosine": a.cosine, "delta_norm": a.delta_norm}
        return out

    def _comm_record(self, syncs: list[SyncReport], round_s: float) -> dict:
        steps = self.inner_steps * len(self.loops)
        path_numel = sum(self.bank.numel(part) for part in self.topology.parts)
        ddp = ddp_bytes(path_numel, steps, self.world.size)
        ddp_peak = ddp_bytes(path_numel, 1, self.world.size)  # DDP syncs every step: one gradient all-reduce
        sent = sum(s.stats.bytes_sent for s in syncs)
        modules: dict[str, dict] = {}
        for report in syncs:
            for name, entry in report.stats.modules.items():
                if name in modules:
                    modules[name] = {**entry, "bytes_sent": modules[name]["bytes_sent"] + entry["bytes_sent"],
                                     "bytes_received": modules[name]["bytes_received"] + entry["bytes_received"]}
                else:
                    modules[name] = entry
        return {
            "rank": self.world.rank, "world_size": self.world.size, "comm_dtype": self.comm_dtype,
            "paths": list(self.loops), "inner_steps": steps,
            "bytes_sent": sent, "bytes_received": sum(s.stats.bytes_received for s in syncs),
            "check_bytes": sum(s.stats.check_bytes for s in syncs),
            "peak_sync_bytes": max((s.stats.bytes_sent for s in syncs), default=0.0),
            "sync_bytes": [s.stats.bytes_sent for s in syncs],  # per call of the sync, in order
            "ddp_bytes": ddp, "ddp_over_sent": ddp / sent if sent else None, "ddp_peak_sync_bytes": ddp_peak,
            "modules": modules,
            "round_seconds": round_s, "outer_seconds": sum(s.seconds for s in syncs),
            "comm_seconds": sum(s.comm_seconds for s in syncs),  # issuing and waiting for exchanges
        }

    def logged(self, records: list[dict], index: int) -> bool:
        """Whether ``records`` (metrics.jsonl) hold round ``index``: its ``outer`` event is logged last but the comms."""
        return any(r["event"] == "outer" and r.get("round") == index for r in records)

    def log(self, metrics: MetricsLogger, index: int, reports: list[dict], info: dict, checkpoint_name: str) -> None:
        """Rank 0 logs every rank's report of a completed (checkpointed) round, in one append (all or none)."""
        records = sorted((rec for rep in reports for rec in rep["paths"]), key=lambda rec: rec["path"])
        with metrics.together():
            for rec in records:
                rec = dict(rec)
                metrics.log("path", step=rec.pop("step"), **rec)
            scored = {p: v for rep in reports for p, v in rep.get("validation", {}).items()}
            if scored:  # eval.every: before the outer record, which marks the round as logged
                metrics.log("eval", step=index, round=index, **validation_record(scored))
            merged = {name: v for rep in reports for name, v in rep["norms"].items()}
            norms = {m.name: merged[m.name] for m in self.topology.modules if m.name in merged}
            extra = {"dropped": reports[0]["dropped"]} if self.report_dropped else {}
            if self.diagnostics:
                extra.update(self._agreement_record(reports))
            metrics.log("outer", step=index, round=index, outer_grad_norm=norms, **extra)
            for rep in reports:
                metrics.log("comm", step=index, round=index, **rep["comm"])
            if self.early_stopping is not None:
                heldout = {p: v for rep in reports for p, v in rep["heldout_ppl"].items()}
                metrics.log("early_stopping", step=index, round=index, heldout_ppl=dict(sorted(heldout.items())))
        loss_text = " ".join(f"p{rec['path']}={rec['loss']:.3f}" for rec in records)
        comm_text = ""
        if self.world.size > 1:
            sent = max(rep["comm"]["bytes_sent"] for rep in reports)
            comm_text = f" | comm {sent / 1e6:.2f} MB/rank ({self.comm_dtype})"
        echo(f"[train] round {index}/{self.rounds} loss {loss_text}{comm_text} -> {checkpoint_name}")

    def _agreement_record(self, reports: list[dict]) -> dict:
        """The ranks' agreement as logged: each module's cosine among the paths of one rank (all of its
        paths in a single process); a module whose paths several ranks train is logged with the rank that
        holds the most of them, and ``path_cosine_paths`` says how many that is."""
        best: dict[str, dict] = {}
        for rep in reports:
            for name, entry in rep.get("agreement", {}).items():
                if name not in best or entry["paths"] > best[name]["paths"]:
                    best[name] = entry
        order = [m.name for m in self.topology.modules if m.name in best]
        return {"path_cosine": {n: best[n]["cosine"] for n in order},
                "path_delta_norm": {n: best[n]["delta_norm"] for n in order},
                "path_cosine_paths": {n: best[n]["paths"] for n in order}}

    def summary(self, metrics: MetricsLogger) -> None:
        """Nothing beyond the rounds' records."""

    def state_dict(self) -> dict:
        """Nothing between rounds; inside a round a signal stopped, where it stopped (a step checkpoint)."""
        return {} if self.stopped_at is None else {"stopped_at": self.stopped_at}

    def load_state_dict(self, state: dict) -> None:
        self.resume_at = state.get("stopped_at")

    def close(self) -> None:
        pass
