"""Where every job reads and writes inside a run directory.

    <run.dir>/
      data/           tokenized train/validation splits (HF datasets, Arrow) + prepare.json
      tokenizer/      HF fast tokenizer
      prepare.work/   a running or killed `dipaco prepare`'s finished steps (removed when it succeeds)
      pretrain/       the dense path-sized model (save_pretrained) that initialises every module
      pretrain.work/  a stopped `dipaco pretrain`'s step checkpoint (`--resume` continues it)
      routing/        router artifact and routed splits (`dipaco route`)
      train/<name>/   one experiment: config.yaml, metrics.jsonl, checkpoints/, eval.json
"""

from __future__ import annotations

from pathlib import Path


class RunDir:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def prepare_work(self) -> Path:
        return self.root / "prepare.work"

    @property
    def pretrain(self) -> Path:
        return self.root / "pretrain"

    @property
    def pretrain_work(self) -> Path:
        """A stopped (or periodically checkpointed) `dipaco pretrain`'s step checkpoint, until it completes."""
        return self.root / "pretrain.work"

    @property
    def routing(self) -> Path:
        return self.root / "routing"

    def experiment(self, name: str) -> Path:
        return self.root / "train" / name

    def experiments(self) -> list[Path]:
        base = self.root / "train"
        return sorted(p for p in base.iterdir() if p.is_dir()) if base.is_dir() else []
