"""The merger's per-step path: numpy `kernels.sparsify` + `kernels.Accumulator` per block, model_stock
a whole tensor per unit. It is the fused kernels' oracle (tests/test_threads.py compares them bit
for bit) and runs when kernels.MODE lacks the method.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import kernels
from .encoding import encode
from .layout import output_dtype, row_elems
from .stock import StockDots
from .tensorfile import DTYPES, as_float32

if TYPE_CHECKING:
    from .merger import Merger, Unit


def merge_slow(m: Merger, u: Unit, base_raw: np.ndarray, out: np.ndarray) -> None:
    """The per-step path (numpy `sparsify` + `Accumulator`; model_stock a whole tensor per unit): the
    fused kernels' oracle, run when kernels.MODE lacks the method (tests/test_threads.py)."""
    ti = u.tensor_idx
    t = m.xp.tensors[ti]
    out_dtype = output_dtype(t, m.dtype)
    selected = m.sel.get(ti, {})
    raw_dt, out_dt = np.dtype(DTYPES[t.dtype][1]), np.dtype(DTYPES[out_dtype][1])
    stock = StockDots(m.xp, ti) if m.xp.method == "model_stock" else None
    pending: list[tuple[int, np.ndarray, np.ndarray]] = []  # model_stock: until t is known
    per_row = row_elems(t.shape)
    for b in u.blocks:
        r0, r1 = t.rows[b]
        lo, n = r0 * per_row, (r1 - r0) * per_row
        base = as_float32(base_raw.view(raw_dt)[lo : lo + n], t.dtype, np.empty(n, np.float32))  # (n,) f32
        acc = kernels.Accumulator(m.method, {**m.xp.params, "lambda": m._values(0, ti).lam}, n)
        deltas = []
        for pos, h in selected.get(b, []):
            if m.lora is not None and pos in m.lora.adapters:  # formed from its factors
                from . import loramerge  # only for plans with adapters (merger.py)

                d = loramerge.slow_delta(m, ti, b, pos, h, base, m.local.get("e", n, np.float32))
            else:
                raw = m._read_one(ti, b, pos, h, m.local.get("raw", len(base) * raw_dt.itemsize, np.uint8))
                d = as_float32(raw.view(raw_dt), t.dtype, m.local.get("e", n, np.float32))
                np.subtract(d, base, out=d)  # Δ in place: (n,) float32
            src, v = m.xp.experts[pos], m._values(pos, ti)
            params = {**m.xp.params, "density": v.density, "epsilon": v.epsilon}
            d = kernels.sparsify(m.method, params, d, lo, m._trim(pos, ti, t, src))
            acc.add(v.coef, v.weight, d)
            if stock is not None:
                deltas.append((pos, d.copy()))  # the scratch buffer is reused by the next expert
        update = acc.merged_delta()
        if stock is not None:
            stock.add_block(deltas)
            pending.append((lo, base, update))
            continue
        scale = m._values(0, ti).base_scale
        merged = base + update if scale == 1.0 else np.float32(scale) * base + update  # (n,) float32
        out.view(out_dt)[lo : lo + n] = encode(merged, out_dtype)
    if stock is not None:
        scale = np.float32(stock.t())
        for lo, base, update in pending:
            out.view(out_dt)[lo : lo + base.size] = encode(base + scale * update, out_dtype)
