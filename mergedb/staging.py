"""Registration's statistic rows, kept on disk between the scan and the catalog's one transaction.

The scan hands each (expert, tensor) unit's rows over as the unit ends (scan.Sink); held as Python
objects until the transaction, they grew with experts × blocks (≈3–19 KB per (expert, tensor),
1.59 GB for 4 experts of 20k tensors), though everything else the scan holds is flat in K. Here
they wait in Python only until `BATCH_ROWS` rows are pending over all experts and `MIN_BATCH` per
(expert, table) on average (so a batch is not a row or two when many experts run side by side), then
each expert's pending rows become one Arrow record batch per table, appended to one scratch file as an
Arrow IPC message (no compression: the rows are read back once, a few seconds later). Its offsets
are kept here; the transaction reads each expert's batches back as a stream that DuckDB inserts
`ORDER BY tensor_idx, block_idx`, so the catalog gets the rows in the order it got them before,
whatever order the units finished in. The rows are the same Arrow arrays as before, so the catalog
holds the same values.

The scratch file is an anonymous temporary file (tempfile.TemporaryFile: unlinked at once) in the
catalog's folder, made when the first rows are written (a registration that scans nothing makes
none): its disk is the one that takes these rows next anyway (/tmp may be small or held in memory,
tmpfs), and no name is ever visible, so nothing is left behind whatever ends the process (an error,
Ctrl-C, a kill: the system frees an unlinked file with its last descriptor). A failure to make or
write it (a full disk, a read-only folder) is a MergeDBError, raised before the catalog is opened:
nothing is written.
"""

from __future__ import annotations

import errno
import os
import tempfile
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from .errors import MergeDBError

BATCH_ROWS = 1024  # rows (blocks and tensors) held in Python over all experts before they go to the file
MIN_BATCH = 64  # … and at least this many per (expert, table) pending: memory ~64 rows per expert

# Arrow types of the scan's named rows, by field name (the columns of schema/001's tables).
BLOCK_TYPES = {
    "tensor_idx": pa.int32(),
    "block_idx": pa.int32(),
    "identical": pa.bool_(),
    "delta_norm": pa.float64(),
    "max_abs": pa.float32(),
    "nnz": pa.int64(),
    "nonfinite": pa.int64(),
    "content_hash": pa.string(),
    "hist_lo": pa.list_(pa.float32()),
    "hist_hi": pa.list_(pa.float32()),
    "hist_count": pa.list_(pa.int64()),
    "hist_sum": pa.list_(pa.float64()),
    "hist_sumsq": pa.list_(pa.float64()),
    "sketch": pa.list_(pa.float32()),
    "base_dot": pa.float64(),
}
TENSOR_TYPES = {
    "tensor_idx": pa.int32(),
    "identical": pa.bool_(),
    "grid_threshold": pa.list_(pa.float32()),
    "summary_code": pa.list_(pa.uint16()),
    "summary_count": pa.list_(pa.int64()),
}
COSTS = {"expert_blocks": "read_bytes", "expert_tensors": "fixed_bytes"}  # an adapter's (schema/009)
_TYPES = {"expert_blocks": BLOCK_TYPES, "expert_tensors": TENSOR_TYPES}


def rows_batch(table: str, rows: Sequence[tuple], costs: Sequence[int] | None = None) -> pa.RecordBatch:
    """Named rows of `table` (expert_blocks: scan.BlockRow, expert_tensors: scan.TensorRow) as one
    Arrow record batch with the schema's column names; `costs`: an adapter's COSTS column, per row."""
    types = _TYPES[table]
    cols = list(zip(*rows)) if rows else [() for _ in types]
    data = {name: pa.array(list(values), t) for (name, t), values in zip(types.items(), cols)}
    if costs is not None:
        data[COSTS[table]] = pa.array(list(costs), pa.int64())
    return pa.record_batch(data)


class Stage:
    """Rows of the experts being registered, by key (an expert's name), until the transaction.

    `add` takes an expert's rows in any order and amount; `insert` writes one expert's rows into
    the catalog's tables in (tensor, block) order; `close` when done, however the registration ends
    (the file is freed then)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._file: Any = None  # made at the first rows to write: a registration with nothing to scan
        # (an unchanged expert registered again) needs no new file in the catalog's folder
        self._lock = threading.Lock()
        self._pending: dict[tuple[Any, str], list[tuple[list, list[int] | None]]] = {}
        self._pending_rows = 0
        self.rows = 0  # every row taken (register sizes its transaction's memory limit by it)
        self._batches: dict[tuple[Any, str], list[tuple[int, int]]] = {}  # (offset, length) per batch
        self._schemas: dict[tuple[Any, str], pa.Schema] = {}

    def close(self) -> None:
        self._pending.clear()
        if self._file is not None:
            self._file.close()

    def add(
        self,
        key: Any,
        blocks: list[tuple],
        tensors: list[tuple],
        read_bytes: list[int] | None = None,
        fixed_bytes: list[int] | None = None,
    ) -> None:
        """Take rows of expert `key` (scan.BlockRow, scan.TensorRow; an adapter's costs beside them).
        Safe to call from several threads."""
        with self._lock:
            for table, rows, costs in (("expert_blocks", blocks, read_bytes), ("expert_tensors", tensors, fixed_bytes)):
                if rows:
                    self._pending.setdefault((key, table), []).append((rows, costs))
            self._pending_rows += len(blocks) + len(tensors)
            self.rows += len(blocks) + len(tensors)
            # at least MIN_BATCH rows per (expert, table) in a flush: units run tensor by tensor over
            # all experts, so with many experts BATCH_ROWS alone made batches of a row or two (a
            # pread and a decode per row at the insert)
            if self._pending_rows >= max(BATCH_ROWS, MIN_BATCH * len(self._pending)):
                self._flush()

    def _flush(self) -> None:
        """Write every pending row to the file, one record batch per (expert, table)."""
        pending, self._pending, self._pending_rows = self._pending, {}, 0
        if pending and self._file is None:
            try:
                self._file = tempfile.TemporaryFile(dir=self.folder, prefix=".mergedb-rows-")
            except OSError as e:
                raise _failed(self.folder, e) from None
        for (key, table), parts in pending.items():
            rows = [r for part, _ in parts for r in part]
            costs = None if parts[0][1] is None else [c for _, part in parts for c in part or ()]
            batch = rows_batch(table, rows, costs)
            del rows
            data = batch.serialize()  # an Arrow IPC record batch message, without its schema
            try:
                offset = self._file.seek(0, os.SEEK_END)
                self._file.write(memoryview(data))
            except OSError as e:
                raise _failed(self.folder, e) from None
            self._batches.setdefault((key, table), []).append((offset, data.size))
            self._schemas.setdefault((key, table), batch.schema)

    def _read(self, key: Any, table: str) -> pa.RecordBatchReader | None:
        """One expert's staged rows of `table`, batch by batch as written (None when it has none)."""
        if (key, table) not in self._schemas:
            return None
        schema = self._schemas[key, table]

        def batches() -> Iterator[pa.RecordBatch]:
            for offset, length in self._batches[key, table]:
                data = os.pread(self._file.fileno(), length, offset)
                if len(data) != length:
                    raise MergeDBError(f"the registration's scratch file in {self.folder} lost rows; run it again")
                yield pa.ipc.read_record_batch(pa.py_buffer(data), schema)

        return pa.RecordBatchReader.from_batches(schema, batches())

    def finish(self) -> None:
        """Write what is still pending (before the catalog is opened: a full disk fails here)."""
        with self._lock:
            self._flush()
            if self._file is None:
                return
            try:
                self._file.flush()
            except OSError as e:
                raise _failed(self.folder, e) from None

    def insert(self, con: duckdb.DuckDBPyConnection, key: Any, cid: int) -> None:
        """INSERT expert `key`'s rows as checkpoint `cid`, in (tensor, block) order. DuckDB reads the
        stream by its local name (a replacement scan, as register.append_rows does)."""
        self.finish()
        for table, order in (("expert_blocks", "tensor_idx, block_idx"), ("expert_tensors", "tensor_idx")):
            _mergedb_staged = self._read(key, table)
            if _mergedb_staged is None:
                continue
            cols = ", ".join(_mergedb_staged.schema.names)
            con.execute(
                f"INSERT INTO {table} (checkpoint_id, {cols}) "
                f"SELECT CAST(? AS INTEGER), {cols} FROM _mergedb_staged ORDER BY {order}",
                [cid],
            )


def _failed(folder: Path, e: OSError) -> MergeDBError:
    """The scratch file could not be made or written: the cause in the words faults.diagnose uses for
    the catalog's own file, and the fix."""
    why = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        cause, fix = f"its disk is full or a size limit was reached ({why})", "free space (or raise the limit)"
    else:
        cause, fix = why, "make that folder writable (or pass --catalog with a path in a writable folder)"
    return MergeDBError(
        f"cannot keep the registration's rows in a scratch file in {folder}, the catalog's folder: {cause}; "
        f"nothing was written to the catalog: {fix} and run the command again"
    )
