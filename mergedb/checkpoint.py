"""Finding checkpoints on disk: a Hugging-Face folder, a single file, or a folder of folders.

A checkpoint is a set of safetensors files plus side files (config, tokenizer) that are copied
through. The fingerprint (sizes, mtimes, header hashes) detects a file changed since it was seen.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .errors import FormatError
from .tensorfile import Header, TensorInfo, read_header

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass(frozen=True)
class FileInfo:
    """One safetensors file of a checkpoint; `relpath` is relative to the checkpoint's folder."""

    relpath: str
    header: Header
    mtime_ns: int

    @property
    def size(self) -> int:
        return self.header.file_size


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's files and tensors, as found on disk (nothing of the weights read yet)."""

    name: str
    path: Path  # what the user named: a model folder or a .safetensors file
    root: Path  # the folder holding the files (the file's parent for a single-file checkpoint)
    files: tuple[FileInfo, ...]
    tensors: tuple[tuple[int, TensorInfo], ...]  # (file index, tensor) in file order
    architecture: str | None

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.files)

    @property
    def dtype(self) -> str:
        """The dtype holding most of the float bytes ('mixed' never occurs in practice for LLMs)."""
        counts: Counter[str] = Counter()
        for _, t in self.tensors:
            counts[t.dtype] += t.nbytes
        floats = [(n, d) for d, n in counts.items() if d in ("BF16", "F16", "F32", "F64")]
        return max(floats)[1] if floats else (max((n, d) for d, n in counts.items())[1] if counts else "")


def fingerprint(files: tuple[FileInfo, ...] | list[FileInfo]) -> str:
    """SHA-256 over each file's relative path, size, mtime and header hash."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relpath}\0{f.size}\0{f.mtime_ns}\0{f.header.sha256}\n".encode())
    return h.hexdigest()


def file_info(root: Path, relpath: str) -> FileInfo:
    path = root / relpath
    header = read_header(path)
    return FileInfo(relpath, header, os.stat(path).st_mtime_ns)


def is_checkpoint(path: Path) -> bool:
    if path.is_file():
        return path.suffix == ".safetensors"
    return (path / INDEX).is_file() or (path / SINGLE).is_file()


def open_checkpoint(path: str | os.PathLike[str], name: str | None = None) -> Checkpoint:
    """Read the headers of the checkpoint at `path` (a .safetensors file or a model folder)."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise FormatError(f"{path}: expected a .safetensors file or a model folder")
        root, relpaths = path.parent, [path.name]
        default_name = path.stem
    elif (path / INDEX).is_file():
        root, relpaths = path, _shards_from_index(path)
        default_name = path.name
    elif (path / SINGLE).is_file():
        root, relpaths = path, [SINGLE]
        default_name = path.name
    elif path.is_dir():
        raise FormatError(
            f"{path}: no {SINGLE} or {INDEX} in this folder; point at a model folder, a .safetensors file, "
            "or a folder of model folders"
        )
    else:
        raise FormatError(f"{path}: no such file or folder")
    files = tuple(file_info(root, rel) for rel in relpaths)
    tensors: list[tuple[int, TensorInfo]] = []
    seen: dict[str, str] = {}
    for i, f in enumerate(files):
        for t in f.header.tensors:
            if t.name in seen:
                raise FormatError(
                    f"{path}: tensor {t.name!r} appears in both {seen[t.name]} and {f.relpath}; remove one copy"
                )
            seen[t.name] = f.relpath
            tensors.append((i, t))
    if (path / INDEX).is_file() and path.is_dir():
        _check_index_covers(path, files)
    return Checkpoint(name or default_name, path, root, files, tuple(tensors), _architecture(root))


def _shards_from_index(folder: Path) -> list[str]:
    index_path = folder / INDEX
    try:
        doc = json.loads(index_path.read_text())
        weight_map = doc["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise FormatError(f"{index_path}: not a valid index (expected JSON with a 'weight_map' object)") from None
    root = folder.resolve()
    shards: list[str] = []
    for tensor, shard in weight_map.items():
        if "\x00" in shard or os.path.isabs(shard) or not (folder / shard).resolve().is_relative_to(root):
            raise FormatError(
                f"{index_path}: tensor {tensor!r} points to {shard!r}, outside the checkpoint folder; "
                "shards must be files inside the folder"
            )
        if not (folder / shard).resolve().is_file():
            raise FormatError(f"{index_path}: tensor {tensor!r} points to missing shard {shard!r}")
        if shard not in shards:
            shards.append(shard)
    return sorted(shards)


def _check_index_covers(folder: Path, files: tuple[FileInfo, ...]) -> None:
    weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
    for f in files:
        for t in f.header.tensors:
            where = weight_map.get(t.name)
            if where is None:
                raise FormatError(f"{folder / INDEX}: tensor {t.name!r} of {f.relpath} is missing from weight_map")
            if os.path.normpath(where) != os.path.normpath(f.relpath):
                raise FormatError(f"{folder / INDEX}: weight_map puts {t.name!r} in {where!r} but it is in {f.relpath}")
    present = {t.name for f in files for t in f.header.tensors}
    missing = [n for n in weight_map if n not in present]
    if missing:
        raise FormatError(f"{folder / INDEX}: tensors {missing[:5]} are in weight_map but in no shard")


def _architecture(root: Path) -> str | None:
    try:
        archs = json.loads((root / "config.json").read_text()).get("architectures")
        return str(archs[0]) if archs else None
    except (OSError, ValueError, AttributeError, IndexError, TypeError):
        return None


def discover(paths: list[str | os.PathLike[str]]) -> list[Path]:
    """Checkpoint locations under `paths`: each path is a checkpoint or a folder of checkpoints."""
    found: list[Path] = []
    for p in map(Path, paths):
        if is_checkpoint(p):
            found.append(p)
        elif p.is_dir():
            subs = sorted(c for c in p.iterdir() if is_checkpoint(c))
            if not subs:
                raise FormatError(
                    f"{p}: holds no checkpoint ({SINGLE}, {INDEX} or .safetensors files in it or its subfolders)"
                )
            found.extend(subs)
        else:
            raise FormatError(f"{p}: no such file or folder")
    return found


def side_files(root: Path) -> list[str]:
    """Files copied through to a merged model: config, generation config, tokenizer files."""
    skip = {INDEX}
    return sorted(
        p.name
        for p in root.iterdir()
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in skip and not p.name.startswith(".")
    )
