"""Registration's one streaming pass: block layout, base block hashes, and expert delta statistics.

Reads with `os.preadv` (ranged requests for a URL: sources.py) into reused buffers at offsets from
the headers, asked of the kernel a few units ahead (readahead.py), one (expert, tensor) unit per
worker thread, units of all experts in one pool, largest first and a tensor's units together; the
numeric work runs in compiled kernels (regkernels.py) and numpy with the GIL released. Peak memory
is a few blocks per worker plus, per worker, a float32 |Δ| buffer and a half-size exceptions buffer
of the largest tensor (exact top-k thresholds), plus the sketch codes (2 bytes per element) and the
base bytes of the tensors in flight.
Consecutive blocks of a tensor go through one compiled call (blockgroups.py), and a base registered
with its experts is hashed by their scan (scan_family: its file is read once, not twice).
Its rows go to a Sink unit by unit as each ends (register.py stages them on disk: staging.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import xxhash

from . import blockgroups, readahead, stats
from .checkpoint import Checkpoint
from .errors import AlignmentError
from .layout import Block, FamilyTensor, family_layout, vocab_size
from .sources import RemoteOptions, Sources, declare
from .tensorfile import TensorInfo
from .units import BlockSizes, check_threads

Progress = Callable[[int], None]
# Takes rows of expert k, in any order and amount, as the scan makes them: sink(k, block_rows, tensor_rows)
Sink = Callable[[int, list["BlockRow"], list["TensorRow"]], None]


class BlockRow(NamedTuple):
    """Statistics of one (expert, block): a row of the expert_blocks table (schema/001)."""

    tensor_idx: int
    block_idx: int
    identical: bool  # bytes equal the base's: Δ = 0, never read by a merge
    delta_norm: float  # ‖Δ‖₂
    max_abs: float
    nnz: int
    nonfinite: int
    content_hash: str  # xxh3-128 of the expert's bytes of the block
    hist_lo: np.ndarray  # (B,) float32 lower bin edges of |Δ| (non-empty bins only)
    hist_hi: np.ndarray  # (B,) float32 upper bin edges
    hist_count: np.ndarray  # (B,) int64
    hist_sum: np.ndarray  # (B,) float64 Σ|Δ| per bin
    hist_sumsq: np.ndarray  # (B,) float64 ΣΔ² per bin
    sketch: np.ndarray  # (D,) float32 CountSketch of Δ
    base_dot: float  # ⟨θ₀,b, Δ_b⟩ of the decoded block, float64 (schema/006)


class TensorRow(NamedTuple):
    """Per-(expert, tensor) magnitude data: a row of the expert_tensors table."""

    tensor_idx: int
    identical: bool
    grid_threshold: np.ndarray  # (len(DENSITY_GRID),) float32 exact k-th largest |Δ| per density
    summary_code: np.ndarray  # uint16 codes of non-empty magnitude-summary bins
    summary_count: np.ndarray  # int64 counts of those bins


def layout(base: Checkpoint, block_size: int | BlockSizes) -> list[FamilyTensor]:
    """Split every tensor of `base` into blocks of about `block_size` bytes of whole dim-0 rows (with
    a BlockSizes rule: its vocabulary block for the tensors with the base's vocabulary size of rows)."""
    tensors = [t for _, t in base.tensors]
    return family_layout(tensors, block_size, vocab_size(tensors, base.vocab_size))


def check_aligned(base: Checkpoint, expert: Checkpoint) -> None:
    """Refuse an expert whose tensors differ from the base's in names, shapes or dtypes."""
    b = {t.name: t for _, t in base.tensors}
    e = {t.name: t for _, t in expert.tensors}
    problems = [f"missing tensor {n!r}" for n in b if n not in e]
    problems += [f"extra tensor {n!r}" for n in e if n not in b]
    problems += [
        f"tensor {n!r} is {e[n].dtype}{list(e[n].shape)} in the expert but {t.dtype}{list(t.shape)} in the base"
        for n, t in b.items()
        if n in e and (e[n].shape != t.shape or e[n].dtype != t.dtype)
    ]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise AlignmentError(
            f"expert {expert.name!r} ({expert.path}) does not align with base {base.name!r}: "
            + "; ".join(problems[:5])
            + more
            + (_TIED_HINT if _tied_apart(base, expert) else _BASE_HINT)
        )


_BASE_HINT = ". Register it against the base it was fine-tuned from (--base-model NAME)."
_TIED_HINT = (
    ": the two were saved with different tie_word_embeddings (one stores its output head, the other ties it to "
    "its input embeddings and leaves it out). Save both the same way, then register again: load each in "
    "transformers and give both the same config.tie_word_embeddings (tied: model.tie_weights(); untied: copy the "
    "input embeddings into the output head first), then model.save_pretrained."
)
_HEADS = ("lm_head.weight", "embed_out.weight")  # output heads (Llama-style, GPT-NeoX)
_EMBEDS = ("embed_tokens.weight", "embed_in.weight", "wte.weight", "word_embeddings.weight")


def _named(n: str, names: tuple[str, ...]) -> bool:
    return any(n == m or n.endswith("." + m) for m in names)


def _tied_apart(base: Checkpoint, expert: Checkpoint) -> bool:
    """Whether base and expert differ only in an output head that one of them stores and the other
    ties to its input embeddings (its config says tie_word_embeddings, or it holds those embeddings)."""
    b = {t.name: t for _, t in base.tensors}
    e = {t.name: t for _, t in expert.tensors}
    apart = b.keys() ^ e.keys()
    if not apart or not all(_named(n, _HEADS) for n in apart):
        return False
    if any(e[n].shape != t.shape or e[n].dtype != t.dtype for n, t in b.items() if n in e):
        return False
    for n in apart:  # the side without head n must tie it: by its config, or holding input embeddings
        lacking, its_tensors = (expert, e) if n in b else (base, b)
        if lacking.tied is not True and not any(_named(m, _EMBEDS) for m in its_tensors):
            return False
    return True


@dataclass
class ExpertStats:
    """Everything registration learns about one expert, ready to be stored."""

    blocks: list[BlockRow] = field(default_factory=list)
    tensors: list[TensorRow] = field(default_factory=list)
    content_hash: str = ""


class Files:
    """Byte sources (local descriptors or remote files, sources.py) of a checkpoint, by file index."""

    def __init__(self, ckpt: Checkpoint, group: Sources) -> None:
        self.src = [group.open(ckpt.root / f.relpath) for f in ckpt.files]


@contextmanager
def _opened(ckpts: list[Checkpoint]) -> Iterator[list[Files]]:
    group = Sources(RemoteOptions.from_env())
    try:
        yield [Files(c, group) for c in ckpts]
    finally:
        group.close()


def _where(ckpt: Checkpoint) -> dict[str, tuple[int, TensorInfo]]:
    return {pair[1].name: pair for pair in ckpt.tensors}  # the checkpoint's own (file, tensor) pairs


class Scratch(threading.local):
    """Per-thread reusable buffers (fresh large allocations cost page faults on every call)."""

    def get(self, name: str, nbytes: int) -> np.ndarray:
        bufs: dict[str, np.ndarray] = self.__dict__.setdefault("bufs", {})
        buf = bufs.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = bufs[name] = np.empty(max(nbytes, 1), np.uint8)
        return buf[:nbytes]


class _Shared:
    """What the K experts' units of a tensor have in common, per block of the tensors in flight:
    the base's bytes (read by the first unit that needs a block: one read of the base per tensor,
    not one per expert) and the sketch codes (stats.sketch_codes: an element's bucket and sign
    depend on (tensor, block, position) only, so K experts hash each element once, not K times).
    Dropped after the tensor's last unit."""

    def __init__(self, units_per_tensor: dict[int, int], dim: int) -> None:
        self.left = dict(units_per_tensor)
        self.dim = dim
        self.lock = threading.Lock()
        self.tensors: dict[int, tuple[threading.Lock, dict[tuple[str, int], np.ndarray]]] = {}

    def _get(self, tensor_idx: int, key: tuple[str, int], make: Callable[[], np.ndarray]) -> np.ndarray:
        with self.lock:
            lock, tables = self.tensors.setdefault(tensor_idx, (threading.Lock(), {}))
        with lock:  # one unit makes an entry while the others of the tensor wait for it
            value = tables.get(key)
            if value is None:
                value = tables[key] = make()
        return value

    def codes(self, ft: FamilyTensor, block_idx: int, numel: int) -> np.ndarray:
        make = lambda: stats.sketch_codes(stats.sketch_key(ft.name, block_idx), numel, self.dim)  # noqa: E731
        return self._get(ft.tensor_idx, ("codes", block_idx), make)  # (numel,) uint16

    def base(self, ft: FamilyTensor, block_idx: int, read: Callable[[np.ndarray], None], nbytes: int) -> np.ndarray:
        def make() -> np.ndarray:
            buf = np.empty(nbytes, np.uint8)
            read(buf)
            return buf

        return self._get(ft.tensor_idx, ("base", block_idx), make)  # (nbytes,) uint8, read-only by convention

    get = codes  # lorascan's name for it

    def group_codes(self, ft: FamilyTensor, group: list[Block]) -> np.ndarray:
        """The sketch codes of consecutive blocks, one table (each block's part under its own key)."""
        make = lambda: blockgroups.group_codes(ft, group, self.dim)  # noqa: E731
        return self._get(ft.tensor_idx, ("group codes", group[0].block_idx), make)

    def release(self, tensor_idx: int) -> None:
        with self.lock:
            self.left[tensor_idx] -= 1
            if self.left[tensor_idx] == 0:
                self.tensors.pop(tensor_idx, None)


SharedCodes = _Shared  # lorascan shares the codes only (its base blocks are read per adapter)


class BaseBlocks(list):
    """The base's block hashes (xxh3-128, the list itself, in (tensor, block) order) and, per block,
    ‖θ₀,b‖₂ and the NaN/Inf count of its decoded values (None for pass-through tensors)."""

    def __init__(self, hashes: list[str], norms: list[float | None], nonfinite: list[int | None]) -> None:
        super().__init__(hashes)
        self.norms = norms
        self.nonfinite = nonfinite


def hash_base(base: Checkpoint, family: list[FamilyTensor], threads: int, progress: Progress | None) -> BaseBlocks:
    """Hash every block of the base and, for float tensors, decode it: its norm and NaN/Inf count."""
    check_threads(threads)
    where = _where(base)
    scratch = Scratch()

    def one(ft: FamilyTensor) -> list[tuple[str, float | None, int | None]]:
        fi, t = where[ft.name]
        out = []
        for group in blockgroups.groups(ft.blocks):  # one compiled call per group, not per block
            at = np.cumsum([0] + [blk.nbytes for blk in group])
            buf = scratch.get("raw", int(at[-1]))
            for i, blk in enumerate(group):
                files.src[fi].read_into(memoryview(buf[at[i] : at[i + 1]]), t.start + blk.byte_start)
            out += blockgroups.base_rows(ft, group, buf, scratch.get)
            if progress:
                progress(int(at[-1]))
        return out

    order = sorted(family, key=lambda ft: (-ft.nbytes, ft.tensor_idx))  # largest first: a short tail
    with _opened([base]) as (files,), ThreadPoolExecutor(threads) as pool:
        if files.src[0].remote:
            declare(
                (files.src[where[ft.name][0]], where[ft.name][1].start + b.byte_start, b.nbytes, 1)
                for ft in order
                for b in ft.blocks
            )
        by_tensor = {ft.tensor_idx: rs for ft, rs in zip(order, pool.map(one, order))}
    rows = [r for ft in family for r in by_tensor[ft.tensor_idx]]
    return BaseBlocks([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])


def scan_experts(
    base: Checkpoint,
    experts: list[Checkpoint],
    family: list[FamilyTensor],
    base_hashes: dict[tuple[int, int], str],
    sketch_dim: int,
    threads: int,
    progress: Progress | None = None,
    sink: Sink | None = None,
) -> list[ExpertStats]:
    """Read every expert (and the base blocks it needs) once; exact delta statistics per block and
    tensor (_scan). `base_hashes`: the registered base's block hashes, by (tensor, block). With
    `sink`, the rows go there as each unit ends, and the ExpertStats returned hold the content hash only."""
    return _scan(base, experts, family, base_hashes, sketch_dim, threads, progress, sink)[0]


def scan_family(
    base: Checkpoint,
    experts: list[Checkpoint],
    family: list[FamilyTensor],
    sketch_dim: int,
    threads: int,
    progress: Progress | None = None,
    sink: Sink | None = None,
) -> tuple[BaseBlocks, list[ExpertStats]]:
    """hash_base and scan_experts in one pass for a base registered with its experts: the base is
    read once (the scan reads its blocks anyway), and its hashing runs on all cores with the rest."""
    out, base_blocks = _scan(base, experts, family, None, sketch_dim, threads, progress, sink)
    rows = [base_blocks[ft.tensor_idx, blk.block_idx] for ft in family for blk in ft.blocks]
    return BaseBlocks([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]), out


def _scan(
    base: Checkpoint,
    experts: list[Checkpoint],
    family: list[FamilyTensor],
    base_hashes: dict[tuple[int, int], str] | None,
    sketch_dim: int,
    threads: int,
    progress: Progress | None = None,
    sink: Sink | None = None,
) -> tuple[list[ExpertStats], dict[tuple[int, int], tuple[str, float | None, int | None]]]:
    """Read every expert (and the base blocks it needs) once; exact delta statistics per block and tensor.

    One pool of (expert, tensor) units over all experts, largest tensor first, so the tail where
    one thread finishes a large tensor alone is one small unit long; a tensor's units run next to
    each other and share its sketch codes and base blocks (_Shared: the base is read once per
    tensor, not once per expert). At most `threads` units are in flight, each holding a few blocks
    and the |Δ| and exceptions buffers of its tensor (per-thread scratch), so peak memory is
    `threads` × (largest tensor × 6 bytes + a few blocks) plus, per element of the tensors in
    flight, its sketch code (2 bytes) and its base bytes: flat in the number of experts. The base
    is decoded again for each expert, inside the statistics pass (a shift per bf16 element). A unit's
    rows go to `sink` as it ends, else into the ExpertStats returned, in (tensor, block) order per expert,
    whatever the thread count or the order units finish in; only block hashes are kept (content_hash).
    `base_hashes` None: the base is being registered too; its blocks' hashes and statistics
    (hash_base's) are computed from the base blocks read here, and returned with the rows.
    """
    check_threads(threads)
    for expert in experts:
        check_aligned(base, expert)
    bwhere = _where(base)
    ewhere = [_where(e) for e in experts]
    scratch = Scratch()

    def one(unit: tuple[int, FamilyTensor]) -> tuple[list[BlockRow], TensorRow | None, list[str]]:
        try:
            return scan_unit(*unit)
        finally:
            if shared is not None:
                shared.release(unit[1].tensor_idx)

    def scan_unit(k: int, ft: FamilyTensor) -> tuple[list[BlockRow], TensorRow | None, list[str]]:
        ahead.started(k, ft)  # this unit's bytes and the next units' are read ahead (readahead.py)
        efiles = expert_files[k]
        bfi, bt = bwhere[ft.name]
        efi, et = ewhere[k][ft.name]
        rows: list[BlockRow] = []
        hashes: list[str] = []
        abs_delta = scratch.get("abs", ft.numel * 4).view(np.float32) if ft.mergeable else None
        summary = np.zeros(stats.SUMMARY_BINS, np.int64)
        # room for the exceptions of half the tensor: beyond that the radix select is cheaper
        cap = ft.numel // 2 + 1024 if ft.mergeable else 0
        exceptions = stats.Exceptions(cap, scratch.get("exc", cap * 4 + 4).view(np.uint32))
        all_identical = True
        for group in blockgroups.groups(ft.blocks):
            at = np.cumsum([0] + [blk.nbytes for blk in group])  # each block's bytes in the group's
            eraw = scratch.get("e", int(at[-1]))
            for i, blk in enumerate(group):
                efiles.src[efi].read_into(memoryview(eraw[at[i] : at[i + 1]]), et.start + blk.byte_start)

            read: list[bool] = []  # whether this unit read the group's base bytes (once per group: _Shared)

            def read_base(buf: np.ndarray, group: list[Block] = group, at: np.ndarray = at, read: list = read) -> None:
                for i, blk in enumerate(group):
                    bfiles.src[bfi].read_into(memoryview(buf[at[i] : at[i + 1]]), bt.start + blk.byte_start)
                read.append(True)

            if shared is not None:
                braw = shared.base(ft, group[0].block_idx, read_base, int(at[-1]))
            else:
                braw = scratch.get("b", int(at[-1]))
                read_base(braw)
            if read and base_hashes is None:  # the base's own rows, by the unit that read the group,
                # once its bytes are shared: the tensor's other units go on meanwhile instead of waiting
                brows = blockgroups.base_rows(ft, group, braw, scratch.get)
                computed.update(zip(((ft.tensor_idx, b.block_idx) for b in group), brows))
                if progress:
                    progress(int(at[-1]))
            if progress:
                progress(2 * int(at[-1]))  # the expert's blocks and the base's
            if not ft.mergeable:
                for i, blk in enumerate(group):
                    e_i, b_i = eraw[at[i] : at[i + 1]], braw[at[i] : at[i + 1]]
                    same = stats.same_bytes(e_i, b_i)
                    hashes.append(
                        hash_of(ft.tensor_idx, blk.block_idx, e_i) if same else xxhash.xxh3_128_hexdigest(e_i)
                    )
                continue
            gcodes = shared.group_codes(ft, group) if shared is not None else None
            out = blockgroups.expert_stats(
                ft, group, eraw, braw, abs_delta, summary, exceptions, gcodes, sketch_dim, scratch.get
            )
            for i, blk in enumerate(group):
                if out[0][i]:  # the block's bytes equal the base's
                    chash = hash_of(ft.tensor_idx, blk.block_idx, eraw[at[i] : at[i + 1]])
                    rows.append(zero_row(ft.tensor_idx, blk.block_idx, chash, sketch_dim))
                else:
                    all_identical = False
                    chash = xxhash.xxh3_128_hexdigest(eraw[at[i] : at[i + 1]])
                    s = stats.group_block_stats(out, i, blk.numel)
                    rows.append(changed_row(ft.tensor_idx, blk.block_idx, chash, s))
                hashes.append(chash)
        if not ft.mergeable:
            return rows, None, hashes
        if all_identical:
            thresholds = np.zeros(len(stats.DENSITY_GRID), np.float32)
        else:
            thresholds = stats.tensor_thresholds(abs_delta, summary, exceptions)
        codes, counts = stats.summary_bins(summary)
        return rows, TensorRow(ft.tensor_idx, all_identical, thresholds, codes, counts), hashes

    # largest first; a tensor's units (one per expert) next to each other, so they share its codes
    units = readahead.Units.scan_order(family, len(experts))
    computed: dict[tuple[int, int], tuple[str, float | None, int | None]] = {}  # base rows (base_hashes None)

    def hash_of(tensor_idx: int, block_idx: int, same: np.ndarray) -> str:
        """The hash of a block whose bytes `same` equal the base's: the registered base's, or (the base
        registered with this scan, its rows maybe still being computed by another unit) their own."""
        return base_hashes[tensor_idx, block_idx] if base_hashes is not None else xxhash.xxh3_128_hexdigest(same)

    # a tensor's units share its base blocks (and, base_hashes None, compute the base's rows once); one
    # expert reads each base group once anyway, into per-thread scratch (no whole tensor kept)
    many = len(experts) > 1
    shared = _Shared({ft.tensor_idx: len(experts) for ft in family}, sketch_dim) if many else None
    out = [ExpertStats() for _ in experts]
    place = {ft.tensor_idx: i for i, ft in enumerate(family)}
    hashes_of: list[list[bytes | None]] = [[None] * len(family) for _ in experts]  # [expert][tensor]: block hashes
    with _opened([base, *experts]) as (bfiles, *expert_files):
        if any(s.remote for f in (bfiles, *expert_files) for s in f.src):
            declare(readahead.unit_reads(units, bfiles, bwhere, expert_files, ewhere))
        ahead = readahead.ReadAhead(units, bfiles, bwhere, expert_files, ewhere)
        put = sink or collect(out)
        with ThreadPoolExecutor(threads) as pool:
            for (k, ft), (rows, trow, hashes) in zip(units, readahead.in_order(pool, one, units, 8 * threads + 8)):
                hashes_of[k][place[ft.tensor_idx]] = "".join(hashes).encode()
                put(k, rows, [] if trow is None else [trow])
    for k, st in enumerate(out):
        assert None not in hashes_of[k], "a unit of the scan did not run"  # (its error would have been raised)
        st.content_hash = content_hash(hashes_of[k])  # type: ignore[arg-type]
        hashes_of[k] = []
        st.blocks.sort(key=lambda r: (r.tensor_idx, r.block_idx))  # collected (stable: a unit's rows are in order)
        st.tensors.sort(key=lambda r: r.tensor_idx)
    return out, computed


def collect(out: list[ExpertStats]) -> Sink:
    """A Sink that keeps the rows of expert k in out[k]."""

    def sink(k: int, blocks: list[BlockRow], tensors: list[TensorRow]) -> None:
        out[k].blocks.extend(blocks)
        out[k].tensors.extend(tensors)

    return sink


def content_hash(block_hashes: Iterable[str | bytes]) -> str:
    """A checkpoint's content hash: xxh3-128 over its block hashes (hex digits) in (tensor, block)
    order; a piece may join several (xxh3's streaming digest does not depend on how input is cut)."""
    h = xxhash.xxh3_128()
    for hx in block_hashes:
        h.update(hx.encode() if isinstance(hx, str) else hx)
    return h.hexdigest()


def changed_row(tensor_idx: int, block_idx: int, chash: str, s: stats.BlockStats) -> BlockRow:
    """The row of a block whose delta is not zero, from its statistics (scan and lorascan)."""
    return BlockRow(
        tensor_idx, block_idx, False, s.norm, s.max_abs, s.nnz, s.nonfinite, chash, s.hist_lo,
        stats.hist_hi(s.hist_lo), s.hist_count, s.hist_sum, s.hist_sumsq, s.sketch, s.base_dot,
    )  # fmt: skip


def zero_row(tensor_idx: int, block_idx: int, chash: str, dim: int) -> BlockRow:
    empty_f = np.zeros(0, np.float32)
    return BlockRow(
        tensor_idx, block_idx, True, 0.0, 0.0, 0, 0, chash, empty_f, empty_f, np.zeros(0, np.int64), np.zeros(0),
        np.zeros(0), np.zeros(dim, np.float32), 0.0,
    )  # fmt: skip
