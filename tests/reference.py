"""Independent reference computations for the tests: whole tensors in memory, textbook formulas.

Loads checkpoints with the safetensors library itself (not mergedb's reader) and computes every
statistic the obvious way with numpy/torch.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from safetensors.torch import load_file

MANIFEST = "mergedb_manifest.json"  # written out, not imported: the reference does not use mergedb


def load_model(folder: Path) -> dict[str, np.ndarray]:
    """name -> float32 (or raw integer) numpy array, from a model folder or a .safetensors file."""
    folder = Path(folder)
    files = (
        [folder]
        if folder.is_file()
        else (
            sorted(
                {
                    folder / f
                    for f in json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()
                }
            )
            if (folder / "model.safetensors.index.json").exists()
            else [folder / "model.safetensors"]
        )
    )
    out = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            out[name] = t.float().numpy() if t.is_floating_point() else t.numpy()
    return out


def load_raw(folder: Path) -> dict[str, bytes]:
    """name -> the tensor's raw bytes as stored."""
    folder = Path(folder)
    files = [folder] if folder.is_file() else sorted(folder.glob("*.safetensors"))
    out = {}
    for f in files:
        for name, t in load_file(str(f)).items():
            out[name] = t.contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes()
    return out


def kth_largest(abs_delta: np.ndarray, density: float) -> np.float32:
    """The k-th largest |Δ|, k = max(1, int(density·n)), by a full sort."""
    flat = np.sort(abs_delta.reshape(-1))[::-1]
    k = max(1, int(density * flat.size))
    return flat[k - 1]


def block_rows(shape: tuple[int, ...], itemsize: int, block_size: int) -> list[tuple[int, int]]:
    """Row ranges of the block layout, written out from the definition."""
    if len(shape) < 2:
        return [(0, 1)]
    row_bytes = int(np.prod(shape[1:])) * itemsize
    per = max(1, block_size // row_bytes)
    return [(r, min(shape[0], r + per)) for r in range(0, shape[0], per)]


# -- the documented definitions of coefficients and random draws, written out again -------------


def ref_coefficients(method: str, params: dict, weights: list[float]) -> list[float]:
    """c_k on Δ_k as the README's table defines them, from the request's own parameters.

    linear: w_k/Σw (w_k with normalize=false; normalize defaults to true); model_stock: 1/K;
    every other method: λ·w_k (λ defaults to 1).
    """
    if method == "linear":
        if params.get("normalize", True):
            total = sum(weights)
            return [w / total for w in weights]
        return list(weights)
    if method == "model_stock":
        return [1.0 / len(weights)] * len(weights)
    lam = params.get("lambda", 1.0)
    return [lam * w for w in weights]


def drop_key(seed: int, expert: str, tensor: str) -> int:
    """The DARE/DELLA stream key of (seed, expert name, tensor name): the first 8 bytes,
    little-endian, of SHA-256("mergedb-drop\0{seed}\0{expert}\0{tensor}")."""
    digest = hashlib.sha256(f"mergedb-drop\0{seed}\0{expert}\0{tensor}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def threefry_draws(key: int, n: int, offset: int = 0) -> np.ndarray:
    """Draws u_offset … u_{offset+n−1} of stream `key`: u_i = word 0 of Threefry-2x32 with 20 rounds
    (Salmon, Moraes, Dror & Shaw 2011, "Parallel random numbers: as easy as 1, 2, 3"; Random123's
    threefry2x32_R(20, ctr, key)) with key (low, high 32 bits of `key`) and counter (low, high
    32 bits of i), divided by 2^32. Written out from the paper on plain numpy uint32 arrays (adds
    wrap mod 2^32). float64, (n,).
    """
    rot = (13, 15, 26, 6, 17, 29, 16, 24)
    ks = [np.uint32(key & 0xFFFFFFFF), np.uint32(key >> 32)]
    ks.append(ks[0] ^ ks[1] ^ np.uint32(0x1BD11BDA))
    i = np.arange(offset, offset + n, dtype=np.uint64)
    x = [(i & np.uint64(0xFFFFFFFF)).astype(np.uint32) + ks[0], (i >> np.uint64(32)).astype(np.uint32) + ks[1]]
    for r in range(20):
        x[0] = x[0] + x[1]
        x[1] = ((x[1] << np.uint32(rot[r % 8])) | (x[1] >> np.uint32(32 - rot[r % 8]))) ^ x[0]
        if r % 4 == 3:  # key injection s = (r + 1) / 4
            s = (r + 1) // 4
            x[0] = x[0] + ks[s % 3]
            x[1] = x[1] + ks[(s + 1) % 3] + np.uint32(s)
    return x[0].astype(np.float64) / 2.0**32


def ref_merge(
    method: str,
    params: dict,
    weights: list[float],
    base: np.ndarray,
    experts: list[np.ndarray],
    *,
    seed: int = 0,
    expert_names: list[str] | None = None,
    tensor: str = "",
) -> np.ndarray:
    """Whole-tensor merge with torch, float32, experts in plan order (the textbook formulas).

    `params` are the request's parameters as given (λ defaults to 1, normalize to true; densities
    must be given); coefficients and random draws are derived here (`ref_coefficients`,
    `drop_key`, `threefry_draws`), never taken from mergedb.

    linear / task_arithmetic: θ0 + Σ_k c_k Δ_k.  TIES: trim each Δ_k to |Δ| ≥ its k-th largest
    (k = max(1, int(density·n))), elect sign(Σ w_k Δ'_k) with +1 on zero, average the agreeing
    w_k Δ'_k by Σ agreeing w_k, scale by λ.  DARE: keep element i with probability density
    (u_i < density, u_i the i-th draw of the stream keyed by (seed, expert name, tensor name))
    and rescale by 1/density. Breadcrumbs: keep ranks after the top γ, within γ+density.
    """
    import torch

    b = torch.from_numpy(base.astype(np.float32).reshape(-1))
    deltas = []
    for i, e in enumerate(experts):
        d = torch.from_numpy(e.astype(np.float32).reshape(-1)) - b
        a = d.abs()
        if method in ("ties",):
            t = float(kth_largest(a.numpy(), params["density"]))
            d = torch.where(a >= t, d, torch.zeros_like(d))
        elif method in ("breadcrumbs", "breadcrumbs_ties"):
            lo = float(kth_largest(a.numpy(), params["gamma"] + params["density"]))
            keep = a >= lo
            if int(params["gamma"] * a.numel()) >= 1:
                keep &= a < float(kth_largest(a.numpy(), params["gamma"]))
            d = torch.where(keep, d, torch.zeros_like(d))
        elif method in ("dare_linear", "dare_ties"):
            u = torch.from_numpy(threefry_draws(drop_key(seed, expert_names[i], tensor), d.numel()))
            p = params["density"]
            d = torch.where(u < p, d / p, torch.zeros_like(d))
        elif method in ("della", "della_linear"):
            # keep probability linear in the magnitude rank: the rank of |Δ| is the fraction of the
            # tensor's elements in lower 2^-6-wide magnitude bins plus half its own bin (mergedb's
            # documented definition; textbook DELLA ranks exactly)
            codes = a.numpy().view(np.uint32) >> 17
            counts = np.bincount(codes, minlength=1 << 15).astype(np.float64)
            mid = (np.cumsum(counts) - counts / 2) / counts.sum()
            rank = torch.from_numpy(mid[codes])
            p = (params["density"] - params["epsilon"] + 2 * params["epsilon"] * rank).to(torch.float32)
            u = torch.from_numpy(threefry_draws(drop_key(seed, expert_names[i], tensor), d.numel()))
            d = torch.where(u < p, d / p, torch.zeros_like(d))
        deltas.append(d)
    if method in ("linear", "task_arithmetic", "dare_linear", "breadcrumbs", "della_linear"):
        total = torch.zeros_like(b)
        for c, d in zip(ref_coefficients(method, params, weights), deltas):
            total += torch.tensor(c, dtype=torch.float32) * d
        return (b + total).numpy().reshape(base.shape)
    w = [torch.tensor(x, dtype=torch.float32) for x in weights]
    total = torch.zeros_like(b)
    for wk, d in zip(w, deltas):
        total += wk * d
    up = total >= 0
    num = torch.zeros_like(b)
    den = torch.zeros_like(b)
    for wk, d in zip(w, deltas):
        agree = torch.where(up, d > 0, d < 0)
        num += torch.where(agree, wk * d, torch.zeros_like(d))
        den += torch.where(agree, wk.expand_as(d), torch.zeros_like(d))
    if params.get("normalize", True):
        den = torch.where(den == 0, torch.ones_like(den), den)  # mergekit: divisor[divisor == 0] = 1
        num = num / den
    return (b + torch.tensor(params.get("lambda", 1.0), dtype=torch.float32) * num).numpy().reshape(base.shape)


def cast_like(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float32 to the family dtype with torch (round-to-nearest-even), back as float32."""
    import torch

    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(tdt).float().numpy()


def ref_model_stock(base: np.ndarray, experts: list[np.ndarray]) -> np.ndarray:
    """θ0 + t·Σ_k Δ_k/K with t = K·cos / (1 + (K−1)·cos), cos the mean pairwise cosine of the Δ_k."""
    import itertools

    b = base.astype(np.float32).reshape(-1)
    deltas = [e.astype(np.float32).reshape(-1) - b for e in experts]
    cos = []
    for x, y in itertools.combinations(deltas, 2):
        nx, ny = np.linalg.norm(x.astype(np.float64)), np.linalg.norm(y.astype(np.float64))
        cos.append(float(np.dot(x.astype(np.float64), y.astype(np.float64)) / (nx * ny)) if nx * ny > 0 else 0.0)
    k = len(deltas)
    c = float(np.mean(cos))
    t = k * c / (1 + (k - 1) * c) if 1 + (k - 1) * c != 0 else 0.0
    acc = np.zeros_like(b)
    for d in deltas:
        acc += np.float32(1.0 / k) * d
    return (b + np.float32(t) * acc).reshape(base.shape)


def output_digest(out: Path) -> dict[str, str]:
    """sha256 of every file of a mergedb output, its manifest by the content hash (the manifest's `run`
    part, timings and paths, differs between two runs of one plan): equal for byte-identical outputs."""
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir() if p.name != MANIFEST}
    got[MANIFEST] = json.loads((out / MANIFEST).read_text())["content_hash"]
    return got
