"""Independent reference computations for the tests: whole tensors in memory, textbook formulas.

Loads checkpoints with the safetensors library itself (not mergedb's reader) and computes every
statistic the obvious way with numpy/torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.torch import load_file


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
