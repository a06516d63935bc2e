"""Checkpoints behind URLs: s3://, http(s)://, file:// or any other fsspec protocol.

A URL names a checkpoint as a local path does: a .safetensors file, a sharded index
(model.safetensors.index.json), or a folder (a prefix: s3://bucket/family/expert) holding
model.safetensors or the index. Folders are listed only where the filesystem lists (S3, GCS, file);
over HTTP(S) name the file or the index (a Hugging Face `resolve` URL is plain HTTPS).

fsspec is optional (`pip install 'mergedb[remote]'`) and imported only when a URL is used.
Credentials come from the filesystem library's own environment and config (botocore's
AWS_* variables and ~/.aws, fsspec's FSSPEC_<PROTOCOL>_<KEY> variables); a URL carrying
credentials (user:password@, a query string such as a presigned signature) is refused, because
the URL is stored in the catalog and in every output's manifest.

A remote file's version is its ETag (else Last-Modified, else the mtime of a file:// path); with
the size and the header hash it makes the fingerprint, so a replaced object is refused at
execution as a modified local file is.
"""

from __future__ import annotations

import posixpath
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any
from urllib.parse import urlsplit

from . import jsondoc
from .errors import FormatError, MergeDBError
from .plainfile import leads_inside, link_roots

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_UNLISTABLE = ("http", "https")  # fsspec's HTTP "listing" scrapes HTML links: never a folder listing
SMALL_FILE_LIMIT = 256 * 2**20  # config, index, tokenizer: refused above this (a URL that is not one)
# HTTP(S) requests are tried again after a transient failure (fsspec's HTTP filesystem never does;
# S3's and GCS's libraries retry on their own, so theirs are not wrapped): 5 tries, 0.5 + 1 + 2 + 4 s
# of waits; a timeout is not tried again (see _transient)
HTTP_TRIES = 5
HTTP_BACKOFF = 0.5  # seconds before the second try, doubling after each
HTTP_MAX_WAIT = 60.0  # the longest wait a Retry-After answer is granted; asking for more ends the run
_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


def is_url(path: object) -> bool:
    """True for 'scheme://…' (a str or a RemotePath); local paths, Path objects and 'C:\\…' are not URLs."""
    return isinstance(path, (str, RemotePath)) and bool(_SCHEME.match(str(path)))


def local_path(url: str | RemotePath) -> str | None:
    """The path on this machine that a file:// (or local://) URL names, as fsspec reads it; None
    for any other URL (s3://, http(s)://: on no disk an output could be written to)."""
    if urlsplit(str(url)).scheme not in ("file", "local"):
        return None
    return filesystem(str(url))[1]


@dataclass(frozen=True)
class RemotePath:
    """A URL with the small part of pathlib's interface that checkpoints use (`/`, name, parent,
    resolve). It has no __fspath__: handing one to os.open is a TypeError, never a wrong file."""

    url: str

    def __truediv__(self, rel: str) -> RemotePath:
        return RemotePath(f"{self.url.rstrip('/')}/{rel}")

    def __str__(self) -> str:
        return self.url

    def resolve(self) -> RemotePath:
        return self

    @property
    def name(self) -> str:
        return posixpath.basename(urlsplit(self.url).path.rstrip("/"))

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    @property
    def stem(self) -> str:
        return posixpath.splitext(self.name)[0]

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.url.rstrip("/").rsplit("/", 1)[0])


def check_url(url: str) -> RemotePath:
    """The URL as a RemotePath, refusing those that carry credentials (they would be stored)."""
    parts = urlsplit(url)
    if "@" in parts.netloc:
        raise MergeDBError(
            f"{parts.scheme}://…@{parts.netloc.rsplit('@', 1)[1]}: the URL carries credentials, which mergedb "
            "would store in the catalog and in manifests; give them through the environment instead "
            "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws, or FSSPEC_<PROTOCOL>_<KEY> variables)"
        )
    if parts.query or parts.fragment:
        raise MergeDBError(
            f"{parts.scheme}://{parts.netloc}{parts.path}: the URL has a query string or fragment, which "
            "often carries a signature or token and would be stored in the catalog and in manifests; "
            "use the plain URL and give credentials through the environment"
        )
    return RemotePath(url.rstrip("/"))


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path within it) for `url`; fsspec is imported here, not before."""
    try:
        import fsspec.core
    except ImportError:
        raise MergeDBError(f"{url}: remote checkpoints need fsspec: pip install 'mergedb[remote]'") from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:  # the protocol's package (s3fs, aiohttp, gcsfs…) is missing
        raise MergeDBError(f"{url}: {e}; pip install 'mergedb[remote]' (S3 and HTTP)") from None
    except ValueError as e:
        raise MergeDBError(f"{url}: {e}") from None


@dataclass(frozen=True)
class RemoteStat:
    """Size and version (ETag, else Last-Modified, else mtime) of a remote file."""

    size: int
    version: str


def _unreachable(url: str, e: FileNotFoundError) -> MergeDBError | None:
    """fsspec's HTTP filesystem reports every failure to reach a file as FileNotFoundError, with the
    real one attached (connection refused, an unknown host, 403, TLS); only a 404, or no cause, means
    there is no such file."""
    cause = e.__cause__ or e.__context__
    if cause is None or getattr(cause, "status", None) == 404 or isinstance(cause, FileNotFoundError):
        return None
    return MergeDBError(f"{url}: cannot be reached ({type(cause).__name__}: {cause}); check the URL and the network")


def _transient(e: BaseException) -> bool:
    """A failure worth another try: a 5xx, 408 or 429 answer, a dropped or refused connection, a body
    cut short (not a timeout: aiohttp's comes after 5 minutes). fsspec's HTTP filesystem wraps some of
    them in FileNotFoundError (the real one attached, _unreachable); a 403, a 404 or a 416 is for good."""
    if isinstance(e, FileNotFoundError):
        cause = e.__cause__ or e.__context__
        return cause is not None and not isinstance(cause, FileNotFoundError) and _transient(cause)
    status = getattr(e, "status", None)
    if isinstance(status, int):
        return status in _TRANSIENT_STATUS
    if isinstance(e, TimeoutError):  # asyncio's is the builtin from 3.11: aiohttp waited 5 minutes already,
        return False  # and four more tries would make a stalled server fail after 25
    if isinstance(e, ConnectionError):
        return True
    try:
        import aiohttp  # what fsspec's HTTP filesystem runs on; installed with it
    except ImportError:
        return False
    return isinstance(e, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError))


def _tried(fs: Any, call: Callable[[], Any]) -> Any:
    """call(), tried again after a transient failure of an HTTP(S) request (HTTP_TRIES in all, the
    waits HTTP_BACKOFF doubling, or longer where the answer's Retry-After asks, up to HTTP_MAX_WAIT);
    the last failure is raised as it came."""
    if not any(p in _UNLISTABLE for p in _protocols(fs)):
        return call()
    for attempt in range(HTTP_TRIES - 1):
        try:
            return call()
        except Exception as e:
            if not _transient(e):
                raise
            wait, asked = HTTP_BACKOFF * 2**attempt, _retry_after(e)
            if asked is not None and asked > HTTP_MAX_WAIT:
                raise MergeDBError(
                    f"the server asks to be tried again in {asked:.0f} s (Retry-After), longer than mergedb "
                    f"waits ({HTTP_MAX_WAIT:.0f} s); run the command again later ({e})"
                ) from None
            time.sleep(max(wait, asked or 0.0))
    return call()  # the last try: its failure is the one raised


def _retry_after(e: BaseException) -> float | None:
    """Seconds a failed answer's Retry-After header asks to wait (a number of seconds, or an HTTP
    date), or None without one. aiohttp's ClientResponseError carries the answer's headers; fsspec
    may wrap it in FileNotFoundError (_unreachable)."""
    if isinstance(e, FileNotFoundError):
        e = e.__cause__ or e.__context__ or e
    headers = getattr(e, "headers", None)
    value = headers.get("Retry-After") if headers else None
    if not isinstance(value, str):
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None  # not a form RFC 9110 allows: the usual backoff
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


def stat(url: str) -> RemoteStat | None:
    """The file at `url`, or None when there is none (a folder is not a file)."""
    fs, path = filesystem(url)
    try:
        fs.invalidate_cache(path)  # a listing cached earlier in this process must not hide a change
        info = _tried(fs, lambda: fs.info(path))
    except MergeDBError as e:
        raise MergeDBError(f"{url}: {e}") from None
    except FileNotFoundError as e:
        err = _unreachable(url, e)
        if err is not None:
            raise err from None
        return None
    except (IsADirectoryError, NotADirectoryError):
        return None
    except Exception as e:  # network, credentials (botocore's errors are not OSErrors)
        raise MergeDBError(f"{url}: cannot be read ({e}); check the URL, the network and the credentials") from None
    if info.get("type") == "directory" or info.get("size") is None:
        return None
    version = next((str(info[k]) for k in ("ETag", "LastModified", "Last-Modified", "mtime") if info.get(k)), "")
    if not version:
        raise MergeDBError(
            f"{url}: the server sends neither an ETag nor a Last-Modified date, so mergedb could not tell "
            "whether the file changed after registration; serve it from a server that does"
        )
    return RemoteStat(int(info["size"]), version)


def read_bytes(url: str, start: int | None = None, end: int | None = None) -> bytes:
    """Bytes [start, end) of the file at `url` (all of it when both are None), checked for length."""
    fs, path = filesystem(url)
    try:
        data = _tried(fs, lambda: fs.cat_file(path, start=start, end=end))
    except MergeDBError as e:  # _tried's own (a Retry-After too long to wait)
        raise MergeDBError(f"{url}: {e}") from None
    except FileNotFoundError as e:
        raise (_unreachable(url, e) or FormatError(f"{url}: no such file")) from None
    except Exception as e:  # network, credentials (botocore's errors are not OSErrors)
        why = str(e) or type(e).__name__  # a timeout's str is empty
        raise MergeDBError(f"{url}: reading failed ({why}); check the network and the credentials") from None
    if start is not None and end is not None and len(data) != end - start:
        raise FormatError(
            f"{url}: asked for bytes {start}-{end} and got {len(data)} bytes (the server ignores Range "
            "requests, or the file is shorter than its header says); serve it with Range support"
        )
    return bytes(data)


def read_small(url: str) -> bytes | None:
    """A small side file (config, index, tokenizer) in full, or None when it is absent."""
    st = stat(url)
    if st is None:
        return None
    if st.size > SMALL_FILE_LIMIT:
        raise FormatError(f"{url}: {st.size} bytes is too large for a config, index or tokenizer file")
    return read_bytes(url, 0, st.size) if st.size else b""


def listdir(url: str, folders: bool = False) -> list[str] | None:
    """Names of the entries directly under the folder `url` (`folders`: only its subfolders); None
    where the filesystem cannot list."""
    fs, path = filesystem(url)
    if any(p in _UNLISTABLE for p in _protocols(fs)):
        return None
    try:
        entries = fs.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except Exception as e:  # network, credentials (botocore's errors are not OSErrors)
        raise MergeDBError(f"{url}: cannot be listed ({e}); check the URL, the network and the credentials") from None
    names = {
        posixpath.basename(str(e["name"]).rstrip("/")) for e in entries if not folders or e.get("type") == "directory"
    }
    return sorted(names - {"", ".", ".."})  # an object store may hold keys named so: never entries


def _protocols(fs: Any) -> tuple[str, ...]:
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


@dataclass(frozen=True)
class Location:
    """A remote checkpoint: what the user named, the folder of its files, the files, a default name,
    and the index's weight_map when sharded."""

    path: RemotePath
    root: RemotePath
    relpaths: tuple[str, ...]
    name: str
    weight_map: dict[str, str] | None


def locate(url: str, single: str, index: str) -> Location | None:
    """The checkpoint at `url` (a .safetensors file, an index file, or a folder holding `single` or
    `index`); None when `url` is a folder that holds neither (perhaps a folder of checkpoints)."""
    path = check_url(url)
    if path.suffix == ".safetensors":
        if stat(path.url) is None:
            raise FormatError(f"{path}: no such file")
        # model.safetensors is named as its folder, as the folder would be; not over HTTP, where the
        # folder is often a revision (…/resolve/main/model.safetensors)
        folder = path.name == single and path.parent.name and not url.startswith(("http://", "https://"))
        name = path.parent.name if folder else path.stem
        return Location(path, path.parent, (path.name,), name, None)
    if path.name.endswith(".index.json"):
        return _sharded(path, path.parent)
    if stat((path / single).url) is not None:  # as a local folder: model.safetensors wins over an index
        return Location(path, path, (single,), path.name, None)
    if stat((path / index).url) is not None:
        return _sharded(path / index, path, shown=path)
    return None


def _sharded(index_url: RemotePath, root: RemotePath, shown: RemotePath | None = None) -> Location:
    raw = read_small(index_url.url)
    if raw is None:
        raise FormatError(f"{index_url}: no such file")
    weight_map = jsondoc.weight_map(raw, index_url)
    for tensor, shard in weight_map.items():
        norm = posixpath.normpath(shard)
        if "\x00" in shard or "://" in shard or norm == ".." or norm.startswith(("/", "../")) or norm != shard:
            raise FormatError(
                f"{index_url}: tensor {tensor!r} points to {shard!r}, outside the checkpoint folder; "
                "shards must be plain file names relative to the index"
            )
    shards = sorted(set(weight_map.values()))
    local = local_path(root)  # file://: on this disk, where a shard's links may lead is checked as a local folder's
    roots = link_roots(local) if local is not None else []
    for shard in shards:
        if stat((root / shard).url) is None:
            raise FormatError(f"{index_url}: points to missing shard {shard!r}")
        if local is not None and not leads_inside(posixpath.join(local, shard), roots):
            raise FormatError(
                f"{index_url}: {shard!r} links outside the checkpoint folder; shards must be files inside the "
                "folder (or, in a Hugging Face cache, its blobs/)"
            )
    name = (shown or root).name
    return Location(shown or index_url, root, tuple(shards), name, weight_map)


def side_names(root: RemotePath, names: tuple[str, ...], listed: list[str] | None = None) -> list[str]:
    """Those of `names` present as files in the remote folder `root` (one listing where the
    filesystem lists, or `listed`, the caller's listing of it; else one HEAD request per name)."""
    listed = listdir(root.url) if listed is None else listed
    if listed is not None:
        return sorted(n for n in names if n in listed and stat((root / n).url) is not None)
    return sorted(n for n in names if stat((root / n).url) is not None)
