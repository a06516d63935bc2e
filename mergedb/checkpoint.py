"""Finding checkpoints on disk: a Hugging-Face folder, a single file, or a folder of folders.

A checkpoint is a set of safetensors files plus side files (config, tokenizer) that are copied
through (sidefiles.py). The fingerprint (sizes, mtimes, header hashes) detects a file changed since it was seen.
A checkpoint may also be a URL (remote.py): its files are read through `sources`, and a remote
file's fingerprint uses its version (ETag or Last-Modified) where a local one uses its mtime. A
folder holding both model.safetensors and its index is read as model.safetensors, the file
transformers loads (see `open_checkpoint`). A checkpoint without a single tensor is refused.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import jsondoc, remote
from .errors import ChangedFileError, FormatError, MergeDBError
from .plainfile import file_kind, leads_inside, link_roots, read_small
from .remote import RemotePath
from .sources import LocalFile, RemoteFile, RemoteOptions, Sources
from .stray import refuse_loose_shards, refuse_output, refuse_stray_names, refuse_stray_weights
from .tensorfile import Header, TensorInfo, parse_header, read_header
from .units import utf8

if TYPE_CHECKING:
    from .manifest import ExecutionPlan

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# floating-point dtypes, for the `Checkpoint.dtype` label (what mergedb merges is tensorfile.FLOAT_DTYPES)
_FLOATING = frozenset("F16 BF16 F32 F64 F4 F6_E2M3 F6_E3M2 F8_E4M3 F8_E5M2 F8_E8M0 F8_E4M3FNUZ F8_E5M2FNUZ".split())


@dataclass(frozen=True)
class FileInfo:
    """One safetensors file of a checkpoint; `relpath` is relative to the checkpoint's folder."""

    relpath: str
    header: Header
    mtime_ns: int  # 0 for a remote file
    version: str = ""  # a remote file's ETag (else Last-Modified); "" for a local file

    @property
    def size(self) -> int:
        return self.header.file_size


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's files and tensors, as found on disk (nothing of the weights read yet)."""

    name: str
    path: Path | RemotePath  # what the user named: a model folder or a .safetensors file (or a URL)
    root: Path | RemotePath  # the folder holding the files (the file's parent for a single-file checkpoint)
    files: tuple[FileInfo, ...]
    tensors: tuple[tuple[int, TensorInfo], ...]  # (file index, tensor) in file order
    architecture: str | None
    vocab_size: int | None = None  # config.json's vocab_size (or text_config's), when it has one
    tied: bool | None = None  # config.json's tie_word_embeddings (or text_config's), when it says

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.files)

    @property
    def dtype(self) -> str:
        """A one-word label for the catalog: the floating-point dtype holding the most bytes (an FP8
        checkpoint with BF16 scales is F8_E4M3), else the dtype holding the most bytes; a tie goes
        to the name sorting last. Always one dtype name, never a 'mixed' marker."""
        counts: Counter[str] = Counter()
        for _, t in self.tensors:
            counts[t.dtype] += t.nbytes
        floats = [(n, d) for d, n in counts.items() if d in _FLOATING]
        return max(floats or [(n, d) for d, n in counts.items()], default=(0, ""))[1]


def fingerprint(files: tuple[FileInfo, ...] | list[FileInfo]) -> str:
    """SHA-256 over each file's relative path, size, mtime (a remote file's version) and header hash."""
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.relpath}\0{f.size}\0{f.version or f.mtime_ns}\0{f.header.sha256}\n".encode())
    return h.hexdigest()


def file_info(root: Path | RemotePath, relpath: str) -> FileInfo:
    if isinstance(root, RemotePath):
        return remote_file_info(root, relpath)
    path = root / relpath
    header = read_header(path)
    return FileInfo(relpath, header, os.stat(path).st_mtime_ns)


def gone(path: str | os.PathLike[str]) -> bool:
    """Whether nothing of a checkpoint is left at local `path`: no such path, or a folder without
    safetensors files (moved out one by one). One that cannot be looked at may come back: not gone."""
    try:
        if not stat.S_ISDIR(os.stat(path).st_mode):
            return False
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:  # permissions, a stale network mount
        return False
    return not any(n.endswith((".safetensors", ".safetensors.index.json")) for n in names)


def is_checkpoint(path: Path) -> bool:
    try:
        if path.is_file():
            return path.suffix == ".safetensors"
        return (path / INDEX).is_file() or (path / SINGLE).is_file()
    except PermissionError:  # a folder this user cannot look into: stray.py says so (or skips lost+found)
        return False


def open_checkpoint(path: str | os.PathLike[str], name: str | None = None) -> Checkpoint:
    """Read the headers of the checkpoint at `path` (a .safetensors file or a model folder, or a URL)."""
    if remote.is_url(path):
        return _open_remote(str(path), name)
    path = Path(path)
    if not utf8(str(path.absolute())):
        raise FormatError(
            f"{os.fsencode(path)!r}: this path is not valid UTF-8 (the catalog stores paths as text); rename it"
        )
    if path.is_file():
        if path.suffix != ".safetensors":
            raise FormatError(f"{path}: expected a .safetensors file or a model folder")
        root, relpaths = path.parent, [path.name]
        default_name = path.parent.name if path.name == SINGLE and path.parent.name else path.stem  # its model's
    elif (path / SINGLE).is_file():
        # With both model.safetensors and an index present, transformers loads model.safetensors and
        # never reads the index (modeling_utils._get_resolved_checkpoint_files tests SAFE_WEIGHTS_NAME
        # before SAFE_WEIGHTS_INDEX_NAME in a local folder), so that is the model this folder holds.
        root, relpaths = path, [SINGLE]
        default_name = path.name
    elif (path / INDEX).is_file():
        root, relpaths = path, _shards_from_index(path)
        default_name = path.name
    elif path.is_dir():
        raise FormatError(
            f"{path}: no {SINGLE} or {INDEX} in this folder; point at a model folder, a .safetensors file, "
            "or a folder of model folders"
        )
    elif os.path.exists(path):  # a named pipe, a device, a socket
        raise FormatError(f"{path}: is {file_kind(os.stat(path).st_mode)}; point at a .safetensors file or a folder")
    else:
        raise FormatError(f"{path}: no such file or folder")
    for rel in relpaths:
        if not utf8(rel):
            raise FormatError(
                f"{path}: shard {os.fsencode(rel)!r} has a name that is not valid UTF-8; rename it and its index entry"
            )
    files = tuple(file_info(root, rel) for rel in relpaths)
    if relpaths != [SINGLE] and (path / INDEX).is_file() and path.is_dir():
        weight_map = jsondoc.weight_map(read_small(path / INDEX), path / INDEX)
        return _assemble(name or default_name, path, root, files, weight_map, str(path / INDEX))
    return _assemble(name or default_name, path, root, files, None, "")


def _assemble(
    name: str,
    path: Path | RemotePath,
    root: Path | RemotePath,
    files: tuple[FileInfo, ...],
    weight_map: dict[str, str] | None,
    index: str,
) -> Checkpoint:
    """A checkpoint of `files`, refusing a tensor held twice, no tensor at all, or an index that
    does not describe the files."""
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
    if not tensors:
        raise FormatError(
            f"{path}: empty checkpoint: no tensors in {', '.join(f.relpath for f in files)}; "
            "point at a model that has weights"
        )
    if weight_map is not None:
        _check_index_covers(index, weight_map, files)
    return Checkpoint(name, path, root, files, tuple(tensors), *_config(root))


def _shards_from_index(folder: Path) -> list[str]:
    index_path = folder / INDEX
    try:
        raw = read_small(index_path)
    except OSError as e:
        raise FormatError(f"{index_path}: cannot be read ({e.strerror})") from None
    weight_map = jsondoc.weight_map(raw, index_path)
    roots = link_roots(folder)  # the folder, or a Hugging Face cache snapshot's own blobs/
    first: dict[str, str] = {}  # each shard, checked once (a 20k-tensor index names a few hundred shards), by
    spelled: dict[str, str] = {}  # one file named two ways (s1.safetensors, ./s1.safetensors) is one shard,
    for tensor, shard in weight_map.items():  # under its first spelling; by the first tensor that names it
        first.setdefault(spelled.setdefault(os.path.normpath(shard), shard), tensor)
    for shard, tensor in first.items():
        try:  # a missing shard resolves as far as it can; a link loop has no file at its end
            where = None if "\x00" in shard or os.path.isabs(shard) else (folder / shard).resolve()
        except RuntimeError:
            where = roots[0] / shard
        if where is None or not any(where.is_relative_to(r) for r in roots):
            raise FormatError(
                f"{index_path}: tensor {tensor!r} points to {shard!r}, outside the checkpoint folder; "
                "shards must be files inside the folder (or, in a Hugging Face cache, its blobs/)"
            )
        if not where.is_file():
            raise FormatError(f"{index_path}: tensor {tensor!r} points to missing shard {shard!r}")
    return sorted(first)


def _check_index_covers(index: str, weight_map: dict[str, str], files: tuple[FileInfo, ...]) -> None:
    for f in files:
        for t in f.header.tensors:
            where = weight_map.get(t.name)
            if where is None:
                raise FormatError(f"{index}: tensor {t.name!r} of {f.relpath} is missing from weight_map")
            if os.path.normpath(where) != os.path.normpath(f.relpath):
                raise FormatError(f"{index}: weight_map puts {t.name!r} in {where!r} but it is in {f.relpath}")
    present = {t.name for f in files for t in f.header.tensors}
    missing = [n for n in weight_map if n not in present]
    if missing:
        raise FormatError(f"{index}: tensors {missing[:5]} are in weight_map but in no shard")


def _config(root: Path | RemotePath) -> tuple[str | None, int | None, bool | None]:
    """The architecture, vocabulary size and tie_word_embeddings that config.json beside the weights
    names (all None without one; each None when it does not say). A config.json that links out of the
    folder (see plainfile.link_roots) is not read: it counts as none, as it does for the side files."""
    local = remote.local_path(root) if isinstance(root, RemotePath) else root
    if local is not None and os.path.lexists(Path(local) / "config.json"):
        if not leads_inside(Path(local) / "config.json", link_roots(local)):
            return None, None, None
    try:
        if isinstance(root, RemotePath):
            raw = remote.read_small((root / "config.json").url)
            text = "" if raw is None else raw.decode()
        else:
            text = read_small(root / "config.json").decode()
        cfg = jsondoc.parse(text)
        if not isinstance(cfg, dict):
            return None, None, None
    except (OSError, ValueError):
        return None, None, None
    archs = cfg.get("architectures")
    arch = str(archs[0]) if isinstance(archs, list) and archs else None
    arch = arch if arch is None or utf8(arch) else None  # a lone surrogate ("\ud800"): no architecture
    vocab, tied = cfg.get("vocab_size"), cfg.get("tie_word_embeddings")
    if isinstance(cfg.get("text_config"), dict):  # multimodal configs nest the LM's
        vocab = cfg["text_config"].get("vocab_size") if vocab is None else vocab
        tied = cfg["text_config"].get("tie_word_embeddings") if tied is None else tied
    vocab = vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else None
    return arch, vocab, tied if isinstance(tied, bool) else None


def discover(paths: list[str | os.PathLike[str]]) -> list[Path | RemotePath]:
    """Checkpoint locations under `paths`: each path is a checkpoint or a folder of checkpoints."""
    found: list[Path | RemotePath] = []
    for q in paths:
        if remote.is_url(q):
            found.extend(_discover_remote(str(q)))
            continue
        p = Path(q)
        if is_checkpoint(p):
            found.append(p)
        elif p.is_dir():
            refuse_loose_shards(p, sorted(os.listdir(p)))
            subs = []
            for c in sorted(p.iterdir()):
                if is_checkpoint(c):
                    refuse_output(c)
                    subs.append(c)
                else:
                    refuse_stray_weights(c)  # weights it would skip, silently before
            if not subs:
                raise FormatError(
                    f"{p}: holds no checkpoint ({SINGLE}, {INDEX} or .safetensors files in it or its subfolders)"
                )
            found.extend(subs)
        elif p.is_file() and p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".gguf"):
            raise FormatError(f"{p}: weights mergedb does not read (pickled or GGUF): save them as safetensors")
        elif p.exists():  # a config.json named by mistake: it is there, just not a checkpoint
            raise FormatError(f"{p}: not a checkpoint; give a .safetensors file or a model folder")
        else:
            raise FormatError(f"{p}: no such file or folder")
    return found


def remote_file_info(root: RemotePath, relpath: str) -> FileInfo:
    """A remote file's header (two ranged reads: the length, then the JSON) and version."""
    url = (root / relpath).url
    st = remote.stat(url)
    if st is None:
        raise FormatError(f"{url}: no such file")
    header = parse_header(lambda n, off: remote.read_bytes(url, off, min(off + n, st.size)), url, st.size)
    return FileInfo(relpath, header, 0, st.version)


def _open_remote(url: str, name: str | None) -> Checkpoint:
    loc = remote.locate(url, SINGLE, INDEX)
    if loc is None:
        raise FormatError(
            f"{url}: no {SINGLE} or {INDEX} there; point at a model folder, a .safetensors file or an index "
            "URL (over HTTP(S) name the file or the index: folders cannot be listed)"
        )
    files = tuple(remote_file_info(loc.root, rel) for rel in loc.relpaths)
    index = str(loc.root / INDEX) if loc.weight_map is not None else ""
    return _assemble(name or loc.name, loc.path, loc.root, files, loc.weight_map, index)


def _discover_remote(url: str) -> list[RemotePath]:
    if remote.locate(url, SINGLE, INDEX) is not None:
        return [remote.check_url(url)]
    folder = remote.check_url(url)
    names = remote.listdir(folder.url)
    if names is None:
        raise FormatError(
            f"{url}: no {SINGLE} or {INDEX} there, and this filesystem cannot list folders; name the "
            ".safetensors file or the index URL"
        )
    refuse_loose_shards(folder, names)
    subs = [folder / n for n in names if remote.locate((folder / n).url, SINGLE, INDEX) is not None]
    for n in remote.listdir(folder.url, folders=True) or []:  # weights it would skip, silently before
        if folder / n not in subs:
            refuse_stray_names(folder / n, remote.listdir((folder / n).url) or [])
    if not subs:
        raise FormatError(
            f"{url}: holds no checkpoint ({SINGLE}, {INDEX} or .safetensors files in it or its subfolders)"
        )
    return subs


def refuse_changed(src: Any, fingerprint: str) -> None:
    """Refuse a plan's input (a manifest.Source) whose files, opened now, have another `fingerprint`
    than when it was registered: a merge of them would not be the plan's."""
    if fingerprint != src.fingerprint:
        raise ChangedFileError(
            f"{src.name} ({src.path}) changed since it was registered (its files' sizes, times or headers); "
            "re-register it with `mergedb register --refresh` and plan again (a replay needs the files as "
            "they were: a copy keeps their times with cp -p)"
        )


class PlanInputs:
    """Open files of every source of an execution plan, checked against their fingerprints and the
    plan's tensor layout (the merger reads through them; `close` when done). `where[i][tensor]` is
    (byte source, tensor, file path or URL) of source i (0: the base, then the experts). Expert
    positions in `skip` (LoRA adapters, opened by loramerge.LoraInputs) get an empty `where`."""

    def __init__(
        self,
        xp: ExecutionPlan,
        skip: frozenset[int] = frozenset(),
        options: RemoteOptions | None = None,
        pool: Executor | None = None,
    ) -> None:
        self.sources = Sources(options, pool)
        self.where: list[dict[str, tuple[LocalFile | RemoteFile, TensorInfo, str]]] = []
        self.skip = skip
        try:
            self._open(xp)
        except BaseException:  # a refused source: close the files opened before it
            self.close()
            raise

    def _open(self, xp: ExecutionPlan) -> None:
        for i, src in enumerate((xp.base, *xp.experts)):
            if i - 1 in self.skip:
                self.where.append({})
                continue
            if not remote.is_url(src.path) and gone(src.path):  # replay and stale plans alike
                raise ChangedFileError(
                    f"{src.name} is gone from {src.path}, where its plan or manifest found it: restore it there"
                )
            try:
                ckpt = open_checkpoint(src.path, name=src.name)
            except FormatError as e:
                if not remote.is_url(src.path):
                    raise
                raise ChangedFileError(  # not registration's "point at a model folder": it was one
                    f"{src.name} is no longer readable at {src.path}, where its plan or manifest found it ({e}); "
                    "restore it there, or register it where it is now with `mergedb register --refresh`"
                ) from None
            refuse_changed(src, ckpt.fingerprint)
            # experts: no kernel readahead past the ranges we ask for
            srcs = [self.sources.open(ckpt.root / f.relpath, random=i > 0) for f in ckpt.files]
            paths = [str(ckpt.root / f.relpath) for f in ckpt.files]  # one string per file, not per tensor
            where = {t.name: (srcs[fi], t, paths[fi]) for fi, t in ckpt.tensors}
            self.where.append(where)
            for t in xp.tensors:  # the plan's sizes come from the files, never from the plan alone
                info = where.get(t.name)
                if (i == 0 or t.mergeable) and (info is None or info[1].dtype != t.dtype or info[1].shape != t.shape):
                    have = f"{info[1].dtype}{list(info[1].shape)}" if info else "nothing"
                    raise ChangedFileError(
                        f"{src.path}: the plan describes tensor {t.name!r} as {t.dtype}{list(t.shape)} but the "
                        f"file holds {have}; the plan or manifest does not describe these files: plan again"
                    )

    @property
    def fetched(self) -> int:
        """Bytes fetched from remote files so far (0 when every source is local)."""
        return self.sources.fetched

    def close(self) -> None:
        self.sources.close()


def file_times(inputs: Iterable[tuple[str, str]]) -> dict[tuple[str, str], tuple[int, int] | None]:
    """(size, mtime_ns) of each local (name, path) input's files, by (name, file): a checkpoint's
    file, or the .safetensors and .json files of its folder and the shards its index names (remote
    paths are skipped). A stat, not a header read: taken before and after a merge it costs
    microseconds per file, where a fingerprint parses the whole header (~20 ms for 5,000 tensors)."""
    out: dict[tuple[str, str], tuple[int, int] | None] = {}
    for name, path in inputs:
        if "://" in path:
            continue
        p = Path(path)
        try:
            files = [p] if p.is_file() else [f for f in p.iterdir() if f.suffix in (".safetensors", ".json")]
            for index in (f for f in files if f.name.endswith(".index.json")):
                files += [p / s for s in set(jsondoc.weight_map(read_small(index), index).values())]
            for f in files:
                st = f.stat()
                out[(name, str(f))] = (st.st_size, st.st_mtime_ns)
        except (OSError, MergeDBError):
            out[(name, path)] = None
    return out
