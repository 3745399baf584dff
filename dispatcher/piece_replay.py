"""Fake outputs of a piece made from an identical earlier piece's, instead of running it on fake tensors.

Before the pieces are compiled, the split graph runs once on fake inputs (``piecewise._CompileInterpreter``), to
give each piece its example inputs. A decoder's middle pieces, one per layer, are the same code on inputs of the
same description (``piecewise.structure_key``): running each again on fake tensors costs a dispatch with
symbolic arithmetic per op (about a second for 32 layers on a CPU host) and tells nothing new. :class:`PieceReplay`
keeps the outputs of the first piece of each structure and makes the next one's outputs as fresh fake tensors
of the same description: sizes, strides, storage offset and size, dtype, device, view or not, inference or not.

Only where that is exact: every output a new tensor (no view of an input, no two outputs on one storage), a
tensor with no grad, a view only of a fresh base at offset 0, and the replica's storage size equal to the
original's; anything else runs the piece as before.
"""

from __future__ import annotations

from typing import Any

import torch

from . import compat

__all__ = ["PieceReplay", "MISS"]

MISS = object()  # no replay: run the piece
_PLAIN = (int, float, bool, type(None), torch.SymInt, torch.SymFloat, torch.SymBool)


def _outputs(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _replayable(args: list[Any], out: Any) -> bool:
    """Whether ``out`` (a piece's outputs on ``args``) can be replicated exactly for an identical piece."""
    inputs = {compat.storage_key(a) for a in args if isinstance(a, torch.Tensor)}
    seen = set()
    for o in _outputs(out):
        if isinstance(o, _PLAIN):
            continue
        if not isinstance(o, torch.Tensor) or o.layout != torch.strided or o.requires_grad:
            return False
        key = compat.storage_key(o)
        if key in inputs or key in seen:
            return False
        seen.add(key)
        base = o._base
        if base is not None and (base._base is not None or not _at_zero(base)):
            return False
        if base is None and not _at_zero(o):
            return False
    return True


def _at_zero(t: torch.Tensor) -> bool:
    offset = t.storage_offset()
    return not isinstance(offset, torch.SymInt) and offset == 0


def _replica(t: torch.Tensor) -> torch.Tensor | None:
    """A fresh fake tensor described as ``t`` (in the current fake mode), or None where it would differ."""
    base = t if t._base is None else t._base
    with torch.inference_mode(t.is_inference()):
        new = torch.empty_strided(base.shape, base.stride(), dtype=base.dtype, device=base.device)
        if t._base is not None:
            new = new.as_strided(t.shape, t.stride(), t.storage_offset())
    if str(new.untyped_storage().nbytes()) != str(t.untyped_storage().nbytes()) or new.is_inference() != t.is_inference():
        return None
    return new


class PieceReplay:
    """The outputs of the first piece of each structure, replicated for the next pieces of that structure."""

    def __init__(self) -> None:
        self._refs: dict[str, Any] = {}  # structure key -> the first piece's outputs, or None (not replayable)
        self.replayed = 0

    def record(self, key: str | None, args: list[Any], out: Any) -> None:
        """After a piece ran: keep its outputs if an identical piece can reuse their description."""
        if key is not None and key not in self._refs:
            self._refs[key] = out if _replayable(args, out) else None

    def replay(self, key: str | None) -> Any:
        """Fresh outputs for a piece of structure ``key``, or :data:`MISS` (run it)."""
        ref = self._refs.get(key) if key is not None else None
        if ref is None:
            return MISS
        outs = []
        for o in _outputs(ref):
            if isinstance(o, torch.Tensor):
                o = _replica(o)
                if o is None:
                    return MISS
            outs.append(o)
        self.replayed += 1
        return type(ref)(outs) if isinstance(ref, (tuple, list)) else outs[0]
