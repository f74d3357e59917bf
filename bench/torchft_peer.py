"""One replica of torchft's own DiLoCo or fault-tolerant DDP, the peer rows of ``python -m bench sites`` (issue 75).

torchft (meta-pytorch/torchft, the ``peers`` extra) is what a lab would pick instead of dipaco for fault-tolerant
DiLoCo. This worker runs its classes as its documentation wires them, re-implementing none of them:
``torchft.Manager`` (one replica group of one process per site, joined by the Lighthouse the benchmark starts on
site 0) and ``torchft.ProcessGroupGloo``, then either

* ``--algorithm diloco``: ``torchft.local_sgd.DiLoCo`` with a Nesterov ``SGD`` outer optimizer, the synchronous
  quorum DiLoCo requires, and ``sync_every = train.inner_steps``. The work is dipaco's ``topology.preset=diloco:N``
  row's, so that the two implementations can be compared step for step: replica ``p`` starts from the run's
  pretrained weights, trains on the shard dipaco gives path ``p`` with dipaco's sampler and seed (the same batches),
  with ``build_adamw`` and ``build_scheduler``, clips gradients as it does, and after every sync scores the validation
  documents dipaco routes to path ``p`` with the global weights. The parent sums the replicas' scores.
* ``--algorithm ddp``: ``torchft.ddp.DistributedDataParallel`` and ``torchft.optim.OptimizerWrapper`` (a quorum every
  step, torchft's default asynchronous one), on the work of the sites benchmark's torch DDP row
  (:mod:`bench.dense_work`): the same batches, optimizer and schedule, replica 0 scoring the validation split.

A replica that joins late (a restarted site) is healed by torchft from a healthy peer at its first quorum: the
model, the inner optimizer and the schedule come from the peer's state dict, as torchft does it; the replica then
moves its own sampler to the step the quorum is at, so that it reads what it would have read. Every inner step is
logged, so that the parent can count the steps a fault threw away.

What differs by design: torchft averages the replicas' pseudo-gradients uniformly, where dipaco's default
``outer.weighting=tokens`` weights each by its shard's tokens; the benchmark's fairness check runs dipaco with
``outer.weighting=uniform`` beside its default (docs/results.md).

    python -m bench.torchft_peer --algorithm diloco --config CFG --replicas N --replica P --address ADDR \\
        --lighthouse URL --out F
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.torchft_peer", description=__doc__.split("\n\n")[0])
    p.add_argument("--algorithm", choices=("diloco", "ddp"), default="diloco")
    p.add_argument("--config", required=True, help="the prepared run's config (bench sites' cfg.yaml)")
    p.add_argument("--replicas", type=int, required=True, help="replica groups at the start: one per site")
    p.add_argument("--replica", type=int, required=True, help="this replica's index: dipaco's path of the same work")
    p.add_argument("--min-replicas", type=int, help="the quorum's minimum (default --replicas: none may be lost)")
    p.add_argument("--address", required=True, help="this site's address, which the other replicas reach")
    p.add_argument("--lighthouse", required=True, help="the Lighthouse's URL, http://HOST:PORT")
    p.add_argument("--timeout-s", type=float, default=600.0, help="torchft's collective and quorum timeouts")
    p.add_argument("--seconds", type=float, default=float("inf"), help="ddp: stop after this much training")
    p.add_argument("--out", required=True, help="JSONL: a record per step and per sync or evaluation")
    return p.parse_args(argv)


class Log:
    def __init__(self, path: str) -> None:
        self.file = open(path, "w")

    def __call__(self, **record: Any) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()  # a killed replica's steps must be on disk: the parent counts them


def build_manager(a: argparse.Namespace, state: dict[str, Any], use_async_quorum: bool) -> Any:
    """torchft's Manager for a replica group of one process: its own store on this site, which the quorum's process
    group reaches; ``state``: what a healing peer copies (name -> object with ``state_dict`` / ``load_state_dict``)."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    # torchft's gloo group tells its peers to meet at socket.gethostname(). The sites are network namespaces of one
    # machine, which share its host name (an address no other site reaches), so each replica answers with its
    # site's address, as a machine of its own name would resolve.
    socket.gethostname = lambda: a.address
    store = TCPStore(a.address, 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=a.timeout_s)

    def load(saved: dict[str, Any]) -> None:
        for name, obj in state.items():
            obj.load_state_dict(saved[name])

    return Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=a.min_replicas or a.replicas,
                   use_async_quorum=use_async_quorum, load_state_dict=load,
                   state_dict=lambda: {name: obj.state_dict() for name, obj in state.items()},
                   replica_id=f"site{a.replica}", rank=0, world_size=1, store_addr=a.address, store_port=store.port,
                   lighthouse_addr=a.lighthouse, hostname=a.address, timeout=timeout, quorum_timeout=timeout,
                   connect_timeout=timeout, init_sync=False)


def set_schedule(schedule: Any, step: int) -> None:
    """The learning rate of global step ``step``, on a replica that a peer healed part-way through."""
    schedule.last_epoch = step - 1
    schedule.step()


def run_diloco(a: argparse.Namespace, log: Log) -> None:
    import numpy as np
    import torch
    from torchft.local_sgd import DiLoCo

    from dipaco.build import sharded_data
    from dipaco.data.packing import DocumentTokens
    from dipaco.eval.evaluate import validation_split
    from dipaco.model.pretrained import load_pretrained, path_llama_config
    from dipaco.model.scoring import Scoring, score_documents
    from dipaco.paths.factory import sampler_seed
    from dipaco.paths.inner import build_adamw
    from dipaco.paths.lr_schedule import build_scheduler
    from dipaco.paths.sampler import ShardSampler
    from dipaco.route.shards import assign_paths
    from dipaco.run import load_config
    from dipaco.runtime import seed_everything

    n, p = a.replicas, a.replica
    cfg = load_config(a.config, [f"topology.preset=diloco:{n}"])
    seed_everything(cfg.run.seed, torch.device("cpu"), cfg.run.deterministic)
    prepared, _, sharding = sharded_data(cfg)
    llama = path_llama_config(cfg.model, prepared.tokenizer, cfg.data.seq_len)
    model = load_pretrained(Path(cfg.run.dir) / "pretrain", llama).train()
    optim = cfg.train.optim
    inner = build_adamw(model, optim)
    rounds, sync_every = cfg.train.rounds, cfg.train.inner_steps
    schedule = build_scheduler(inner, optim.warmup_steps, rounds * sync_every, optim.min_lr_ratio)
    outer = torch.optim.SGD(model.parameters(), lr=cfg.outer.lr, momentum=cfg.outer.momentum,
                            nesterov=cfg.outer.nesterov)
    sampler = ShardSampler(sharding.shards[p], optim.batch_size, seed=sampler_seed(cfg.run.seed, p))

    val = validation_split(cfg.eval, prepared)
    routes = assign_paths(val, n, cfg.train.sharding, cfg.run.seed, cfg.train.shard_column)
    docs = DocumentTokens(val).documents(np.flatnonzero(routes == p), np.int32)
    scoring = Scoring(cfg.data.seq_len, cfg.data.prefix_tokens, cfg.eval.batch_size, prepared.tokenizer.pad_token_id)
    manager = build_manager(a, {"model": model, "inner": inner, "schedule": schedule}, use_async_quorum=False)

    step = 0  # global inner steps this replica's sampler has read
    round_start = time.perf_counter()
    with DiLoCo(manager, [model], inner, outer, sync_every=sync_every):
        while manager.current_step() < rounds:
            before_round = manager.current_step()
            for _ in range(sync_every):
                x = sampler.next_batch()
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                if optim.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
                before = time.perf_counter()
                inner.step()  # every sync_every-th step, torchft's hook syncs: the quorum, the allreduce, the outer step
                stepped = time.perf_counter() - before
                schedule.step()
                inner.zero_grad(set_to_none=True)
                step += 1
                log(event="step", step=step, manager_step=manager.current_step(), wall=time.time())
            committed = manager.current_step()
            healed = committed > before_round + 1  # a peer's state replaced this replica's: it was behind
            if healed:  # read on from where the quorum is, as if this replica had never stopped
                step = committed * sync_every
                sampler.load_state_dict({"epoch": step * optim.batch_size // sampler.sequences.shape[0],
                                         "position": step * optim.batch_size % sampler.sequences.shape[0]})
                set_schedule(schedule, step)
            with torch.no_grad():  # the global weights, as dipaco scores them after its outer step
                scores = score_documents(model, docs, scoring)
            model.train()
            log(event="sync", round=committed, step=step, committed=committed, advanced=committed > before_round,
                healed=healed, participants=manager.num_participants(), nll=float(scores.nll.sum()),
                tokens=int(scores.tokens.sum()), docs=len(docs), round_seconds=time.perf_counter() - round_start,
                sync_seconds=stepped, loss=loss.item(), wall=time.time())
            round_start = time.perf_counter()
    log(event="end", steps=step, committed=manager.current_step(), wall=time.time())
    manager.shutdown(wait=False)


def run_ddp(a: argparse.Namespace, log: Log) -> None:
    import torch
    from torchft.ddp import DistributedDataParallel
    from torchft.optim import OptimizerWrapper

    from bench.dense_work import dense_work
    from dipaco.run import load_config
    from dipaco.runtime import seed_everything

    n, p = a.replicas, a.replica
    cfg = load_config(a.config, [])
    seed_everything(cfg.run.seed + p, torch.device("cpu"), True)
    work = dense_work(cfg, n * n, p, n)
    manager = build_manager(a, {"model": work.model, "optimizer": work.optimizer, "schedule": work.schedule},
                            use_async_quorum=True)
    ddp = DistributedDataParallel(manager, work.model)
    optimizer = OptimizerWrapper(manager, work.optimizer)
    clock = 0.0
    while manager.current_step() < work.steps:
        begin = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)  # starts the step's quorum, which overlaps the forward pass
        x = work.next_batch()
        loss = ddp(input_ids=x, labels=x).loss
        loss.backward()
        if work.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(work.model.parameters(), work.grad_clip)
        evaluate = (manager.current_step() + 1) % work.eval_every == 0 or manager.current_step() + 1 == work.steps
        stop = False
        if evaluate:  # every replica stops at the same step: the flags' mean, through torchft's own allreduce
            flag = torch.tensor([float(clock >= a.seconds)])
            manager.allreduce(flag).wait()
            stop = flag.item() > 0
        optimizer.step()  # applied only if torchft commits the step
        work.schedule.step()
        clock += time.perf_counter() - begin
        step = manager.current_step()
        log(event="step", step=step, wall=time.time())
        if evaluate and p == 0:
            log(event="eval", step=step, train_seconds=clock, ppl=work.validation_ppl())
        if stop:
            break
    log(event="end", step=manager.current_step(), steps_planned=work.steps, train_seconds=clock,
        local_batch=work.local_batch, ranks=n)
    manager.shutdown(wait=False)


ALGORITHMS: dict[str, Callable[[argparse.Namespace, Log], None]] = {"diloco": run_diloco, "ddp": run_ddp}


def run_replica(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    log = Log(a.out)
    ALGORITHMS[a.algorithm](a, log)
    log.file.close()
    # As bench.sites' DDP worker: tearing down gloo's groups at exit can deadlock on the GIL; all is written.
    os._exit(0)


if __name__ == "__main__":  # a worker the sites benchmark starts, not a benchmark of `python -m bench`
    run_replica()
