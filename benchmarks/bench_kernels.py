"""The fused kernels side by side in one process: numba's (jitkernels.py, deltapass.py) against the C
ones (native.py: native.c, deltapass.c).

python -m benchmarks.bench_kernels [--n 2000000] [--experts 3] [--rounds 7]

One block of `n` bf16 elements (the base and `experts` experts, standard normal values), every fold
mode (plain, magnitude band, DARE, DELLA) into plain and sign-consensus sums, and the finish into
bf16: each call timed `rounds` times into sums allocated once (as the merger's per-thread buffers),
the two implementations alternating call by call, outputs required bit-identical. Then
registration's statistics pass (group_pass) over the same `n` elements as 64 KiB blocks in groups
of 4 MiB (registration's defaults: the base against the first expert), and its base norms and
sketch codes. Reports the minimum and median milliseconds per call and the ratio C / numba of the
medians. Also the time to
load each: numba's import and first cached call, and the C library's load, in fresh processes
(`--starts` of each, alternating).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import numpy as np

from mergedb import blockgroups, deltapass, jitkernels, kernels, native, stats

from .common import machine, save

MODES = {0: "plain", 1: "magnitude", 2: "dare", 3: "della"}

START = {
    "numba": "from mergedb import jitkernels as k",
    "native": "from mergedb import native; k = native.load(); assert k is not None",
}
CALL = """
import numpy as np
base, ex, acc = np.zeros(8, np.uint16), np.zeros((1, 8), np.uint16), np.zeros((1, 8), np.float32)
z, keys, ranks = np.zeros(1), np.zeros(1, np.uint64), np.zeros((0, 32768))
k.fold_group(base, ex, 0, 0, 0, np.ones(1, np.float32), z, z, keys, 1.0, 0.0, ranks, acc)
"""


def _bf16(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def kernel_times(n: int, g: int, rounds: int) -> list[dict]:
    c = native.load()
    if c is None:
        raise SystemExit(f"no C kernels here: {native.why_not()}")
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n)
    base = _bf16(x)  # (n,) a base block
    ex = _bf16(x[None, :] + 0.05 * rng.standard_normal((g, n)))  # (g, n) experts: the base plus deltas
    coefs, lo, hi = np.ones(g, np.float32), np.full(g, 0.05), np.full(g, np.inf)  # magnitude: keeps ~1/3
    keys = rng.integers(0, 2**63, g, dtype=np.uint64)
    ranks = rng.random((g, 1 << 15))
    rows = []
    for mode, name in MODES.items():
        for sums in (1, 5):
            r = ranks if mode == 3 else kernels.NO_RANKS
            got = {"numba": np.zeros((sums, n), np.float32), "native": np.zeros((sums, n), np.float32)}
            ms: dict[str, list[float]] = {"numba": [], "native": []}
            for _ in range(rounds + 1):  # the first round loads the kernels and touches the sums: not timed
                for label, k in (("numba", jitkernels), ("native", c)):
                    acc = got[label]  # reused, as the merger reuses its per-thread sums
                    acc.fill(0)
                    t = time.perf_counter()
                    k.fold_group(base, ex, 0, mode, 0, coefs, lo, hi, keys, 0.6, 0.1, r, acc)
                    ms[label].append((time.perf_counter() - t) * 1e3)
            if got["numba"].tobytes() != got["native"].tobytes():
                raise SystemExit(f"fold_group {name}: the two kernels differ")
            rows.append(_row(f"fold_group {name}, {'sign consensus' if sums == 5 else 'weighted'} sums", ms))
    acc = np.zeros((5, n), np.float32)
    jitkernels.fold_group(base, ex, 0, 1, 0, coefs, lo, hi, keys, 0.6, 0.1, kernels.NO_RANKS, acc)
    ms, outs = {"numba": [], "native": []}, {"numba": np.zeros(n, np.uint16), "native": np.zeros(n, np.uint16)}
    for _ in range(rounds + 1):
        for label, k in (("numba", jitkernels), ("native", c)):
            out = outs[label]
            t = time.perf_counter()
            k.finish(base, 0, acc, True, 1.0, np.empty(0, np.float32), out)
            ms[label].append((time.perf_counter() - t) * 1e3)
    if outs["numba"].tobytes() != outs["native"].tobytes():
        raise SystemExit("finish: the two kernels differ")
    rows.append(_row("finish to bf16, sign consensus", ms))
    return rows


def stats_times(n: int, rounds: int) -> list[dict]:
    """Registration's kernels over `n` bf16 elements: per call of a group, as scan.py makes them."""
    c = native.load()
    if c is None:
        raise SystemExit(f"no C kernels here: {native.why_not()}")
    rng = np.random.default_rng(1)
    x = rng.standard_normal(n)
    b, e = _bf16(x), _bf16(x + 0.05 * rng.standard_normal(n))
    block = 32768  # elements of a 64 KiB bf16 block
    per_group = blockgroups.GROUP_BYTES // (2 * block)
    bounds = [*range(0, n, block), n]  # the blocks' starts, then the end
    groups = [np.array(bounds[i : i + per_group + 1]) for i in range(0, len(bounds) - 1, per_group)]
    sizes = np.diff(bounds)
    codes = np.concatenate([stats.sketch_codes(np.uint64(k), int(m), 64) for k, m in enumerate(sizes)])
    impls = (("numba", deltapass), ("native", c))
    rows = []
    ms: dict[str, list[float]] = {"numba": [], "native": []}
    got: dict[str, bytes] = {}
    for _ in range(rounds + 1):
        for label, k in impls:
            summary, exc = np.zeros(stats.SUMMARY_BINS, np.int64), np.zeros(n // 4 + 1, np.uint32)
            abs_bits, outs, n_exc = np.empty(n, np.uint32), [], 0
            t = time.perf_counter()
            for g in groups:
                out = stats.group_arrays(len(g) - 1, 64)
                s0, s1 = g[0], g[-1]
                n_exc = k.group_pass(
                    e[s0:s1].view(np.uint8), b[s0:s1].view(np.uint8), e[s0:s1], b[s0:s1], (g - s0) * 2, g - s0,
                    abs_bits[s0:s1], codes[s0:s1], summary, exc, n_exc, stats.EDGE, stats.EDGE_SQ,
                    stats.HIST_SHIFT, stats.SUMMARY_SHIFT, out,
                )  # fmt: skip
                outs.append(out)
            ms[label].append((time.perf_counter() - t) * 1e3)
            got[label] = abs_bits.tobytes() + summary.tobytes() + b"".join(a.tobytes() for o in outs for a in o)
    if got["numba"] != got["native"]:
        raise SystemExit("group_pass: the two kernels differ")
    rows.append(_row(f"group_pass (registration's statistics), {len(sizes)} blocks of 64 KiB in 4 MiB groups", ms))
    start = np.array(bounds)
    for what, call in (
        ("base_group (base norms)", lambda k, out: k.base_group(b, start, out[0], out[1])),
        ("bucket_codes (sketch codes)", lambda k, out: k.bucket_codes(np.uint64(7), 64, out[2])),
    ):
        ms = {"numba": [], "native": []}
        res = {}
        for _ in range(rounds + 1):
            for label, k in impls:
                out = (np.zeros(len(start) - 1), np.zeros(len(start) - 1, np.int64), np.empty(n, np.uint16))
                t = time.perf_counter()
                call(k, out)
                ms[label].append((time.perf_counter() - t) * 1e3)
                res[label] = b"".join(a.tobytes() for a in out[:2]) if what.startswith("base") else out[2].tobytes()
        if res["numba"] != res["native"]:
            raise SystemExit(f"{what}: the two kernels differ")
        rows.append(_row(what, ms))
    return rows


def _row(what: str, ms: dict[str, list[float]]) -> dict:
    timed = {k: v[1:] for k, v in ms.items()}
    med = {k: statistics.median(v) for k, v in timed.items()}
    return {
        "kernel": what,
        "numba_ms": {"min": min(timed["numba"]), "median": med["numba"]},
        "native_ms": {"min": min(timed["native"]), "median": med["native"]},
        "native_over_numba": med["native"] / med["numba"],
    }


def start_times(starts: int) -> dict:
    """Seconds from a fresh interpreter to a first kernel call returning, numpy imported first."""
    out: dict[str, list[float]] = {"numba": [], "native": []}
    for i in range(starts):
        for label in ("numba", "native") if i % 2 == 0 else ("native", "numba"):
            code = (
                f"import time, numpy\nt = time.perf_counter()\n{START[label]}\n{CALL}\nprint(time.perf_counter() - t)"
            )
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
            out[label].append(float(r.stdout.strip()))
    return {k: {"min": min(v), "median": statistics.median(v), "all": v} for k, v in out.items()}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2_000_000)
    ap.add_argument("--experts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--starts", type=int, default=6)
    a = ap.parse_args()
    rows = kernel_times(a.n, a.experts, a.rounds) + stats_times(a.n, a.rounds)
    for r in rows:
        print(
            f"{r['kernel']}: numba {r['numba_ms']['median']:.2f} ms, C {r['native_ms']['median']:.2f} ms "
            f"({r['native_over_numba']:.2f}x)",
            flush=True,
        )
    starts = start_times(a.starts)
    print(
        f"first call in a fresh process: numba {starts['numba']['median']:.3f} s, C {starts['native']['median']:.3f} s"
    )
    doc = {"machine": machine(), "n": a.n, "experts": a.experts, "rounds": a.rounds, "kernels": rows, "start": starts}
    print(save("kernels", doc))
