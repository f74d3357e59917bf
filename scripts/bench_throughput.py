"""Tokens/s of one DiPaCo path's inner loop against a plain LlamaForCausalLM + AdamW loop.

Both sides run in this process on the same architecture, batch size and sequence length,
alternating in blocks (A B, B A, A B ...) so that load from other processes on a shared machine hits
both alike; the reported figure is the median over blocks. The plain loop is what a user would
write by hand: forward with labels, backward, gradient clipping, AdamW step, zero_grad. Ours is
``dipaco.train.inner.InnerLoop`` on a path composed from a ``ModuleBank`` (2x2 grid), fed by a
``ShardSampler`` and stepping its LR schedule, exactly as ``dipaco train`` runs it.

    python scripts/bench_throughput.py --out docs/bench_throughput.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from transformers import LlamaForCausalLM

from dipaco.model.bank import ModuleBank
from dipaco.config import ModelConfig, OptimConfig
from dipaco.train.inner import InnerLoop, build_adamw
from dipaco.model.llama import build_model, llama_config
from dipaco.train.sampler import ShardSampler
from dipaco.model.topology import Topology


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10, help="steps per timed block")
    p.add_argument("--blocks", type=int, default=6, help="timed blocks per side, interleaved")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", help="write the figures as JSON here")
    return p.parse_args()


class PlainLoop:
    """The hand-written baseline: nothing but the model, AdamW and clipping."""

    def __init__(self, model: LlamaForCausalLM, data: torch.Tensor, cfg: OptimConfig) -> None:
        self.model, self.data, self.cfg = model, data, cfg
        self.optimizer = build_adamw(model, cfg)
        self.i = 0

    def run(self, steps: int) -> None:
        self.model.train()
        for _ in range(steps):
            batch = self.data[self.i % self.data.shape[0]]
            self.i += 1
            loss = self.model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        loss.item()  # wait for the device


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    model_cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                            intermediate_size=args.intermediate, num_heads=args.heads)
    llama = llama_config(model_cfg, args.vocab, args.seq_len, eos_id=0, pad_id=1)
    optim = OptimConfig(lr=1e-3, warmup_steps=10, batch_size=args.batch)
    gen = torch.Generator().manual_seed(0)
    total_steps = args.steps * (args.blocks + 1)
    tokens = torch.randint(0, args.vocab, (total_steps * args.batch, args.seq_len), generator=gen)

    topology = Topology.grid(args.layers, [2, 2])
    bank = ModuleBank(topology, build_model(llama, seed=0))
    path_model = bank.compose(3, build_model(llama, device=device))
    ours = InnerLoop(path_model, ShardSampler(tokens, args.batch, seed=0), optim, total_steps, device)
    plain = PlainLoop(build_model(llama, seed=0, device=device),
                      tokens.to(device).view(-1, args.batch, args.seq_len), optim)

    # Warm-up (allocator, kernels) outside the timings.
    ours.run(args.steps // 2 or 1)
    plain.run(args.steps // 2 or 1)
    per_block = args.steps * args.batch * args.seq_len
    rates: dict[str, list[float]] = {"dipaco_path": [], "plain_llama": []}
    sides = [("dipaco_path", ours), ("plain_llama", plain)]
    for block in range(args.blocks):
        for name, loop in sides if block % 2 == 0 else sides[::-1]:  # alternate who goes first
            start = time.perf_counter()
            loop.run(args.steps)
            rates[name].append(per_block / (time.perf_counter() - start))

    median = {k: statistics.median(v) for k, v in rates.items()}
    ratio = median["dipaco_path"] / median["plain_llama"]
    params = sum(p.numel() for p in path_model.parameters())
    result = {
        "model": {"layers": args.layers, "hidden": args.hidden, "vocab": args.vocab, "params": params},
        "batch": args.batch, "seq_len": args.seq_len, "steps_per_block": args.steps, "blocks": args.blocks,
        "device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.machine(),
        "tokens_per_s_median": median, "tokens_per_s_blocks": rates, "ratio": ratio, "target": 0.95,
    }
    print(f"model {params:,} params, batch {args.batch} x seq {args.seq_len}, {args.blocks} blocks of {args.steps} steps, "
          f"{torch.get_num_threads()} threads on {device}")
    for name, rate in median.items():
        print(f"  {name:<12} {rate:>10,.0f} tokens/s (median)")
    print(f"  ratio dipaco/plain = {ratio:.3f} (target >= 0.95)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
