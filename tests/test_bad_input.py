"""Each bad input: a MergeDBError naming the file/tensor and the fix, non-zero exit, catalog unchanged."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import duckdb
import numpy as np
import pytest
from typer.testing import CliRunner

from mergedb import synth
from mergedb.catalog import Catalog
from mergedb.cli import app
from mergedb.errors import AlignmentError, CatalogError, FormatError, MergeDBError
from mergedb.planner import PlanRequest
from mergedb.tensorfile import read_header

TABLES = ["checkpoints", "files", "family_tensors", "tensors", "blocks", "expert_blocks", "expert_tensors"]


def snapshot(cat: Catalog) -> dict:
    return {t: sorted(map(str, cat.sql(f"SELECT * FROM {t}").to_pylist())) for t in TABLES}


@pytest.fixture
def setup(tmp_path):
    """A catalog holding a registered base, and a folder for bad experts."""
    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=5)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam / "base"], base=True, block_size="64KiB")
    return fam, cat, tmp_path


def raw_file(path: Path, header: dict, data: bytes, header_len: int | None = None) -> Path:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if header_len is None else header_len) + blob + data)
    return path


def register_fails(cat, path, exc, *needles, **kw):
    before = snapshot(cat)
    with pytest.raises(exc) as info:
        cat.register([path], base_model="base", **kw)
    msg = str(info.value)
    for n in needles:
        assert n in msg, msg
    assert snapshot(cat) == before
    # and through the CLI: one clear line, exit code 1, no traceback
    res = CliRunner().invoke(app, ["register", str(path), "--base-model", "base", "-c", str(cat.path), "-q"])
    assert res.exit_code == 1, res.output
    assert "Error:" in res.output and "Traceback" not in res.output
    assert snapshot(cat) == before
    return msg


def test_not_a_safetensors_file(setup):
    fam, cat, tmp = setup
    p = tmp / "notes.safetensors"
    p.write_text("hello, this is not a model" * 10)
    register_fails(cat, p, FormatError, str(p), "header length")


def test_truncated_file(setup):
    fam, cat, tmp = setup
    p = tmp / "trunc.safetensors"
    data = (fam / "expert_00" / "model.safetensors").read_bytes()
    p.write_bytes(data[: len(data) - 1000])
    register_fails(cat, p, FormatError, str(p), "truncated")


def test_file_shorter_than_length_prefix(setup):
    fam, cat, tmp = setup
    p = tmp / "short.safetensors"
    p.write_bytes(b"\x01\x02")
    register_fails(cat, p, FormatError, "too short")


def test_header_longer_than_file(setup):
    fam, cat, tmp = setup
    p = raw_file(tmp / "long.safetensors", {}, b"", header_len=5000)
    register_fails(cat, p, FormatError, "runs past the end")


def test_absurd_header_length(setup):
    fam, cat, tmp = setup
    p = raw_file(tmp / "absurd.safetensors", {}, b"", header_len=2**62)
    register_fails(cat, p, FormatError, "exceeds")


def test_header_not_json(setup):
    fam, cat, tmp = setup
    p = tmp / "nojson.safetensors"
    p.write_bytes(struct.pack("<Q", 5) + b"{abc]")
    register_fails(cat, p, FormatError, "not valid JSON")


def test_offsets_out_of_range(setup):
    fam, cat, tmp = setup
    p = raw_file(tmp / "oor.safetensors", {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8)
    register_fails(cat, p, FormatError, "truncated")


def test_overlapping_offsets(setup):
    fam, cat, tmp = setup
    h = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    p = raw_file(tmp / "overlap.safetensors", h, b"\0" * 12)
    register_fails(cat, p, FormatError, "overlaps", "'b'")


def test_gap_between_tensors(setup):
    fam, cat, tmp = setup
    h = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]},
    }
    p = raw_file(tmp / "gap.safetensors", h, b"\0" * 20)
    register_fails(cat, p, FormatError, "gap", "'b'")


def test_unknown_dtype(setup):
    fam, cat, tmp = setup
    p = raw_file(tmp / "dt.safetensors", {"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, b"\0" * 16)
    register_fails(cat, p, FormatError, "unknown dtype", "'F128'")


def test_shape_times_dtype_mismatch(setup):
    fam, cat, tmp = setup
    p = raw_file(tmp / "sz.safetensors", {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, b"\0" * 16)
    register_fails(cat, p, FormatError, "needs 12 bytes", "'w'")


def _sharded_expert(fam: Path, tmp: Path, name: str) -> Path:
    d = tmp / name
    synth.make_family(tmp / f"{name}-src", experts=1, size="tiny", seed=5, shard_size=700_000)
    shutil.copytree(tmp / f"{name}-src" / "expert_00", d)
    return d


def test_index_path_traversal(setup):
    fam, cat, tmp = setup
    d = _sharded_expert(fam, tmp, "trav")
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    first = next(iter(idx["weight_map"]))
    shutil.copy(d / idx["weight_map"][first], tmp / "outside.safetensors")
    idx["weight_map"][first] = "../outside.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    register_fails(cat, d, FormatError, "outside the checkpoint folder", first)


def test_index_symlink_out_of_folder(setup):
    fam, cat, tmp = setup
    d = _sharded_expert(fam, tmp, "link")
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    shard = sorted(set(idx["weight_map"].values()))[0]
    shutil.move(d / shard, tmp / "elsewhere.safetensors")
    (d / shard).symlink_to(tmp / "elsewhere.safetensors")
    register_fails(cat, d, FormatError, "outside the checkpoint folder")


def test_index_missing_shard(setup):
    fam, cat, tmp = setup
    d = _sharded_expert(fam, tmp, "miss")
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    shard = sorted(set(idx["weight_map"].values()))[-1]
    (d / shard).unlink()
    register_fails(cat, d, FormatError, "missing shard", shard)


def test_tensor_in_two_shards(setup):
    fam, cat, tmp = setup
    d = _sharded_expert(fam, tmp, "dup")
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    s1, s2 = sorted(set(idx["weight_map"].values()))[:2]
    h1, h2 = read_header(d / s1), read_header(d / s2)
    # rewrite shard 2 with shard 1's first tensor added
    from mergedb.tensorfile import SafetensorsWriter

    extra = h1.tensors[0]
    with open(d / s1, "rb") as f:
        f.seek(extra.start)
        extra_bytes = f.read(extra.nbytes)
    entries = [(t.name, t.dtype, t.shape) for t in h2.tensors] + [(extra.name, extra.dtype, extra.shape)]
    datas = []
    with open(d / s2, "rb") as f:
        for t in h2.tensors:
            f.seek(t.start)
            datas.append(f.read(t.nbytes))
    with SafetensorsWriter(d / s2, entries) as w:
        for (n, _, _), b in zip(entries, datas + [extra_bytes]):
            w.write(n, b)
    register_fails(cat, d, FormatError, extra.name, "remove one copy")


def _variant(fam: Path, tmp: Path, name: str, change) -> Path:
    from safetensors.torch import load_file, save_file

    d = tmp / name
    shutil.copytree(fam / "expert_00", d)
    tensors = load_file(str(d / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def test_expert_shape_mismatch(setup):
    fam, cat, tmp = setup
    d = _variant(fam, tmp, "shape", lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"][:-1].clone()))
    register_fails(cat, d, AlignmentError, "model.norm.weight", "--base-model")


def test_expert_dtype_mismatch(setup):
    import torch

    fam, cat, tmp = setup
    d = _variant(
        fam, tmp, "dtype", lambda t: t.__setitem__("model.norm.weight", t["model.norm.weight"].to(torch.float16))
    )
    register_fails(cat, d, AlignmentError, "model.norm.weight", "F16")


def test_expert_missing_tensor(setup):
    fam, cat, tmp = setup
    d = _variant(fam, tmp, "missing", lambda t: t.pop("lm_head.weight"))
    register_fails(cat, d, AlignmentError, "missing tensor 'lm_head.weight'")


@pytest.mark.parametrize("tied", ["expert", "base"])
def test_tied_and_untied_output_heads_are_named_as_such(tmp_path, tied):
    """A fine-tune that transformers saved with tie_word_embeddings=True stores no lm_head.weight: the
    refusal names the different tying and how to save both alike, not a wrong base."""
    import torch
    import transformers
    from safetensors import safe_open

    folders = {}
    for name in ("base", "expert"):
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, tie_word_embeddings=name == tied,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / name)
        folders[name] = tmp_path / name
    with safe_open(folders[tied] / "model.safetensors", "pt") as f:  # transformers' own file lacks the head
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([folders["base"]], base=True, name="base")
    msg = register_fails(cat, folders["expert"], AlignmentError, "lm_head.weight", "different tie_word_embeddings")
    assert "model.save_pretrained" in msg and "fine-tuned from" not in msg
    # without the config's word for it, an output head beside the shared input embeddings says the same
    doc = json.loads((folders[tied] / "config.json").read_text())
    (folders[tied] / "config.json").write_text(json.dumps({**doc, "tie_word_embeddings": None}))
    if tied == "expert":
        register_fails(cat, folders["expert"], AlignmentError, "different tie_word_embeddings")


def test_nonfinite_expert_recorded(setup):
    import torch

    fam, cat, tmp = setup

    def poison(t):
        w = t["model.layers.0.mlp.up_proj.weight"].clone()
        w[3, 5] = float("nan")
        w[7, 1] = float("inf")
        t["model.layers.0.mlp.up_proj.weight"] = w.to(torch.bfloat16)

    d = _variant(fam, tmp, "poison", poison)
    cat.register([d], base_model="base")
    row = cat.sql("SELECT nonfinite FROM expert_costs WHERE expert = 'poison'").to_pylist()
    assert row == [{"nonfinite": 2}]
    blk = cat.sql(
        "SELECT ft.name, eb.nonfinite FROM expert_blocks eb JOIN family_tensors ft USING (tensor_idx) "
        "WHERE eb.nonfinite > 0"
    ).to_pylist()
    assert blk == [{"name": "model.layers.0.mlp.up_proj.weight", "nonfinite": 2}]


def test_unknown_base_model(setup):
    fam, cat, tmp = setup
    before = snapshot(cat)
    with pytest.raises(CatalogError, match="unknown --base-model 'nope'.*registered bases: base"):
        cat.register([fam / "expert_00"], base_model="nope")
    assert snapshot(cat) == before


def test_catalog_locked_by_another_process(setup):
    fam, cat, tmp = setup
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import duckdb, sys, time
            con = duckdb.connect({str(cat.path)!r})
            print("locked", flush=True)
            time.sleep(30)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        t0 = time.monotonic()
        with pytest.raises(CatalogError, match=rf"locked by process {holder.pid}.*--wait"):
            Catalog(cat.path, wait=0.5).register([fam / "expert_00"], base_model="base")
        assert time.monotonic() - t0 >= 0.5
        res = CliRunner().invoke(app, ["ls", "-c", str(cat.path)])
        assert res.exit_code == 1 and "locked" in res.output and "Traceback" not in res.output
        assert "or pass --wait SECONDS" in res.output
        # a --wait that ran out says so (it advised passing --wait after --wait 3 was spent)
        res = CliRunner().invoke(app, ["ls", "-c", str(cat.path), "--wait", "0.3"])
        assert res.exit_code == 1 and "still locked by process" in res.output and "after waiting 0.3 s" in res.output
    finally:
        holder.kill()
        holder.wait()
    assert cat.checkpoints()[0].name == "base"


def test_newer_schema_refused(setup):
    import duckdb

    fam, cat, tmp = setup
    con = duckdb.connect(str(cat.path))
    con.execute("INSERT INTO schema_version VALUES (999, '999_future', current_timestamp)")
    con.close()
    with pytest.raises(CatalogError, match="newer mergedb"):
        cat.checkpoints()
    with pytest.raises(CatalogError, match="newer mergedb"):
        cat.register([fam / "expert_00"], base_model="base")


def test_a_schema_version_table_of_someone_elses_is_refused_and_left_alone(tmp_path):
    """A DuckDB file whose schema_version table does not start with mergedb's first migration is
    another tool's file: refused, never migrated, even when its versions are all below mergedb's."""
    import duckdb

    path = tmp_path / "theirs.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, name VARCHAR NOT NULL)")
    con.execute("INSERT INTO schema_version VALUES (1, '001_their_tables'), (2, '002_more')")
    con.execute("CREATE TABLE settings (key VARCHAR, value VARCHAR)")  # as a catalog has
    con.execute("INSERT INTO settings VALUES ('sketch_dim', '64')")
    con.close()
    before = path.read_bytes()
    for call in (lambda c: c.checkpoints(), lambda c: c.plans()):
        with pytest.raises(CatalogError, match="does not start with mergedb's"):
            call(Catalog(path))
    assert path.read_bytes() == before


def test_bad_block_size_and_names(setup):
    fam, cat, tmp = setup
    with pytest.raises(MergeDBError, match="--base registers PATHS as bases; --base-model names"):
        cat.register([fam / "base"], base=True, base_model="zzz")  # was silently ignored
    with pytest.raises(MergeDBError, match="e.g. 4MiB"):
        cat.register([fam / "expert_00"], base_model="base", block_size="lots")
    with pytest.raises(MergeDBError, match="one checkpoint"):
        cat.register([fam], base_model="base", name="x")


def test_nan_name_rejected(tmp_path):
    p = raw_file(
        tmp_path / "nul.safetensors",
        {"a\u0000b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
        np.zeros(1, np.float32).tobytes(),
    )
    with pytest.raises(FormatError, match="NUL"):
        read_header(p)


@pytest.mark.parametrize("dim", [0, -1, 2**15 + 1, 2.5, "64"])
def test_sketch_dim_out_of_range_refused_before_anything_is_written(tmp_path, dim):
    """A sketch dimension the statistics kernel cannot encode is refused when the Catalog is made."""
    with pytest.raises(CatalogError, match="sketch_dim must be a whole number from 1 to 32768: "):
        Catalog(tmp_path / "c.duckdb", sketch_dim=dim)
    assert not (tmp_path / "c.duckdb").exists()


def _no_catalog(path: Path) -> None:
    assert not path.exists() and not Path(f"{path}.wal").exists(), sorted(p.name for p in path.parent.iterdir())


def test_a_refused_first_registration_leaves_no_catalog(tmp_path):
    """Refused before anything is read (an unknown base), while reading (a truncated expert) or while
    writing the rows: a registration into a new catalog leaves no file behind, by the library and
    through the CLI; the same registration, corrected, makes the catalog."""
    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=5)
    path = tmp_path / "new.duckdb"
    with pytest.raises(CatalogError, match="unknown --base-model 'bse'"):
        Catalog(path).register([fam], base_model="bse")
    _no_catalog(path)
    res = CliRunner().invoke(app, ["register", str(fam), "--base-model", "bse", "-c", str(path), "-q"])
    assert res.exit_code == 1 and "unknown --base-model" in res.output, res.output
    _no_catalog(path)

    bad = tmp_path / "bad"
    shutil.copytree(fam, bad)
    data = (bad / "expert_00" / "model.safetensors").read_bytes()
    (bad / "expert_00" / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(FormatError, match="truncated"):
        Catalog(path).register([bad], base_model="base")
    _no_catalog(path)

    assert Catalog(path).register([fam], base_model="base").registered == ("base", "expert_00")
    assert [c.name for c in Catalog(path).checkpoints()] == ["base", "expert_00"]


def test_a_first_registration_failing_while_writing_leaves_no_catalog(tmp_path, monkeypatch):
    from mergedb import staging

    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=5)

    def fail(*a, **k):
        raise OSError("simulated failure while writing the rows")

    monkeypatch.setattr(staging.Stage, "insert", fail)  # an expert's rows, inside the transaction
    path = tmp_path / "new.duckdb"
    with pytest.raises(OSError, match="simulated"):
        Catalog(path).register([fam], base_model="base")
    _no_catalog(path)
    # an empty DuckDB file (someone's `duckdb.connect(path)`) is not migrated by a registration that
    # fails, whether it is refused before writing or while writing: its bytes stay as they were
    duckdb.connect(str(path)).close()
    before = path.read_bytes()
    with pytest.raises(MergeDBError, match="which base"):
        Catalog(path).register([fam / "expert_00"])
    with pytest.raises(OSError, match="simulated"):
        Catalog(path).register([fam], base_model="base")
    assert path.read_bytes() == before
    assert not duckdb.connect(str(path), read_only=True).sql("SHOW TABLES").fetchall()
    # a catalog that was there before, even one with no checkpoint yet, stays
    cat = Catalog(path)
    with cat.duckdb_connection(write=True, create=True) as con:
        con.execute("BEGIN")
        cat.make_if_blank(con)
        con.execute("COMMIT")
    with pytest.raises(OSError, match="simulated"):
        Catalog(path).register([fam], base_model="base")
    assert path.exists() and Catalog(path).checkpoints() == []
    monkeypatch.undo()
    assert Catalog(path).register([fam], base_model="base").registered == ("base", "expert_00")


def test_a_new_catalog_in_a_missing_folder_is_refused_before_reading(tmp_path, monkeypatch):
    from mergedb import scan

    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=5)
    monkeypatch.setattr(scan, "layout", lambda *a, **k: pytest.fail("read before the catalog's folder was checked"))
    folder = tmp_path / "no" / "such"
    path = folder / "c.duckdb"
    with pytest.raises(CatalogError, match=rf"cannot create catalog .*c.duckdb: its folder {folder} does not exist"):
        Catalog(path).register([fam], base_model="base")
    assert not (tmp_path / "no").exists()


def test_odd_references_and_waits_get_one_line_errors(setup):
    """A plan reference of non-ASCII digits, an --out name longer than the file system allows, a
    --wait that is NaN or negative, a catalog path with no catalog: each a one-line error, exit 1,
    never a traceback, and `ls` no longer reports a mistyped catalog as an empty one."""
    fam, cat, tmp = setup
    cat.register([fam / "expert_00"], base_model="base")
    cat.plan(PlanRequest("base", None, "linear", "all"))
    for args, words in (
        (["show-plan", "²"], "no plan matching '²'"),
        (["execute", "²", "--out", str(tmp / "o")], "no plan matching '²'"),
        (["execute", "1", "--out", str(tmp / ("n" * 300))], "File name too long"),
        (["plans", "--wait", "nan"], "--wait must be a number of seconds ≥ 0"),
        (["plans", "--wait", "-5"], "--wait must be a number of seconds ≥ 0"),
    ):
        res = CliRunner().invoke(app, [*args, "-c", str(cat.path)])
        assert res.exit_code == 1 and words in " ".join(res.output.split()), (args, res.output)
        assert res.exception is None or isinstance(res.exception, SystemExit), (args, res.exception)
    res = CliRunner().invoke(app, ["ls", "-c", str(tmp / "typo.duckdb")])
    assert res.exit_code == 1 and "no catalog at" in res.output, res.output
    assert not (tmp / "typo.duckdb").exists()


def test_the_same_files_under_a_second_name_are_refused(setup):
    """An expert registered again under another name (its file instead of its folder, or --name)
    would be a second expert with the same delta, counted twice by every plan over all experts."""
    fam, cat, tmp = setup
    cat.register([fam / "expert_00"], base_model="base")
    before = snapshot(cat)
    for paths, kw in (
        ([fam / "expert_00" / "model.safetensors"], {"name": "again"}),
        ([fam / "expert_00"], {"name": "again"}),
    ):
        with pytest.raises(CatalogError, match="holds the files of expert 'expert_00', registered under that name"):
            cat.register(paths, base_model="base", **kw)
        assert snapshot(cat) == before
    # its file alone is named after its folder (model.safetensors): the same checkpoint, unchanged
    assert cat.register([fam / "expert_00" / "model.safetensors"], base_model="base").unchanged == ("expert_00",)
    assert snapshot(cat) == before
    # changed in place, then registered under a new name: the old name went stale and no --refresh could
    # fix the family afterwards (both names pointed at one folder); now the re-scan is what it asks for
    src = fam / "expert_00" / "model.safetensors"
    data = bytearray(src.read_bytes())
    data[-2:] = bytes([data[-2] ^ 1, data[-1]])
    src.write_bytes(bytes(data))
    with pytest.raises(CatalogError, match="registered as expert 'expert_00' and its files changed since; re-scan"):
        cat.register([fam / "expert_00"], base_model="base", name="again")
    assert snapshot(cat) == before
    assert cat.register([fam / "expert_00"], base_model="base", refresh=True).registered == ("expert_00",)
    copy = tmp / "copy"
    shutil.copytree(fam / "expert_00", copy)  # a copy elsewhere (times kept) is the same model: refused too
    with pytest.raises(CatalogError, match="copy holds the same weights as expert 'expert_00'"):
        cat.register([copy], base_model="base")
    assert cat.register([fam / "expert_00"], base_model="base").unchanged == ("expert_00",)


def test_a_json_file_as_catalog_is_not_a_duckdb_file(setup):
    """DuckDB opens a .json path as data (an in-memory database over it) instead of refusing it."""
    fam, cat, tmp = setup
    for cmd in (["plans"], ["ls"], ["sql", "SELECT 1"]):
        res = CliRunner().invoke(app, [*cmd, "-c", str(fam / "base" / "config.json")])
        assert res.exit_code == 1 and "is not a DuckDB file, so not a mergedb catalog" in res.output, res.output
