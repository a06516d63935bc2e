"""Integrity checks: a catalog against itself and the files it describes, and a merged output
against its manifest. Both report problems (what, where, how to fix) instead of raising."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from . import jsondoc, manifest, outdir, plans
from .checkpoint import INDEX, Checkpoint, open_checkpoint
from .errors import CatalogError, MergeDBError
from .lora import CONFIG as ADAPTER_CONFIG
from .lora import adapter_fingerprint, is_adapter
from .plainfile import read_small
from .sidefiles import TEMPLATES, is_side_name
from .sources import Sources
from .tensorfile import PT_METADATA, read_header

if TYPE_CHECKING:
    from .catalog import Catalog


@dataclass(frozen=True)
class Problem:
    """One thing `check` found wrong: where, what, and how to fix it."""

    where: str
    what: str
    fix: str


_ORPHANS = [
    ("files", "checkpoint_id NOT IN (SELECT checkpoint_id FROM checkpoints)"),
    ("tensors", "checkpoint_id NOT IN (SELECT checkpoint_id FROM checkpoints)"),
    ("expert_blocks", "checkpoint_id NOT IN (SELECT checkpoint_id FROM checkpoints WHERE role = 'expert')"),
    ("expert_tensors", "checkpoint_id NOT IN (SELECT checkpoint_id FROM checkpoints WHERE role = 'expert')"),
    ("blocks", "base_id NOT IN (SELECT checkpoint_id FROM checkpoints WHERE role = 'base')"),
    ("family_tensors", "base_id NOT IN (SELECT checkpoint_id FROM checkpoints WHERE role = 'base')"),
    ("checkpoints", "role = 'expert' AND base_id NOT IN (SELECT checkpoint_id FROM checkpoints WHERE role = 'base')"),
    ("plan_experts", "plan_id NOT IN (SELECT plan_id FROM plans)"),
    ("plan_experts", "checkpoint_id NOT IN (SELECT checkpoint_id FROM checkpoints WHERE role = 'expert')"),
    ("plan_mask_bits", "plan_id NOT IN (SELECT plan_id FROM plans)"),
    ("plan_thresholds", "plan_id NOT IN (SELECT plan_id FROM plans)"),
    ("plan_tensor_params", "plan_id NOT IN (SELECT plan_id FROM plans)"),
    ("plans", "base_id NOT IN (SELECT checkpoint_id FROM checkpoints WHERE role = 'base')"),
    ("runs", "plan_id NOT IN (SELECT plan_id FROM plans)"),
    ("scores", "plan_id NOT IN (SELECT plan_id FROM plans)"),
]
# a plan's rows keyed by these columns have no index that refuses a repeat (schema/010, 013): the
# planner writes each once, and `check` makes sure
_KEYS = [
    ("plan_experts", "plan_id, position"),
    ("plan_thresholds", "plan_id, checkpoint_id, tensor_idx"),
    ("plan_mask_bits", "plan_id, checkpoint_id, tensor_idx"),
]


def check_catalog(
    cat: Catalog,
    deep: bool = False,
    progress: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> list[Problem]:
    """Verify the catalog against itself and the files: orphaned or missing rows, missing or
    changed files, and with `deep` every block's bytes against its registered hash and every plan's
    rows against its hash. With `deep`, `on_total(n)` is told the registered bytes to re-read first,
    then `progress(k)` each block's bytes as they are hashed (a read as long as registering them)."""
    problems: list[Problem] = []
    with cat.duckdb_connection() as con:
        for table, cond in _ORPHANS:
            n = con.execute(f"SELECT count(*) FROM {table} WHERE {cond}").fetchall()[0][0]
            if n:
                problems.append(Problem(f"table {table}", f"{n} orphaned rows", "re-create the catalog from the files"))
        for table, key in _KEYS:
            n = con.execute(f"SELECT count(*) FROM (SELECT {key} FROM {table} GROUP BY ALL HAVING count(*) > 1)")
            if n := n.fetchall()[0][0]:
                problems.append(
                    Problem(f"table {table}", f"{n} ({key}) keys on more than one row", "plan the affected plans again")
                )
        pids = con.execute("SELECT plan_id FROM plans ORDER BY plan_id").fetchall() if deep else []
        for (pid,) in pids:  # ~20 ms a plan: its rows against its hash (planhash.refuse_altered), its blocks
            try:
                plans.execution_plan(con, pid, merge=False)
            except CatalogError as e:
                problems.append(Problem(f"plan {pid}", str(e), "make the plan again"))
            except MergeDBError:  # an expert re-registered since: a stale plan, not a damaged one
                continue
        short = con.execute(
            "SELECT c.name, count(eb.block_idx), (SELECT count(*) FROM blocks bl JOIN family_tensors ft "
            "USING (base_id, tensor_idx) WHERE bl.base_id = c.base_id AND ft.mergeable) "
            "FROM checkpoints c LEFT JOIN expert_blocks eb USING (checkpoint_id) WHERE c.role = 'expert' "
            "GROUP BY c.name, c.base_id HAVING count(eb.block_idx) != (SELECT count(*) FROM blocks bl "
            "JOIN family_tensors ft USING (base_id, tensor_idx) WHERE bl.base_id = c.base_id AND ft.mergeable)"
        ).fetchall()
        for name, have, want in short:
            problems.append(
                Problem(
                    f"checkpoint {name}",
                    f"{have} block statistics rows, expected {want}",
                    f"mergedb register --refresh {name}'s path",
                )
            )
        ckpts = con.execute("SELECT checkpoint_id, name, path, fingerprint, role, base_id FROM checkpoints").fetchall()
        hashes = {}
        if deep:
            for cid, _, _, _, role, base_id in ckpts:
                if role == "base":
                    hashes[cid] = con.execute(
                        "SELECT ft.name, bl.block_idx, bl.byte_start, bl.nbytes, bl.base_hash FROM blocks bl "
                        "JOIN family_tensors ft USING (base_id, tensor_idx) WHERE bl.base_id = ?",
                        [cid],
                    ).fetchall()
                else:
                    hashes[cid] = con.execute(
                        "SELECT ft.name, bl.block_idx, bl.byte_start, bl.nbytes, eb.content_hash FROM expert_blocks eb "
                        "JOIN blocks bl ON bl.base_id = ? AND bl.tensor_idx = eb.tensor_idx "
                        "AND bl.block_idx = eb.block_idx "
                        "JOIN family_tensors ft ON ft.base_id = bl.base_id AND ft.tensor_idx = bl.tensor_idx "
                        "WHERE eb.checkpoint_id = ?",
                        [base_id, cid],
                    ).fetchall()
    if deep and on_total is not None:
        on_total(sum(r[3] for rows in hashes.values() for r in rows))
    for cid, name, path, fp, role, _ in ckpts:
        if is_adapter(path):  # a LoRA adapter: its files against the fingerprint (no block rehash yet)
            try:
                same = adapter_fingerprint(path) == fp
            except MergeDBError as e:
                problems.append(Problem(f"checkpoint {name}", f"cannot be read: {e}", "restore the adapter folder"))
                continue
            if not same:
                problems.append(
                    Problem(
                        f"checkpoint {name}",
                        f"files at {path} changed since registration",
                        "mergedb register --refresh",
                    )
                )
            continue
        try:
            ckpt = open_checkpoint(path, name=name)
        except MergeDBError as e:
            problems.append(
                Problem(
                    f"checkpoint {name}",
                    f"cannot be read: {e}",
                    "restore it, or if it moved, register it where it is now under the same name",
                )
            )
            continue
        if ckpt.fingerprint != fp:
            problems.append(
                Problem(
                    f"checkpoint {name}",
                    f"files at {path} changed since registration",
                    "mergedb register --refresh (an expert; a base whose files only changed times, with --base)"
                    " or register a base whose bytes changed under a new name",
                )
            )
            continue
        if deep:
            problems += _rehash(ckpt, hashes[cid], role == "base", progress)
    return problems


def _rehash(
    ckpt: Checkpoint, rows: list[tuple], base: bool = False, progress: Callable[[int], None] | None = None
) -> list[Problem]:
    where = {t.name: (fi, t) for fi, t in ckpt.tensors}
    out = []
    group = Sources()
    try:
        srcs = [group.open(ckpt.root / f.relpath) for f in ckpt.files]
        for tensor, block, start, nbytes, want in rows:
            fi, t = where[tensor]
            buf = np.empty(nbytes, np.uint8)
            srcs[fi].read_into(memoryview(buf), t.start + start)
            if progress is not None:
                progress(nbytes)
            if xxhash.xxh3_128_hexdigest(buf) != want:
                out.append(
                    Problem(
                        f"checkpoint {ckpt.name}",
                        f"block {block} of {tensor!r} differs from its registered hash",
                        "the file was modified in place: restore it, or register the new base and its experts in "
                        "a new catalog (--catalog NEW.duckdb)"
                        if base
                        else f"the file was modified in place: restore it or mergedb register {ckpt.path} --refresh "
                        f"--name {ckpt.name}",
                    )
                )
    finally:
        group.close()
    return out


def _loader_reads(name: str) -> bool:
    """A file transformers reads from a model folder beside the weights, by name (a tokenizer, config or
    chat template; not code, which only auto_map names, nor a licence)."""
    return is_side_name(name) and not name.endswith(".py") and not name.startswith("LICENSE")


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".index.json")  # what loaders read


def check_output(folder: str | os.PathLike[str]) -> list[str]:
    """Problems of a merged output against its manifest (empty when it is intact)."""
    if not isinstance(folder, (str, os.PathLike)):  # Path(None) was a bare TypeError
        raise MergeDBError(f"check_output() takes an output folder (str or Path), got {type(folder).__name__}")
    folder = Path(folder)
    if folder.name == manifest.MANIFEST and folder.is_file():  # its manifest named: the output is its folder
        folder = folder.parent
    path = folder / manifest.MANIFEST
    if not path.is_file():
        return [f"{folder}: no {manifest.MANIFEST}: not a complete mergedb output"]
    try:
        doc = json.loads(read_small(path))
        hashed = manifest.content_hash(doc) if isinstance(doc, dict) else None
    except OSError as e:
        return [f"{path}: cannot be read ({e.strerror})"]
    except ValueError as e:
        return [f"{path}: not valid JSON ({e})"]
    except RecursionError:
        return [f"{path}: its JSON nests too deeply; not a manifest mergedb wrote"]
    if not isinstance(doc, dict):
        return [f"{path}: not a mergedb manifest"]
    problems = []
    if hashed != doc.get("content_hash"):
        problems.append(f"{path}: content_hash does not match the manifest's contents (edited?)")
    elif sealed := manifest.run_problem(doc):
        problems.append(f"{path}: {sealed}")
    mask = None
    try:
        mask = manifest.read_mask(folder / manifest.MASK, doc)  # its digest is checked by manifest_problems
    except (OSError, ValueError, KeyError, TypeError) as e:
        problems.append(f"{folder / manifest.MASK}: cannot be read ({e})")
    invalid = manifest.manifest_problems(doc, mask)
    if invalid:  # an edited manifest: report it, and hash nothing against fields that cannot be trusted
        return [*problems, f"{path}: {invalid[0]}"]
    seen, where, sizes = {}, {}, {}
    shapes = {t["name"]: tuple(t["shape"]) for t in doc["layout"]}
    # the dtype each tensor is written in: the output's for a merged tensor, else its own (layout.output_dtype)
    dtypes = {t["name"]: (doc.get("dtype") or t["dtype"]) if t["mergeable"] else t["dtype"] for t in doc["layout"]}
    run = doc.get("run")
    # run.files and run.side_files are not under the content hash: only plain names in the folder
    # are looked at (an edited manifest could name ../../anything)
    for name in run.get("files") if isinstance(run, dict) and isinstance(run.get("files"), list) else []:
        if not outdir.ours(name):
            problems.append(f"{path}: run.files names {name!r}, not a file mergedb writes in an output (edited?)")
        elif not ((folder / name).is_dir() if name == TEMPLATES else (folder / name).is_file()):
            problems.append(f"{folder}: {name} is missing (the manifest lists it among the output's files)")
    side = run.get("side_files") if isinstance(run, dict) and isinstance(run.get("side_files"), dict) else {}
    for name, want in side.items():  # config, tokenizer: sha256 as written (outputs since run.side_files)
        if not is_side_name(name):
            problems.append(f"{path}: run.side_files names {name!r}, not a side file mergedb copies (edited?)")
            continue
        f = folder / name
        if f.is_file() and hashlib.sha256(f.read_bytes()).hexdigest() != want:
            problems.append(f"{f}: differs from the file the output was written with")
    listed = run.get("files") if isinstance(run, dict) and isinstance(run.get("files"), list) else None
    if listed is not None and not all(isinstance(n, str) for n in listed):  # a set of them raised TypeError
        problems.append(f"{path}: run.files holds entries that are not file names (edited?)")
        listed = [n for n in listed if isinstance(n, str)]
    weights = sorted(p for p in folder.iterdir() if p.name.endswith(_WEIGHT_SUFFIXES))  # a pipe too: named
    if listed is not None:  # only the output's own files are what it serves; others are named
        for p in weights:
            if p.name not in listed:
                problems.append(
                    f"{p}: weights that are not part of this output (its manifest does not list them); a loader "
                    "could read them instead of the output's: move them out"
                )
        weights = [p for p in weights if p.name in listed]
        loaded = [p.name for p in folder.iterdir() if _loader_reads(p.name)]
        if (folder / TEMPLATES).is_dir():
            loaded += [f"{TEMPLATES}/{p.name}" for p in (folder / TEMPLATES).iterdir()]
        listed_side = set(listed) | (set(side) if isinstance(side, dict) else set())
        for name in sorted(n for n in loaded if n not in listed_side):
            problems.append(
                f"{folder / name}: not part of this output (its manifest does not list it), but a loader reads it "
                "with the output (a tokenizer, config or chat template): move it out"
            )
    for f in (p for p in weights if p.name.endswith(".safetensors")):
        try:
            h = read_header(f)
        except MergeDBError as e:
            problems.append(str(e))
            continue
        if h.metadata != PT_METADATA:  # a loader reads it: "tf" or none, and transformers refuses or misreads
            problems.append(f"{f}: its __metadata__ is {h.metadata}, not the {PT_METADATA} it was written with")
        with open(f, "rb") as fh:
            for t in h.tensors:
                if t.name in shapes and t.shape != shapes[t.name]:
                    problems.append(
                        f"{f}: tensor {t.name!r} has shape {list(t.shape)}, the manifest says {list(shapes[t.name])}"
                    )
                if t.name in dtypes and t.dtype != dtypes[t.name] and doc.get("lora") is None:
                    problems.append(f"{f}: tensor {t.name!r} is {t.dtype}, the manifest says {dtypes[t.name]}")
                where[t.name] = f.name
                sizes[t.name] = t.nbytes
                fh.seek(t.start)
                seen[t.name] = xxhash.xxh3_128_hexdigest(fh.read(t.nbytes))
    index = folder / INDEX
    if index.is_file() or len(set(where.values())) > 1:  # shards: the index must send each tensor to its file
        try:
            idoc = jsondoc.parse(read_small(index))
            wmap, total = idoc["weight_map"], idoc.get("metadata", {}).get("total_size")
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            wmap, total = None, None
        if not isinstance(wmap, dict) or {n: wmap.get(n) for n in where} != where:
            problems.append(f"{index}: missing, or its weight_map does not say which shard holds each tensor")
        elif set(wmap) != set(where):  # a loader opens every shard the map names: one not there fails to load
            extra = sorted(set(wmap) - set(where))
            problems.append(f"{index}: its weight_map names tensors no shard of the output holds: {extra[:3]}")
        held = sum(sizes.values())
        if wmap is not None and total is not None and total != held:
            problems.append(f"{index}: metadata.total_size is {total!r}, the shards' tensors hold {held}")
    lora = doc.get("lora")  # an --as-lora output (loraout.py): its adapter keys are hashed there
    if isinstance(lora, dict) and isinstance(lora.get("config"), dict):  # its scaling lives in the config
        try:
            written = jsondoc.parse(read_small(folder / ADAPTER_CONFIG))
        except (OSError, ValueError):
            written = None
        if written != lora["config"]:
            problems.append(f"{folder / ADAPTER_CONFIG}: missing, or not the config the manifest records")
    want_hashes = lora["key_hashes"] if isinstance(lora, dict) and isinstance(lora.get("key_hashes"), dict) else None
    wanted = want_hashes or doc.get("tensor_hashes", {})
    for name, want in wanted.items():
        if name not in seen:
            problems.append(f"{folder}: tensor {name!r} is missing")
        elif seen[name] != want:
            problems.append(f"{folder}: tensor {name!r} differs from the manifest")
    for name in sorted(set(seen) - set(wanted)):  # bytes the manifest does not describe, in the output's own files
        problems.append(f"{folder / where[name]}: tensor {name!r} is not in the manifest (added since it was written?)")
    return problems
