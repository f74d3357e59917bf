"""Error feedback: a transport wrapper that carries each module's encoding loss into the next sync.

Seide et al. 2014 ("1-bit SGD"); Karimireddy et al. 2019 (arXiv 1901.09847). Before sending, each
module's carried residual is added to its payload; after the reduction, the new residual is what
this rank's contribution lost (its own encoding error, plus the re-encoding error of the slice it
owns in the two-phase scheme), so the error does not accumulate over syncs. Residuals are per rank
and checkpointed (:meth:`ErrorFeedback.state_dict`).

``applied(meta)`` says, from a module's summed meta values, whether the caller will apply the sum;
a sync that applies nothing for a module (no rank contributed) keeps its old residual.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import torch

from dipaco.comm.codecs import Codec
from dipaco.comm.reduce import Payload, Reduced, Reduction, Transport, TransportWrapper
from dipaco.errors import CheckpointError


class _FeedbackReduction:
    def __init__(self, inner: Reduction, feedback: ErrorFeedback) -> None:
        self.inner, self.feedback = inner, feedback
        self.done: Reduced | None = None

    def wait(self) -> Reduced:
        if self.done is None:
            self.done = self.inner.wait()
            for m, payload in self.done.payloads.items():
                if not self.feedback.applied(payload.meta):
                    continue
                error = self.done.errors.get(m)
                if error is None:  # reduced losslessly (a per-call fp32 codec): the residual went out exactly
                    self.feedback.residual.pop(m, None)
                else:
                    self.feedback.residual[m] = error
        return self.done


class ErrorFeedback(TransportWrapper[Transport]):
    """Wraps a lossy :class:`Transport`; same ``start``/``reduce`` interface."""

    def __init__(self, transport: Transport, applied: Callable[[torch.Tensor], bool]) -> None:
        super().__init__(transport)
        self.applied = applied
        self.residual: dict[int, torch.Tensor] = {}  # module id -> carried encoding error

    def start(self, payloads: Mapping[int, Payload], codec: Codec | None = None,
              only: Collection[int] | None = None) -> _FeedbackReduction:
        """As :meth:`Transport.start`; the residuals of the modules reduced are carried in."""
        carried = {m: Payload(p.meta, p.values + self.residual[m]) if m in self.residual else p
                   for m, p in payloads.items()}
        return _FeedbackReduction(self.transport.start(carried, track_error=True, codec=codec, only=only), self)

    def reduce(self, payloads: Mapping[int, Payload], codec: Codec | None = None,
               only: Collection[int] | None = None) -> Reduced:
        return self.start(payloads, codec, only).wait()

    # --- state: by module name -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        return {self.transport.names[m]: r for m, r in sorted(self.residual.items())}

    def load_state_dict(self, state: Mapping[str, torch.Tensor], numel: Mapping[int, int],
                        device: torch.device) -> None:
        """``numel``: each communicated module's payload size, to refuse a mismatched residual."""
        ids = {self.transport.names[m]: m for m in self.transport.modules}
        unknown = sorted(set(state) - set(ids))
        if unknown:
            raise CheckpointError(f"error-feedback residuals for modules this rank does not communicate: {unknown[:3]}")
        self.residual = {}
        for name, value in state.items():
            if value.numel() != numel[ids[name]]:
                raise CheckpointError(
                    f"error-feedback residual of {name}: {value.numel()} elements, expected {numel[ids[name]]}"
                )
            self.residual[ids[name]] = value.to(device, torch.float32).clone()
