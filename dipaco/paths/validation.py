"""Validation during training (``eval.every``): each path's perplexity on a fixed validation slice every K rounds.

The slice is the first ``eval.max_docs`` validation documents (all of them when null), routed to the
paths by the rule that sharded the training documents, as `dipaco eval` routes them; each path is
composed from the bank into a scratch model and scores its own documents (the routing prefix is context,
not scored). The round scheduler puts the result in its round report; the trainer logs it as an
``eval`` record of ``metrics.jsonl`` (and TensorBoard) once the round is checkpointed. Scoring changes
nothing of training: it runs under ``torch.no_grad`` on a separate model, and draws no random numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from transformers import PreTrainedModel

from dipaco.model.bank import ModuleBank
from dipaco.model.scoring import Scoring, score_documents


class PathValidation:
    """Every ``every`` rounds, the validation perplexity of this rank's paths on their routed documents."""

    def __init__(self, docs: Mapping[int, Sequence[Sequence[int] | np.ndarray]], scoring: Scoring,
                 scratch_model: PreTrainedModel, every: int) -> None:
        self.docs, self.scoring, self.model, self.every = docs, scoring, scratch_model, every

    def due(self, round_number: int) -> bool:
        return self.every > 0 and round_number % self.every == 0

    def score(self, bank: ModuleBank, round_number: int) -> dict[int, dict]:
        """Path -> its documents, scored tokens, summed NLL and perplexity (a path without documents: none)."""
        if not self.due(round_number):
            return {}
        out = {}
        for path, docs in self.docs.items():
            if not docs:
                out[path] = {"docs": 0, "tokens": 0, "nll": 0.0, "ppl": None}
                continue
            scores = score_documents(bank.compose(path, self.model), docs, self.scoring)
            nll, tokens = float(scores.nll.sum()), int(scores.tokens.sum())
            out[path] = {"docs": len(docs), "tokens": tokens, "nll": nll,
                         "ppl": math.exp(nll / tokens) if tokens else None}
        return out


def validation_record(per_path: Mapping[int, dict]) -> dict:
    """The ``eval`` record of a round: each path's perplexity and the token-weighted overall one."""
    nll = sum(v["nll"] for v in per_path.values())
    tokens = sum(v["tokens"] for v in per_path.values())
    return {"ppl": {f"path_{p:03d}": v["ppl"] for p, v in sorted(per_path.items())},
            "docs": {f"path_{p:03d}": v["docs"] for p, v in sorted(per_path.items())},
            "overall_ppl": math.exp(nll / tokens) if tokens else None, "scored_tokens": tokens}
