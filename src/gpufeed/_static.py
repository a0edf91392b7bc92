"""Static delivery for CUDA graphs: every batch lands in the same device tensors."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from gpufeed._tree import flatten


class StaticBatch(NamedTuple):
    """A batch in the static tensors, and how many rows (along dim 0) of it are real.

    Rows ``valid:`` of each tensor are zero padding (a short last batch).
    """

    batch: Any
    valid: int


class StaticBuffers:
    """The fixed-address tensors a captured CUDA graph reads, refilled for every batch.

    Invariant: the refill is a device-to-device copy enqueued on the consumer's current stream, after
    that stream waited on the batch's event. A graph replay is enqueued on the same stream, so the
    refill for batch ``k + 1`` runs after replay ``k`` has read batch ``k``, and replay ``k + 1`` runs
    after the refill: the copy never overlaps the replay that reads the tensors. The buffers take the
    shapes of the first batch; a later batch may be shorter along dim 0 (padded with zeros) but not
    longer, and dtypes and other dims must match.
    """

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] | None = None

    def fill(self, batch: Any) -> StaticBatch:
        leaves, rebuild = flatten(batch)
        if self.tensors is None:
            self.tensors = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in leaves]
        if len(leaves) != len(self.tensors):
            raise ValueError(f"static=True needs batches of one structure: the first had {len(self.tensors)} "
                             f"tensors, this one {len(leaves)}")
        valid = None
        for s, t in zip(self.tensors, leaves, strict=True):
            n = self._copy(s, t)
            valid = n if valid is None else min(valid, n)
        return StaticBatch(rebuild(self.tensors), valid if valid is not None else 0)

    @staticmethod
    def _copy(s: torch.Tensor, t: torch.Tensor) -> int:
        if t.dtype != s.dtype or t.shape[1:] != s.shape[1:] or t.dim() != s.dim() or (
                t.dim() and t.shape[0] > s.shape[0]):
            raise ValueError(
                f"static=True: a batch tensor of shape {tuple(t.shape)} and {t.dtype} does not fit the "
                f"static "
                f"tensor of shape {tuple(s.shape)} and {s.dtype} taken from the first batch; make the first "
                "batch the largest (e.g. drop_last=False keeps full batches first)"
            )
        if t.dim() == 0:
            s.copy_(t, non_blocking=True)
            return 1
        n = t.shape[0]
        s[:n].copy_(t, non_blocking=True)
        if n < s.shape[0]:
            s[n:].zero_()
        return n
