"""One replica of torchft's own DiLoCo, a peer row of ``python -m bench sites`` (issue 75).

torchft (meta-pytorch/torchft, the ``peers`` extra) is what a lab would pick instead of dipaco for fault-tolerant
DiLoCo. This worker runs its classes as its documentation wires them, re-implementing none of them:
``torchft.Manager`` (one replica group of one process per site, joined by the Lighthouse the benchmark starts on
site 0), ``torchft.ProcessGroupGloo`` and ``torchft.local_sgd.DiLoCo`` with a Nesterov ``SGD`` outer optimizer, the
synchronous quorum DiLoCo requires, and ``sync_every = train.inner_steps``.

The work is dipaco's ``topology.preset=diloco:N`` row's, so that the two implementations can be compared step for
step: replica ``p`` starts from the run's pretrained weights, trains on the shard dipaco gives path ``p`` with
dipaco's sampler and seed (the same batches), with ``build_adamw`` and ``build_scheduler`` (the inner loop's
AdamW and schedule), clips gradients as it does, and after every sync scores the validation documents dipaco
routes to path ``p`` with the global weights. The parent sums the replicas' scores, as dipaco sums its ranks'.

What differs by design: torchft averages the replicas' pseudo-gradients uniformly, where dipaco's default
``outer.weighting=tokens`` weights each by its shard's tokens; the benchmark's fairness check runs dipaco with
``outer.weighting=uniform`` beside its default (docs/results.md).

    python -m bench.torchft_peer --config CFG --replicas N --replica P --address ADDR --lighthouse URL --out F
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.torchft_peer", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="the prepared run's config (bench sites' cfg.yaml)")
    p.add_argument("--replicas", type=int, required=True, help="replica groups in the quorum: one per site")
    p.add_argument("--replica", type=int, required=True, help="this replica's index: dipaco's path of the same work")
    p.add_argument("--address", required=True, help="this site's address, which the other replicas reach")
    p.add_argument("--lighthouse", required=True, help="the Lighthouse's URL, http://HOST:PORT")
    p.add_argument("--timeout-s", type=float, default=600.0, help="torchft's collective and quorum timeouts")
    p.add_argument("--out", required=True, help="JSONL: a record per sync")
    return p.parse_args(argv)


def run_replica(argv: list[str] | None = None) -> None:
    import numpy as np
    import torch
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
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

    a = parse_args(argv)
    n, p = a.replicas, a.replica
    # torchft's gloo group tells its peers to meet at socket.gethostname(). The sites are network namespaces of one
    # machine, which share its host name (an address no other site reaches), so each replica answers with its
    # site's address, as a machine of its own name would resolve.
    socket.gethostname = lambda: a.address
    cfg = load_config(a.config, [f"topology.preset=diloco:{n}"])
    device = torch.device("cpu")
    seed_everything(cfg.run.seed, device, cfg.run.deterministic)
    prepared, _, sharding = sharded_data(cfg)
    llama = path_llama_config(cfg.model, prepared.tokenizer, cfg.data.seq_len)
    model = load_pretrained(Path(cfg.run.dir) / "pretrain", llama).train()
    optim = cfg.train.optim
    inner = build_adamw(model, optim)
    steps, sync_every = cfg.train.rounds * cfg.train.inner_steps, cfg.train.inner_steps
    schedule = build_scheduler(inner, optim.warmup_steps, steps, optim.min_lr_ratio)
    outer = torch.optim.SGD(model.parameters(), lr=cfg.outer.lr, momentum=cfg.outer.momentum,
                            nesterov=cfg.outer.nesterov)
    sampler = ShardSampler(sharding.shards[p], optim.batch_size, seed=sampler_seed(cfg.run.seed, p))

    val = validation_split(cfg.eval, prepared)
    routes = assign_paths(val, n, cfg.train.sharding, cfg.run.seed, cfg.train.shard_column)
    docs = DocumentTokens(val).documents(np.flatnonzero(routes == p), np.int32)
    scoring = Scoring(cfg.data.seq_len, cfg.data.prefix_tokens, cfg.eval.batch_size, prepared.tokenizer.pad_token_id)

    # A replica group of one process: its own store on this site, which the quorum's process group reaches.
    store = TCPStore(a.address, 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=a.timeout_s)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=n, use_async_quorum=False,
                      load_state_dict=lambda state: (model.load_state_dict(state["model"]),
                                                     inner.load_state_dict(state["inner"])),
                      state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
                      replica_id=f"site{p}", rank=0, world_size=1, store_addr=a.address, store_port=store.port,
                      lighthouse_addr=a.lighthouse, hostname=a.address, timeout=timeout, quorum_timeout=timeout,
                      connect_timeout=timeout, init_sync=False)
    out = open(a.out, "w")

    def log(**record: Any) -> None:
        out.write(json.dumps(record) + "\n")
        out.flush()

    round_start = time.perf_counter()
    with DiLoCo(manager, [model], inner, outer, sync_every=sync_every):
        for step in range(1, steps + 1):
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
            if step % sync_every == 0:
                with torch.no_grad():  # the global weights, as dipaco scores them after its outer step
                    scores = score_documents(model, docs, scoring)
                model.train()
                log(event="sync", round=step // sync_every, step=step, committed=manager.current_step(),
                    participants=manager.num_participants(), nll=float(scores.nll.sum()),
                    tokens=int(scores.tokens.sum()), docs=len(docs), round_seconds=time.perf_counter() - round_start,
                    sync_seconds=stepped, loss=loss.item())
                round_start = time.perf_counter()
    log(event="end", steps=steps, committed=manager.current_step())
    manager.shutdown(wait=False)
    out.close()


if __name__ == "__main__":  # a worker the sites benchmark starts, not a benchmark of `python -m bench`
    run_replica()
