"""Output folders: where a merged model may be written, one writer at a time, and how it is put in
place so that a crash at any point leaves the old output or the new one, never a mix, and never
loses a file mergedb did not create.

The executor builds the new output in `.OUT.mergedb-tmp-PID-XXXX` beside `out` while holding
`.OUT.mergedb-lock` (an flock: a second run into the same `out` fails at once, naming the first);
`install` then renames the folder into place, or, over an old output (--force), swaps the files
mergedb made one by one, manifest out first and in last, so `out` itself never moves and the
user's own files in it (notes, eval results) are never carried anywhere. `remove_stale` (run under
the lock) finishes or undoes what a killed run left. `--force` replaces only the files the old
manifest lists that still are as mergedb wrote them (`_edited`).

This module is long because the swap, its undoing after a crash and the rules for which files are
mergedb's must be read together: each relies on the others' invariants.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import fcntl
import numbers
import os
import re
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import jsondoc, remote
from .checkpoint import INDEX
from .errors import MergeDBError
from .manifest import MANIFEST, MASK
from .plainfile import read_small
from .sidefiles import TEMPLATES, is_side_name
from .units import shown

# Names beside `out` (in its parent folder) that mergedb makes while writing it:
#   .OUT.mergedb-lock           held (flock) for the whole run: one writer per output at a time
#   .OUT.mergedb-tmp-PID-XXXX   the new output, built there; holds only files mergedb writes
#   .OUT.mergedb-old-PID-XXXX   during a --force swap, the old output's own files (same PID-XXXX)
TMP, OLD, LOCK = ".mergedb-tmp-", ".mergedb-old-", ".mergedb-lock"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # an --as-lora output's (loraout.py)
_OUR_NAME = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
# the option that named the output folder, for messages: a model's --out, an adapter's --as-lora
_FLAG: contextvars.ContextVar[str] = contextvars.ContextVar("mergedb_out_flag", default="--out")


@contextmanager
def named(flag: str) -> Iterator[None]:
    """Messages about the output folder name it as `flag` (e.g. "--as-lora") within this block."""
    token = _FLAG.set(flag)
    try:
        yield
    finally:
        _FLAG.reset(token)


def check_out_arg(out: object, who: str) -> None:
    """Refuse, before anything is read, an output folder argument that is not a path (`who` calls it)."""
    if not isinstance(out, (str, os.PathLike)):
        raise MergeDBError(f"{who} writes into a folder path (str or Path), got {type(out).__name__}")
    if "\x00" in os.fsdecode(out):  # os calls raise a bare ValueError for it
        raise MergeDBError(f"{who} writes into a folder path, got {os.fsdecode(out)!r}, which holds a NUL byte")
    if isinstance(out, str) and not out.strip():  # Path("") is the current folder
        raise MergeDBError(f"{who} writes into a folder path, got an empty one; name the output folder")


def check_run_args(who: str, out: Any, max_shard_size: Any, flags: dict[str, Any], calls: dict[str, Any]) -> None:
    """Refuse, before anything is read, an argument of the wrong type to `who` (execute(), replay()):
    a str flag such as "no" would be taken as true, a negative shard size would be recorded, a
    non-callable progress would fail mid-merge."""
    check_out_arg(out, who)
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, numbers.Integral) or max_shard_size < 0:
        raise MergeDBError(f"max_shard_size is a whole number of bytes ≥ 0, got {shown(max_shard_size)}")
    for k, v in flags.items():
        if not isinstance(v, bool):
            raise MergeDBError(f"{who} {k} is True or False, got {shown(v)}")
    for k, v in calls.items():
        if v is not None and not callable(v):
            raise MergeDBError(f"{who} {k} is a function or None, got {type(v).__name__}")


def _shown(p: Path | str) -> str:
    """A path for a message: names that are not valid UTF-8 are shown with \\x escapes."""
    return os.fsencode(p).decode("utf-8", "backslashreplace")


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:/")  # scheme:// (its // made one / by Path)


def resolve_out(out: Path) -> Path:
    """`out` as an absolute path with its parents' links resolved, after refusing what mergedb
    cannot safely write or replace: a symlink (a swap would move files out of its target), the
    current folder or one holding it (it cannot be replaced while in use), a name not in UTF-8, a URL."""
    if _URL.match(os.fspath(out)):  # s3://b/x as a Path is s3:/b/x: a folder "s3:" here, not the bucket
        raise MergeDBError(
            f"{_FLAG.get()} {out}: outputs are written to a folder on this machine or a shared file system, not "
            "to a URL; write it to a folder and upload that (e.g. aws s3 cp --recursive), or, for a folder of this "
            f"name here, give its absolute path ({Path.cwd() / out})"
        )
    try:
        os.fspath(out).encode("utf-8")
    except UnicodeEncodeError:
        raise MergeDBError(
            f"{_FLAG.get()} {_shown(out)} is not valid UTF-8 (the catalog and manifest store text); choose a UTF-8 name"
        ) from None
    try:
        link = out.is_symlink()
        real = _resolved(out)
    except OSError as e:  # e.g. a name longer than the file system allows
        raise MergeDBError(f"{_FLAG.get()} {out}: {os_advice(e, out)}") from None
    if link:
        raise MergeDBError(
            f"{_FLAG.get()} {out} is a symbolic link (to {os.readlink(out)}); mergedb writes only real folders: "
            f"pass the link's target, or another {_FLAG.get()}"
        )
    try:
        cwd = Path.cwd().resolve()
    except OSError:
        cwd = None
    if cwd is not None and (real == cwd or real in cwd.parents):
        raise MergeDBError(
            f"{_FLAG.get()} {out} is the current folder or holds it ({real}); pass a new subfolder, "
            f"e.g. {_FLAG.get()} ./merged"
        )
    return real


def check_clear_of(out: Path, paths: list[Any], what: str) -> None:
    """Refuse an `out` that is, holds, or lies inside any of `paths` (checkpoint files or folders,
    local or file:// URLs; other URLs are skipped): writing there would overwrite or swap away the
    files a merge reads."""
    real = _resolved(Path(out))
    for src in sorted(set(_with_link_targets(paths))):
        if real == src or src.is_relative_to(real) or real.is_relative_to(src):
            raise MergeDBError(
                f"{_FLAG.get()} {out} overlaps {src}, {what}; mergedb never writes into, over or around a "
                f"checkpoint it reads: choose an {_FLAG.get()} outside it"
            )


def _resolved(out: Path) -> Path:
    """`out` resolved; a loop of symbolic links on its way is refused by name (Python before 3.13
    raises RuntimeError for it, which no caller expected)."""
    try:
        return out.resolve()
    except RuntimeError:
        raise MergeDBError(
            f"{_FLAG.get()} {out} passes through a loop of symbolic links; fix the links or choose another "
            f"{_FLAG.get()}"
        ) from None


def _with_link_targets(paths: list[Any]) -> Iterator[Path]:
    """Each path resolved, and for a folder, where the links among its files lead: a checkpoint
    folder may hold links to files elsewhere (a Hugging Face cache's snapshot, a hand-made family),
    and an output there would overwrite what they point at."""
    for p in map(str, paths):
        if remote.is_url(p):  # a checkpoint registered as file:///… is on this disk too
            local = remote.local_path(p)
            if local is None:
                continue
            p = local
        try:
            yield Path(p).resolve()
            entries = list(os.scandir(p)) if os.path.isdir(p) else []
        except (OSError, RuntimeError):  # unlistable, or a loop of links (nothing can lie under one)
            continue
        for e in entries:
            if e.is_symlink():
                with contextlib.suppress(RuntimeError):  # a link in a loop leads nowhere
                    yield Path(e.path).resolve()


@contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive flock on `.OUT.mergedb-lock` beside `out` for the whole run, so two runs
    into one output cannot both install (the second fails at once, naming the first). The file is
    removed on release; a lock taken on a file unlinked meanwhile is retried on the new one. The
    folders made to hold `out` are removed again on release while empty (a run that failed)."""
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]  # deepest first
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MergeDBError(f"cannot create {out.parent}: {os_advice(e, out)}") from None
    path = out.parent / f".{out.name}{LOCK}"
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise MergeDBError(f"cannot write {out}: {os_advice(e, out)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise MergeDBError(
                f"another mergedb (process {holder}) is writing {out} now; wait for it to finish, or choose "
                f"another {_FLAG.get()}"
            ) from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # its holder removed that file as we opened it: lock the current one
    try:
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:  # a full disk: the lock file could be made, its one line not written
            raise MergeDBError(f"cannot write {out}: {os_advice(e, out)}") from None
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)
        for folder in made:  # rmdir: only while empty, so never one holding the output or anything else
            with contextlib.suppress(OSError):
                folder.rmdir()


def writer(out: Path) -> int | None:
    """The process writing `out` now (output_lock's pid, while that process lives and the lock is held),
    or None. Read without taking the lock: a lock taken only to test it would make the writer's own
    attempt fail."""
    try:
        pid = int(read_small(out.parent / f".{out.name}{LOCK}").strip() or 0)
    except (OSError, ValueError):
        return None
    if pid <= 0 or pid == os.getpid():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:  # a killed run's lock file: the next run into `out` removes it
        return None
    except PermissionError:  # alive, another user's
        pass
    held = _flock_held(out.parent / f".{out.name}{LOCK}")
    return None if held is False else pid  # a live pid over a lock nobody holds: a killed run's, pid reused


def _flock_held(path: Path) -> bool | None:
    """Whether someone holds a flock on `path`, from /proc/locks (which takes no lock); None where the
    kernel does not say (no /proc)."""
    try:
        st = os.stat(path)
    except OSError:  # gone meanwhile: released
        return False
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any("FLOCK" in line.split() and want in line.split() for line in text.splitlines())


def os_advice(e: OSError, out: Path) -> str:
    """An OSError's reason and what fixes it."""
    why = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{why}; nothing was left behind, free space and retry"
    if e.errno == errno.EFBIG:  # a file size limit (ulimit -f), or a file system's largest file
        return f"{why}; nothing was left behind, free space or raise the file size limit (ulimit -f) and retry"
    if e.errno == errno.ENAMETOOLONG:
        return (
            f"{why}: mergedb first writes it beside, as .NAME{TMP}PID-XXXXXXXX (about 30 characters "
            f"longer); nothing was left behind, choose a shorter {_FLAG.get()} name"
        )
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return (
            f"{why}; nothing was left behind: choose an {_FLAG.get()} in a folder you can write ({out.parent} is not)"
        )
    return f"{why}; nothing was left behind, fix the cause and retry"


def temp_folder(out: Path) -> Path:
    """Where a run builds `out`: `.OUT.mergedb-tmp-PID-XXXX` beside it (not yet made)."""
    return out.parent / f".{out.name}{TMP}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _left_beside(out: Path, kind: str) -> list[Path]:
    """The `.OUT{kind}PID-XXXX` folders beside `out` (kind TMP or OLD), matched by their exact form:
    an `out` whose name holds glob characters (`merged[1]`) or begins another output's name never
    claims that output's folders."""
    form = re.compile(rf"\.{re.escape(out.name)}{re.escape(kind)}\d+-[0-9a-f]+")
    return sorted(p for p in out.parent.iterdir() if form.fullmatch(p.name))


def _partner(out: Path, folder: Path, kind: str) -> Path:
    """The TMP folder of an OLD one, or the OLD of a TMP: the same PID-XXXX, beside `out`."""
    tag = folder.name[len(f".{out.name}") + len(TMP if kind == OLD else OLD) :]
    return out.parent / f".{out.name}{kind}{tag}"


def remove_stale(out: Path) -> None:
    """Finish what killed runs left for `out` (called under its lock, so no live run owns any of it).

    A `.OUT.mergedb-tmp-*` folder only ever holds files mergedb wrote: it is deleted. A
    `.OUT.mergedb-old-*` folder holds only the old output's own files; if the swap was cut before
    the new manifest was in place (`out` has none), the old files go back, manifest last, and the
    new files that had moved in (listed by the new manifest, gone from the temporary folder) are
    removed. Nothing else in `out` is touched: files mergedb did not create never move."""
    if not out.parent.is_dir():
        return
    for old in _left_beside(out, OLD):
        _undo_swap(out, old, _partner(out, old, TMP))
    for tmp in _left_beside(out, TMP):
        _remove_ours(tmp)


_LEFT = re.compile(rf"\.(.+)(?:{re.escape(TMP)}|{re.escape(OLD)})\d+-[0-9a-f]+")


def remove_stale_in(folder: Path) -> None:
    """Finish what killed runs left for every output in `folder` (a sweep's --out: a rerun writes
    outputs of new names, so no run into the old names would ever clean their temporary folders up).
    Each output is cleaned under its own lock; one that another run holds is live and left alone."""
    try:
        names = sorted({m.group(1) for p in folder.iterdir() if (m := _LEFT.fullmatch(p.name))})
    except OSError:  # not made yet, or not a folder: nothing was left there
        return
    for name in names:
        try:
            with output_lock(folder / name):
                remove_stale(folder / name)
        except MergeDBError:  # another mergedb writes it now (or it cannot be locked): not ours to touch
            continue


def _undo_swap(out: Path, old: Path, tmp: Path) -> None:
    """Finish or undo a --force swap between `out`, its old files in `old` and the new ones in `tmp`:
    cut before the new manifest was in place, the old output comes back whole; then `old` goes.
    An `out` someone removed since (it looked broken, holding no manifest) comes back only if `old`
    holds the whole old output; a part of one is removed with `old`, never installed as if whole."""
    if not out.exists() and not out.is_symlink():
        listed = _listed_files(old)
        if listed and all((old / n).exists() for n in listed):
            os.rename(old, out)
            fsync_dir(out.parent, files=False)
    elif (old / MANIFEST).is_file() and not (out / MANIFEST).exists():
        kept = {p.name for p in old.iterdir()}
        # the old output's names: its manifest's, not only those still in `old`: a recovery cut short
        # has moved some back already, and those are the old output's files, not the new one's
        for name in _listed_files(tmp) - _listed_files(old) - kept - {MANIFEST}:
            if not (tmp / name).exists():  # it had moved in, and the old output has no such file
                if _templates(out / name):
                    _remove_ours(out / name)
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(out / name)
        for name in sorted(kept - {MANIFEST}):
            if _templates(out / name):  # the new output's, moved in: a rename does not replace a full folder
                _remove_ours(out / name)
            os.replace(old / name, out / name)
        os.replace(old / MANIFEST, out / MANIFEST)
    _remove_ours(old)


def file_stats(tmp: Path) -> dict[str, list[int]]:
    """[size, mtime_ns] of each file written into `tmp` (a chat template by its path in the templates'
    folder), for the manifest's run part: `--force` replaces only files that still have them (`_edited`)."""
    stats: dict[str, list[int]] = {}
    for p in sorted(tmp.iterdir()):
        for q in sorted(p.iterdir()) if _templates(p) else [p]:
            if q.is_file() and not q.is_symlink():
                st = q.stat()
                stats[str(q.relative_to(tmp))] = [st.st_size, st.st_mtime_ns]
    return stats


def _edited(out: Path, names: set[str]) -> list[str]:
    """The files among `names` (the output's own, by its manifest) whose size or time differ from what
    its run.file_stats recorded when mergedb wrote them: rewritten since (save_pretrained over an output,
    an editor), so the user's, never replaced or deleted. Outputs from before file_stats: none."""
    try:
        stats = jsondoc.parse(read_small(out / MANIFEST))["run"]["file_stats"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    bad = []
    for name, rec in stats.items() if isinstance(stats, dict) else ():
        parts = name.split("/")
        if parts[0] not in names or len(parts) > 2 or ".." in parts:
            continue
        try:
            st = os.lstat(out / name)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or [st.st_size, st.st_mtime_ns] != rec:
            bad.append(name)
    return sorted(bad)


def _refuse_edited(out: Path, names: set[str]) -> None:
    edited = _edited(out, names)
    if edited:
        what = (
            "is a symbolic link, not the file mergedb wrote there"
            if (out / edited[0]).is_symlink()
            else "was changed since mergedb wrote it (its size or time differ from the manifest's record: e.g. "
            "save_pretrained over the output)"
        )
        raise MergeDBError(
            f"{out / edited[0]} {what}, so it is yours and --force does not replace it; nothing was installed: "
            f"move it away (or choose another {_FLAG.get()}) and retry"
        )


def _listed_files(folder: Path) -> set[str]:
    """Names the manifest in `folder` lists as mergedb's (run.files), restricted to names mergedb
    writes (shards, index, mask, manifest, the base's side files); empty when none is readable."""
    try:
        files = jsondoc.parse(read_small(folder / MANIFEST))["run"]["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    if not isinstance(files, list):
        return set()
    return {f for f in files if ours(f)}


def ours(name: object) -> bool:
    """Whether `name` is one mergedb writes into an output: shards, index, mask, manifest, an
    adapter's files, the base's side files and its folder of chat templates (never a path: run.files is
    outside the content hash)."""
    return isinstance(name, str) and (
        name in (INDEX, MASK, MANIFEST, *ADAPTER_FILES, TEMPLATES)
        or ("/" not in name and is_side_name(name))
        or bool(_OUR_NAME.fullmatch(name))
    )


def _not_our_templates(out: Path) -> list[str]:
    """What `out`'s additional_chat_templates/ holds besides the templates its manifest's side files
    list (as regular files): a user's, never moved or deleted."""
    try:
        side = jsondoc.parse(read_small(out / MANIFEST))["run"]["side_files"]
    except (OSError, ValueError, KeyError, TypeError):
        side = {}
    listed = side if isinstance(side, dict) else {}
    return [
        f"{TEMPLATES}/{n}"
        for n in sorted(os.listdir(out / TEMPLATES))
        if f"{TEMPLATES}/{n}" not in listed or not (out / TEMPLATES / n).is_file() or (out / TEMPLATES / n).is_symlink()
    ]


def _templates(p: Path) -> bool:
    """Whether `p` is an output's folder of named chat templates (a real folder, not a link to one)."""
    return p.name == TEMPLATES and p.is_dir() and not p.is_symlink()


def _remove_ours(folder: Path) -> None:
    """Delete a temporary or old folder mergedb made (only its regular files and its chat templates'
    folder; a folder found holding anything else is left alone)."""
    with contextlib.suppress(FileNotFoundError):
        for p in folder.iterdir():
            if _templates(p):
                _remove_ours(p)
            elif p.is_file() and not p.is_symlink():
                p.unlink()
        with contextlib.suppress(OSError):
            folder.rmdir()


def check_out(out: Path, force: bool, advice: str | None = None) -> None:
    """Refuse an output folder that a merge cannot be installed into: a mount point, a file, or a
    folder that holds something (unless `force` and it is a mergedb output). `advice` replaces the
    fix that a refused non-empty folder is given (a sweep has no --force)."""
    if out.is_dir() and os.path.ismount(out):  # before the merge: `install` renames a folder into place
        raise MergeDBError(
            f"{_FLAG.get()} {out} is a mount point, which a finished output cannot be renamed over; pass a new "
            f"folder inside it, e.g. {_FLAG.get()} {out / 'merged'}"
        )
    if out.exists() and not out.is_dir():
        raise MergeDBError(f"{_FLAG.get()} {out} is a file, not a folder; choose another {_FLAG.get()}")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise MergeDBError(
                f"{out} exists and is not empty; "
                + (advice or f"choose another {_FLAG.get()} or pass --force to replace a previous mergedb output")
            )
        if not (out / MANIFEST).is_file():
            raise MergeDBError(
                f"{out} holds files mergedb did not create (no {MANIFEST}); refusing to touch it "
                f"even with --force; choose another {_FLAG.get()}"
            )
        try:  # its run.files say which files --force may replace: unreadable, the merge could not be installed
            doc = jsondoc.parse(read_small(out / MANIFEST))
        except (OSError, ValueError) as e:
            raise MergeDBError(
                f"{out / MANIFEST} cannot be read ({e}), so which files of {out} are mergedb's is unknown; refusing "
                f"to touch it even with --force: restore that file, or choose another {_FLAG.get()}"
            ) from None
        if not isinstance(doc, dict):
            raise MergeDBError(
                f"{out / MANIFEST} is not a mergedb manifest (not a JSON object); refusing to touch {out} even "
                f"with --force: restore that file, or choose another {_FLAG.get()}"
            )
        _refuse_edited(out, _listed_files(out))


def install(tmp: Path, out: Path, force: bool = False) -> None:
    """Put the finished output in place.

    Into a new or empty folder: one rename. Over an old mergedb output (--force), file by file, so
    that `out` never moves and files mergedb did not create never leave it: (1) the old manifest
    moves to `.OUT.mergedb-old-…` (from here `out` no longer looks complete), (2) the old output's
    own files (its manifest's run.files) follow it, (3) the new files move in, (4) the new manifest
    last, (5) the old folder is deleted. A crash anywhere is undone or finished by the next run
    (`remove_stale`). `out` checked before the merge (check_out) may have been filled since, by a
    program other than mergedb (another mergedb waits on the lock): then nothing is installed."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        was = out.stat() if out.exists() else None
        os.rename(tmp, out)  # replaces an empty folder too: it keeps that folder's mode and owner
        if was is not None:
            os.chmod(out, stat.S_IMODE(was.st_mode))
            with contextlib.suppress(OSError):  # only root or the owner may; the mode is what matters
                os.chown(out, was.st_uid, was.st_gid)
        fsync_dir(out.parent, files=False)  # the rename itself, durable before the run is recorded as done
        return
    if not force or not (out / MANIFEST).is_file():
        held = ", ".join(sorted(p.name for p in out.iterdir())[:3])
        raise MergeDBError(
            f"{_FLAG.get()} {out} was filled by another program while the merge ran (it now holds {held}); "
            f"nothing was installed and its files are untouched: choose another {_FLAG.get()}, or empty it and retry"
        )
    ours = _listed_files(out) | {MANIFEST}
    ours = {n for n in ours if ((out / n).is_dir() if n == TEMPLATES else (out / n).is_file())}
    ours = {n for n in ours if not (out / n).is_symlink()}
    _refuse_edited(out, ours)
    new = sorted(p.name for p in tmp.iterdir())
    clash = sorted(n for n in new if n not in ours and os.path.lexists(out / n))
    if TEMPLATES in ours:  # the folder moves whole: only if it holds nothing but the templates mergedb wrote
        clash += _not_our_templates(out)
    if clash:
        why = (  # a link under a listed name: mergedb wrote a file there, not a link
            "is a symbolic link, not the file mergedb wrote there"
            if (out / clash[0]).is_symlink() and clash[0] in _listed_files(out)
            else "is not a file of the mergedb output there (its manifest does not list it as one)"
        )
        raise MergeDBError(
            f"{out / clash[0]} {why} and is in the way of the new output; nothing was installed: move it away and retry"
        )
    old = _partner(out, tmp, OLD)
    old.mkdir()
    try:
        os.rename(out / MANIFEST, old / MANIFEST)
        for name in sorted(ours - {MANIFEST}):
            os.rename(out / name, old / name)
        for name in new:
            if name != MANIFEST:
                os.rename(tmp / name, out / name)
        os.rename(tmp / MANIFEST, out / MANIFEST)  # renames only in between: the window is microseconds
    except BaseException:
        _undo_swap(out, old, tmp)
        raise
    fsync_dir(out, files=False)
    _remove_ours(old)
    tmp.rmdir()


def fsync_dir(d: Path, files: bool = True) -> None:
    for p in d.iterdir() if files else ():
        if _templates(p):
            fsync_dir(p)
        elif p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
