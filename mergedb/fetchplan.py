"""The byte ranges a merge will read, in the order it reads them, declared to its remote sources.

A remote source coalesces what is declared into few requests and fetches ahead (sources.py);
local sources ignore declarations. The merger reads every tensor of the base in full, in tensor
order, and each selected (expert, block) once, tensor by tensor and block by block.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from .layout import block_bytes
from .sources import LocalFile, RemoteFile, declare

if TYPE_CHECKING:
    from .checkpoint import PlanInputs
    from .manifest import ExecutionPlan


def declare_merge(xp: ExecutionPlan, inputs: PlanInputs) -> None:
    """Declare every read a merge of `xp` makes through `inputs` (nothing to do when all are local)."""
    if inputs.sources.any_remote:
        declare(merge_reads(xp, inputs))


def merge_reads(xp: ExecutionPlan, inputs: PlanInputs) -> Iterator[tuple[LocalFile | RemoteFile, int, int, int]]:
    """(source, offset, length, 1) of each read of the merge, in order: per tensor, the base's
    whole tensor, then each selected block's experts in plan order."""
    sel = xp.selected()
    for ti, t in enumerate(xp.tensors):
        src, info, _ = inputs.where[0][t.name]
        yield src, info.start, info.nbytes, 1
        if not t.mergeable:
            continue
        for b, work in sorted(sel.get(ti, {}).items()):
            for pos, _ in work:
                if pos in inputs.skip:  # a LoRA adapter: read from its factors (loramerge.py)
                    continue
                esrc, einfo, _ = inputs.where[pos + 1][t.name]
                lo, hi = block_bytes(t, einfo.nbytes, b)
                yield esrc, einfo.start + lo, hi - lo, 1
