"""Registration semantics: idempotent, incremental, atomic, change detection."""

from __future__ import annotations

import os
import re
import shutil

import pytest

from mergedb import synth
from mergedb.catalog import Catalog, connect
from mergedb.errors import ChangedFileError, MergeDBError
from tests.test_bad_input import snapshot


def test_idempotent_and_incremental(tmp_path):
    fam = synth.make_family(tmp_path / "fam", experts=3, size="tiny", seed=11)
    cat = Catalog(tmp_path / "c.duckdb")
    r1 = cat.register([fam / "base", fam / "expert_00", fam / "expert_01"], base_model="base")
    assert r1.registered == ("base", "expert_00", "expert_01")
    before = snapshot(cat)
    r2 = cat.register([fam / "base", fam / "expert_00", fam / "expert_01"], base_model="base")
    assert r2.registered == () and r2.bytes_read == 0
    assert set(r2.unchanged) == {"base", "expert_00", "expert_01"}
    assert snapshot(cat) == before
    # expert K+1: reads only it and the base blocks it needs
    e2_bytes = sum(t.nbytes for _, t in __import__("mergedb").checkpoint.open_checkpoint(fam / "expert_02").tensors)
    r3 = cat.register([fam], base_model="base")
    assert r3.registered == ("expert_02",)
    assert r3.bytes_read == 2 * e2_bytes
    assert [c.name for c in cat.checkpoints()] == ["base", "expert_00", "expert_01", "expert_02"]


def test_changed_file_refused_then_refresh(tmp_path):
    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=12)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    norm_before = cat.sql("SELECT delta_norm FROM expert_costs WHERE expert = 'expert_00'").column(0)[0].as_py()
    # replace expert_00 by another family's weights (same layout, different content; expert_01's would be a
    # copy of expert_01, refused as registering one model twice)
    other = synth.make_family(tmp_path / "other", experts=1, size="tiny", seed=13)
    shutil.copy(other / "expert_00" / "model.safetensors", fam / "expert_00" / "model.safetensors")
    before = snapshot(cat)
    with pytest.raises(ChangedFileError, match="expert_00.*--refresh"):
        cat.register([fam], base_model="base")
    assert snapshot(cat) == before
    r = cat.register([fam], base_model="base", refresh=True)
    assert r.registered == ("expert_00",)
    norms = {r["expert"]: r["delta_norm"] for r in cat.sql("SELECT * FROM expert_costs").to_pylist()}
    assert norms["expert_00"] != norm_before


def test_changed_base_refused(tmp_path):
    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=13)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam / "base"], base=True)
    os.utime(fam / "base" / "model.safetensors", ns=(1, 1))
    with pytest.raises(ChangedFileError, match="base 'base'"):
        cat.register([fam / "expert_00"], base_model="base")


def test_failed_registration_leaves_catalog_unchanged(tmp_path, monkeypatch):
    """One transaction: a failure while writing the rows rolls everything back."""
    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=14)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam / "base", fam / "expert_00"], base_model="base")
    before = snapshot(cat)
    from mergedb import staging

    def boom(*a, **k):
        raise OSError("disk on fire")

    monkeypatch.setattr(staging.Stage, "insert", boom)  # an expert's rows, inside the transaction
    with pytest.raises(OSError):
        cat.register([fam], base_model="base")
    assert snapshot(cat) == before


def test_env_var_default_catalog(tmp_path, monkeypatch):
    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=15)
    monkeypatch.setenv("MERGEDB_CATALOG", str(tmp_path / "env.duckdb"))
    connect().register([fam], base_model="base")
    assert (tmp_path / "env.duckdb").exists()
    assert [c.name for c in connect(tmp_path / "env.duckdb").checkpoints()] == ["base", "expert_00"]


def test_single_file_checkpoints_and_sketch_dim(tmp_path):
    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=16)
    files = tmp_path / "files"
    files.mkdir()
    shutil.copy(fam / "base" / "model.safetensors", files / "b.safetensors")
    shutil.copy(fam / "expert_00" / "model.safetensors", files / "e.safetensors")
    cat = Catalog(tmp_path / "c.duckdb", sketch_dim=16)
    cat.register([files / "b.safetensors"], base=True)
    cat.register([files / "e.safetensors"], base_model="b")
    lens = cat.sql("SELECT DISTINCT len(sketch) AS n FROM expert_blocks").column(0).to_pylist()
    assert lens == [16]
    with pytest.raises(MergeDBError, match="dimension 16"):
        Catalog(tmp_path / "c.duckdb", sketch_dim=64).register([files / "e.safetensors"], base_model="b")


def test_missing_catalog_is_clear(tmp_path):
    with pytest.raises(MergeDBError, match="no catalog at .*mergedb register"):
        Catalog(tmp_path / "none.duckdb").sql("SELECT 1")


def test_ambiguous_base_needs_base_model(tmp_path):
    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=17)
    cat = Catalog(tmp_path / "c.duckdb")
    with pytest.raises(MergeDBError, match="--base-model"):
        cat.register([fam / "expert_00"])


def test_refresh_invalidates_old_plans(tmp_path):
    from mergedb.planner import PlanRequest

    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=18)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    old = cat.plan(PlanRequest("base", None, "linear"))
    other = synth.make_family(tmp_path / "other", experts=1, size="tiny", seed=19)
    shutil.copy(other / "expert_00" / "model.safetensors", fam / "expert_00" / "model.safetensors")
    cat.register([fam], base_model="base", refresh=True)
    with pytest.raises(ChangedFileError, match="re-registered after this plan"):
        cat.execution_plan(old.plan_id)
    new = cat.plan(PlanRequest("base", None, "linear"))
    assert cat.execution_plan(new.plan_id).experts[0].name == "expert_00"


def test_refresh_of_the_same_bytes_keeps_old_plans(tmp_path):
    """A family copied without its file times (cp without -p), the old folder deleted, registered again
    with --refresh as advised: every plan made before was refused as "re-registered", though the
    README says its plans execute as before (a base's always did; review, 2026-12-03). Only other
    bytes (test_refresh_invalidates_old_plans) make a plan stale; the same plan writes the same model."""
    from mergedb.planner import PlanRequest

    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=18)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    old = cat.plan(PlanRequest("base", None, "ties", "50%"))
    before = cat.execute(old.plan_id, tmp_path / "before").manifest["tensor_hashes"]
    shutil.copytree(fam, tmp_path / "moved", copy_function=shutil.copy)  # new file times
    shutil.rmtree(fam)
    with pytest.raises(ChangedFileError, match="still execute if its bytes are the same"):
        cat.register([tmp_path / "moved"], base_model="base")
    r = cat.register([tmp_path / "moved"], base_model="base", refresh=True)
    assert r.moved == ("base", "expert_00", "expert_01")
    assert cat.execute(old.plan_id, tmp_path / "after").manifest["tensor_hashes"] == before


@pytest.mark.parametrize(
    "files, words",
    [
        (["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], "but no model.safetensors.index"),
        (["weights.safetensors"], "but no model.safetensors: register a model file by its path"),
        (["adapter_model.safetensors"], "no adapter_config.json"),
        (["adapter_config.json", "adapter_model.bin"], "adapter_model.bin, a pickled adapter"),
        (["pytorch_model.bin", "config.json"], "pytorch_model.bin, weights mergedb does not read"),
        (["pytorch_model-00001-of-00002.bin"], "weights mergedb does not read"),
        (["llama-3-8b.Q4_K_M.gguf"], "weights mergedb does not read"),
        (["model.safetensors/"], "model.safetensors, which is not a file"),  # a folder of that name
    ],
)
def test_a_folder_of_checkpoints_refuses_weights_it_would_skip(tmp_path, files, words):
    """An expert folder among the others whose weights mergedb would not register (shards without
    their index, an adapter without its config, pickled or GGUF weights) was skipped without a word:
    the family registered one expert short. Now refused, naming the folder; the catalog keeps what
    it held. Folders without weights (logs, hidden ones) are still left alone."""
    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=16)
    (fam / "logs").mkdir()
    (fam / "logs" / "events.txt").write_text("step 1\n")
    (fam / "logs" / "training_args.bin").write_bytes(b"\0")  # not weights
    (fam / ".cache").mkdir()
    (fam / ".cache" / "x.safetensors").write_bytes(b"\0")
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")  # logs and .cache: nothing to say
    before = snapshot(cat)
    odd = fam / "expert_07"
    odd.mkdir()
    for f in files:
        if f.endswith("/"):
            (odd / f).mkdir()
        else:
            (odd / f).write_bytes(b"\0" * 8)
    with pytest.raises(MergeDBError, match=words) as e:
        cat.register([fam], base_model="base")
    assert str(odd) in str(e.value) and "move the folder out" in str(e.value)
    assert snapshot(cat) == before


@pytest.mark.parametrize("index", ["missing", "a broken link"])
@pytest.mark.parametrize("where", ["local", "file-url"])
def test_a_sharded_model_named_itself_without_its_index_is_refused(tmp_path, index, where):
    """A model folder of shards whose index is missing (or a broken link), named itself, was taken
    for a folder of single-file checkpoints: each shard registered as a base or expert of its own
    (review, 2026-12-02). The same folder one level down was refused already (the test above)."""
    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=19, shard_size=500_000)
    base = fam / "base"
    assert len(list(base.glob("model-*-of-*.safetensors"))) > 1
    (base / "model.safetensors.index.json").unlink()
    if index == "a broken link":
        (base / "model.safetensors.index.json").symlink_to(tmp_path / "gone.json")
    words = "but no model.safetensors.index.json" if index == "missing" else "index.json, which is not a file"
    cat = Catalog(tmp_path / "c.duckdb")
    with pytest.raises(MergeDBError, match=words) as e:
        cat.register([str(base) if where == "local" else f"file://{base}"], base=True)
    assert "base" in str(e.value)
    assert not (tmp_path / "c.duckdb").exists()  # a refused first registration leaves no catalog


@pytest.mark.parametrize(
    "name, words",
    [
        ("config.json", "not a checkpoint; give a .safetensors file or a model folder"),
        ("pytorch_model.bin", "weights mergedb does not read (pickled or GGUF): save them as safetensors"),
        ("missing.safetensors", "no such file or folder"),
    ],
)
def test_a_path_that_is_no_checkpoint_is_named_for_what_it_is(tmp_path, name, words):
    """`register fam/base/config.json` (a file that is there) said "no such file or folder" (review,
    2026-12-03)."""
    if name != "missing.safetensors":
        (tmp_path / name).write_bytes(b"{}")
    cat = Catalog(tmp_path / "c.duckdb")
    with pytest.raises(MergeDBError, match=f"{name}: {re.escape(words)}"):
        cat.register([tmp_path / name], base=True)
    assert not (tmp_path / "c.duckdb").exists()


def test_a_folder_that_cannot_be_listed_is_refused(tmp_path, monkeypatch):
    """A subfolder this user cannot look into (mode 700, another owner): refused in one line, where
    checking it for model files raised PermissionError with a traceback; a file system's lost+found
    (root's, unreadable to others) is skipped. As root every folder can be read, so looking inside
    these two is made to fail as it does for another user."""
    from pathlib import Path

    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=17)
    locked = [fam / "locked", fam / "lost+found"]
    for d in locked:
        d.mkdir()

    def inside(p) -> bool:
        return any(os.fspath(p).startswith(str(d) + os.sep) or os.fspath(p) == str(d) for d in locked)

    real_listdir, real_is_file = os.listdir, Path.is_file

    def listdir(p="."):
        if inside(p):
            raise PermissionError(13, "Permission denied")
        return real_listdir(p)

    def is_file(self, *a, **k):
        if inside(self.parent):
            raise PermissionError(13, "Permission denied", str(self))
        return real_is_file(self, *a, **k)

    monkeypatch.setattr(os, "listdir", listdir)
    monkeypatch.setattr(Path, "is_file", is_file)
    with pytest.raises(MergeDBError, match=r"fam/locked: cannot be read \(Permission denied\)"):
        Catalog(tmp_path / "c.duckdb").register([fam], base_model="base")
    assert not (tmp_path / "c.duckdb").exists()
    (fam / "locked").rmdir()
    locked.remove(fam / "locked")
    assert Catalog(tmp_path / "c.duckdb").register([fam], base_model="base").registered == ("base", "expert_00")


def test_a_broken_link_as_model_file_and_a_folder_of_adapters_are_checked_too(tmp_path):
    """A model.safetensors that is a dangling link (a Hugging Face cache whose blob was deleted) was
    skipped; so was any odd subfolder of a folder holding only LoRA adapters (that folder never
    reached the check). Both refused now."""
    pytest.importorskip("peft")
    from tests import lora_fixtures as lf

    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=18)
    (fam / "expert_05").mkdir()
    (fam / "expert_05" / "model.safetensors").symlink_to(tmp_path / "deleted-blob")
    with pytest.raises(MergeDBError, match="model.safetensors, which is not a file"):
        Catalog(tmp_path / "c.duckdb").register([fam], base_model="base")

    base = lf.make_base(tmp_path / "lbase")
    adapters = tmp_path / "adapters"
    lf.make_adapter(base, adapters / "a1")
    cat = Catalog(tmp_path / "l.duckdb")
    cat.register([base], base=True)
    (adapters / "a2").mkdir()
    (adapters / "a2" / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    with pytest.raises(MergeDBError, match="a2 holds adapter_model.safetensors but no adapter_config.json"):
        cat.register([adapters], base_model="lbase")
    (adapters / "a2" / "adapter_model.safetensors").unlink()
    assert cat.register([adapters], base_model="lbase").registered == ("a1",)


def test_stray_knows_the_file_names_checkpoint_and_lora_read():
    """stray.py is a leaf (it cannot import checkpoint or lora), so it writes their file names again;
    they must stay the same, or a real checkpoint would be refused as stray weights."""
    from mergedb import checkpoint, lora, stray

    assert (stray.MODEL, stray.MODEL_INDEX) == (checkpoint.SINGLE, checkpoint.INDEX)
    assert (stray.ADAPTER_CONFIG, stray.ADAPTER, stray.ADAPTER_INDEX) == (lora.CONFIG, lora.SINGLE, lora.INDEX)
    from mergedb import manifest

    assert stray.OUTPUT_MANIFEST == manifest.MANIFEST


def test_a_copy_of_a_registered_expert_under_another_name_is_refused(tmp_path):
    """`cp -a fam/expert_00 copy` then `register copy` registered the same model a second time, which
    plans over all experts counted twice (the same folder under two names was already refused; review,
    2026-12-02). Its bytes, hashed as registration reads them, name it, whether the copy kept its file
    times (cp -a) or not (cp: a new fingerprint, registered as one more expert until 2026-12-03; an
    expert whose weights equal another's, in one call, too). A move (the registered folder gone) is
    still allowed under a new name."""
    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=3)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    shutil.copytree(fam / "expert_00", tmp_path / "copy_of_expert_00")  # copy2: file times kept
    shutil.copytree(fam / "expert_01", tmp_path / "new_times" / "e01", copy_function=shutil.copy)
    shutil.copytree(fam / "expert_01", tmp_path / "new_times" / "e01b", copy_function=shutil.copy)
    before = snapshot(cat)
    for paths, name in (
        ([tmp_path / "copy_of_expert_00"], "expert_00"),
        ([tmp_path / "new_times" / "e01"], "expert_01"),
        ([tmp_path / "new_times"], "expert_01"),
    ):
        with pytest.raises(MergeDBError, match=rf"holds the same weights as expert '{name}' .*use '{name}'"):
            cat.register(paths, base_model="base")
        assert snapshot(cat) == before
    other = synth.make_family(tmp_path / "other", experts=1, size="tiny", seed=4) / "expert_00"
    for n in ("a", "b"):  # one new model twice in one call: the second is refused
        shutil.copytree(other, tmp_path / "pair" / n, copy_function=shutil.copy)
    with pytest.raises(MergeDBError, match=r"pair/b holds the same weights as expert 'a' \(from .*pair/a\)"):
        cat.register([tmp_path / "pair"], base_model="base")
    assert snapshot(cat) == before
    shutil.move(fam / "expert_01", tmp_path / "e1")
    assert cat.register([tmp_path / "e1"], base_model="base").registered == ("e1",)


def test_distinct_experts_with_equal_sizes_headers_and_times_both_register(tmp_path):
    """Experts unpacked from one archive share sizes, headers and whole-second times, so their
    fingerprints are equal: the second, registered in its own call, was refused as "a copy" of the
    first although its bytes differ (review, 2026-12-03). A copy is now confirmed by its bytes."""
    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=3)
    for e in ("expert_00", "expert_01"):
        os.utime(fam / e / "model.safetensors", ns=(1767225600 * 10**9,) * 2)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam / "base"], base=True)
    assert cat.register([fam / "expert_00"], base_model="base").registered == ("expert_00",)
    fps = {c.name: c.fingerprint for c in cat.checkpoints()}
    assert cat.register([fam / "expert_01"], base_model="base").registered == ("expert_01",)
    assert {c.name: c.fingerprint for c in cat.checkpoints()}["expert_01"] == fps["expert_00"]  # the case itself


def test_a_file_rewritten_while_it_is_registered_is_refused(tmp_path):
    """An expert's file rewritten in place while registration reads it (same header and size, other
    bytes: a save still running) was stored with statistics of neither version (review, 2026-12-02).
    Its fingerprint is taken again before anything is written: refused, catalog unchanged."""
    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=3)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam / "base"], base=True)
    f = fam / "expert_00" / "model.safetensors"
    other = synth.make_family(tmp_path / "other", experts=1, size="tiny", seed=4) / "expert_00" / "model.safetensors"
    assert other.stat().st_size == f.stat().st_size
    before = snapshot(cat)
    rewritten = []

    def rewrite(_):
        if not rewritten:
            with open(f, "r+b") as h:  # in place, never shorter (a truncated read is refused otherwise)
                h.write(other.read_bytes())
            os.utime(f, ns=(0, f.stat().st_mtime_ns + 10**9))  # a clock that ticks slower than the test
            rewritten.append(1)

    with pytest.raises(ChangedFileError, match=r"expert_00 changed while it was being registered.*nothing was written"):
        cat.register([fam / "expert_00"], base_model="base", progress=rewrite)
    assert rewritten and snapshot(cat) == before
    assert cat.register([fam / "expert_00"], base_model="base").registered == ("expert_00",)


def test_an_output_inside_the_family_folder_is_not_registered_as_an_expert(tmp_path):
    """`register ./fam` again (to add an expert) after a merge was written into fam/merged registered
    the merge as one more expert, and `plan --all` merged it with the experts it sums (two reviews,
    2026-12-02). Refused with the way out, catalog unchanged; named by its own path it registers."""
    from mergedb.planner import PlanRequest

    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=3)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    plan = cat.plan(PlanRequest("base", None, "task_arithmetic", "all"))
    cat.execute(plan.plan_id, fam / "merged")
    before = snapshot(cat)
    with pytest.raises(MergeDBError, match=r"fam/merged: a mergedb output .*move it out of .*fam, or register it by"):
        cat.register([fam], base_model="base")
    assert snapshot(cat) == before
    assert cat.register([fam / "merged"], base_model="base").registered == ("merged",)


def test_a_base_side_file_lost_after_registration_is_refused(tmp_path):
    """A base's config.json (or tokenizer) deleted between register and execute gave a merged model
    without it, which looked complete and did not load. The loss is refused with nothing merged or
    recorded; registering the base again accepts it as it is; a side file added since is copied."""
    from mergedb.planner import PlanRequest

    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=3)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    plan = cat.plan(PlanRequest("base", None, "linear"))
    (fam / "base" / "config.json").unlink()
    before = snapshot(cat)
    with pytest.raises(ChangedFileError, match=r"base 'base' \(.*\) no longer holds config.json, which it held"):
        cat.execute(plan.plan_id, tmp_path / "o")
    assert snapshot(cat) == before and not (tmp_path / "o").exists()
    from mergedb import executor  # the README's library route (executor.execute) refused it too (embed review)

    with pytest.raises(ChangedFileError, match=r"no longer holds config.json"):
        executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "o")
    assert snapshot(cat) == before and not (tmp_path / "o").exists()
    (fam / "base" / "vocab.txt").write_text("a\n")  # added since: not a loss
    assert cat.register([fam / "base"], base=True).unchanged == ("base",)  # records what it holds now
    cat.execute(plan.plan_id, tmp_path / "o")
    assert not (tmp_path / "o" / "config.json").exists() and (tmp_path / "o" / "vocab.txt").exists()


def test_a_moved_family_keeps_its_rows_and_plans(tmp_path):
    """Registering a family where it is now, under the same names, after its folder moved: the paths
    are updated, nothing is read again, and a plan made before the move merges the same bytes."""
    from mergedb.errors import CatalogError
    from mergedb.planner import PlanRequest

    fam = synth.make_family(tmp_path / "fam", experts=3, size="tiny", seed=21)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam / "base", fam / "expert_00", fam / "expert_01"], base_model="base")
    plan = cat.plan(PlanRequest("base", None, "task_arithmetic", params={"lambda": 0.7}))
    cat.execute(plan.plan_id, tmp_path / "before")
    moved = tmp_path / "elsewhere" / "family"
    moved.parent.mkdir()
    shutil.move(fam, moved)
    before = snapshot(cat)
    with pytest.raises(
        ChangedFileError, match=r"gone from where they were registered: base 'base' \(.*fam/base\)"
    ) as e:
        cat.execute(plan.plan_id, tmp_path / "gone")
    assert "expert 'expert_01' (" in str(e.value)
    assert "mergedb register NEW_PATH --name expert_00 --base-model base" in str(e.value)
    assert snapshot(cat) == before and not (tmp_path / "gone").exists()

    r = cat.register([moved], base_model="base")  # expert_02 is new: scanned against the moved base
    assert r.moved == ("base", "expert_00", "expert_01")
    assert r.registered == ("expert_02",) and set(r.unchanged) == {"base", "expert_00", "expert_01"}
    assert {c.name: c.path for c in cat.checkpoints()} == {
        n: str((moved / n).resolve()) for n in ("base", "expert_00", "expert_01", "expert_02")
    }
    cat.execute(plan.plan_id, tmp_path / "after")
    name = "model.safetensors"
    assert (tmp_path / "after" / name).read_bytes() == (tmp_path / "before" / name).read_bytes()

    copy = tmp_path / "copy"  # the registered folder still there: a copy is another checkpoint, as ever
    shutil.copytree(moved, copy)
    with pytest.raises(CatalogError, match="is another checkpoint"):
        cat.register([copy], base_model="base")


def test_a_base_whose_times_changed_takes_a_new_expert_with_refresh(tmp_path):
    """`touch` on the base, then --refresh with a new expert in the same call: the base's blocks are
    hashed as registered (its times taken), and the new expert is scanned against it (this used to be
    refused with advice to run what had just been run)."""
    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=22)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam / "base", fam / "expert_00"], base_model="base")
    os.utime(fam / "base" / "model.safetensors", ns=(1, 1))
    r = cat.register([fam], base_model="base", refresh=True)
    assert set(r.registered) == {"base", "expert_01"} and r.unchanged == ("expert_00",)
    assert cat.register([fam], base_model="base").registered == ()  # now unchanged, times included


def test_a_model_file_named_model_safetensors_takes_its_folders_name(tmp_path):
    """Registered by its file, fam/base/model.safetensors was named 'model' (the file's stem), so a
    base and its experts registered that way collided; it is named after its folder, as the folder
    would be. Other file names keep their stem."""
    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=17)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam / "base" / "model.safetensors"], base=True)
    cat.register([fam / "expert_00" / "model.safetensors"], base_model="base")
    other = synth.make_family(tmp_path / "other", experts=1, size="tiny", seed=18)  # not a copy of expert_00
    shutil.copy(other / "expert_00" / "model.safetensors", tmp_path / "e.safetensors")
    assert cat.register([tmp_path / "e.safetensors"], base_model="base").registered == ("e",)
    assert [c.name for c in cat.checkpoints()] == ["base", "e", "expert_00"]


def test_moves_are_checked_as_new_paths_are(tmp_path):
    """What a move may not do (a review helper's cases): give one folder a second name, take another
    model's name, or be taken for gone while it only cannot be read. A folder emptied file by file
    (rsync --remove-source-files) is gone; a new expert while the base is gone is told to move it."""
    from mergedb.errors import CatalogError

    fam = synth.make_family(tmp_path / "fam", experts=3, size="tiny", seed=23)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam / "base", fam / "expert_00", fam / "expert_01"], base_model="base")
    shutil.move(fam / "expert_00", fam / "e0")
    cat.register([fam / "e0"], base_model="base")  # a new name: allowed (the old path is gone)
    before = snapshot(cat)
    with pytest.raises(CatalogError, match=r"holds the files of expert 'e0', registered under that name.*--name e0"):
        cat.register([fam / "e0"], base_model="base", name="expert_00")  # the same folder under two names
    assert snapshot(cat) == before

    shutil.copytree(fam / "expert_02", tmp_path / "other")  # other weights where expert_01 was registered
    shutil.rmtree(fam / "expert_01")
    with pytest.raises(
        CatalogError, match=r"'expert_01' is registered from .*, which is gone, but .* holds other weights"
    ):
        cat.register([tmp_path / "other"], base_model="base", name="expert_01", refresh=True)
    assert snapshot(cat) == before

    emptied = tmp_path / "emptied"  # expert e0's files moved out one by one: its folder is left empty
    emptied.mkdir()
    for f in (fam / "e0").iterdir():
        shutil.move(f, emptied / f.name)
    assert cat.register([emptied], base_model="base", name="e0").moved == ("e0",)

    shutil.move(fam / "base", tmp_path / "base-moved")
    with pytest.raises(ChangedFileError, match=r"base 'base' is gone from .*register it where it is now first"):
        cat.register([fam / "expert_02"], base_model="base")


def test_weights_below_float32s_normal_range_are_refused(tmp_path):
    """The merge sums weights in float32: a weight of 1e-40 loses its ratio to the others, 1e-50
    vanishes (the merge became the base); refused, where 0 and 1e-9 plan as before."""
    from mergedb.errors import PlanError
    from mergedb.planner import PlanRequest

    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=24)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    for w in (1e-40, 1e-50, -1e-39):
        with pytest.raises(PlanError, match=r"weight 2 of 2 is .*below float32's normal range"):
            cat.plan(PlanRequest("base", None, "task_arithmetic", weights=(1.0, w)))
    for w in (0.0, 1e-9):
        cat.plan(PlanRequest("base", None, "ties", params={"density": 0.5}, weights=(1.0, w)))


def test_names_not_in_utf8_are_refused_before_the_scan(tmp_path):
    """A folder or shard named in another encoding reaches Python as lone surrogates, which DuckDB
    refused only when the first row was inserted: a traceback after the whole scan (review,
    2026-12-02). Now refused up front, naming the path; a config.json architecture of a lone
    surrogate ("\\ud800" in its JSON) counts as none."""
    from mergedb.checkpoint import open_checkpoint
    from mergedb.errors import FormatError
    from mergedb.units import check_name

    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=21)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam / "base"], base=True)
    before = snapshot(cat)
    odd = tmp_path / os.fsdecode(b"exp\xff")
    shutil.copytree(fam / "expert_00", odd)
    for paths, kw in (([odd], {}), ([odd], {"name": "fine"}), ([tmp_path], {})):
        with pytest.raises(MergeDBError, match="not valid UTF-8") as e:
            cat.register(paths, base_model="base", **kw)
        assert "exp\\xff" in str(e.value)
    assert snapshot(cat) == before
    with pytest.raises(MergeDBError, match="is not valid UTF-8"):
        check_name(os.fsdecode(b"exp\xff"), "expert name")
    sharded = synth.make_family(tmp_path / "sh", experts=1, size="tiny", seed=22, shard_size=500_000) / "base"
    index = sharded / "model.safetensors.index.json"
    shard = sorted(p.name for p in sharded.glob("model-*.safetensors"))[0]
    bad = os.fsdecode(b"sh\xff.safetensors")
    os.rename(sharded / shard, sharded / bad)
    index.write_text(index.read_text().replace(shard, "sh\\udcff.safetensors"))
    with pytest.raises(FormatError, match="not valid UTF-8"):
        open_checkpoint(sharded)
    cfg = fam / "expert_00" / "config.json"
    cfg.write_text(cfg.read_text().replace('"architectures": [', '"architectures": ["\\ud800", ', 1))
    assert "\\ud800" in cfg.read_text()
    assert open_checkpoint(fam / "expert_00").architecture is None
    cat.register([fam / "expert_00"], base_model="base")


def test_what_another_process_registers_or_forgets_during_a_scan_is_checked_at_the_write(tmp_path):
    """The copy refusals and the base ran against the rows read before the scan (concurrency review):
    a copy of an expert registered by another process meanwhile was stored too (plans over all
    experts merged it twice), and a base forgotten meanwhile gave a TypeError, or, registered again
    with another layout, a catalog whose expert rows matched no block of it."""
    from mergedb.errors import CatalogError

    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=13)
    shutil.copytree(fam / "expert_00", tmp_path / "copy_of_expert_00")
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam / "base"], base=True)

    def meanwhile(action):
        done = []

        def progress(_n):
            if not done:  # once, mid-scan, through another Catalog (the catalog is not held meanwhile)
                done.append(action(Catalog(cat.path)))

        return progress

    before = snapshot(cat)
    with pytest.raises(CatalogError, match=r"holds the same weights as expert 'copy_of_expert_00'.*a copy"):
        cat.register(
            [fam / "expert_00"],
            base_model="base",
            progress=meanwhile(lambda other: other.register([tmp_path / "copy_of_expert_00"], base_model="base")),
        )
    assert [c.name for c in cat.checkpoints()] == ["base", "copy_of_expert_00"]  # only the other's write
    cat.forget(["copy_of_expert_00"])
    assert snapshot(cat) == before
    for action in (
        lambda other: other.forget(["base"]),
        lambda other: (other.forget(["base"]), other.register([fam / "base"], base=True, block_size="1KiB")),
    ):
        with pytest.raises(CatalogError, match="base 'base' was forgotten or registered again by another process"):
            cat.register([fam / "expert_01"], base_model="base", progress=meanwhile(action))
        assert "expert_01" not in [c.name for c in cat.checkpoints()]
        if any(c.name == "base" for c in cat.checkpoints()):
            cat.forget(["base"])
        cat.register([fam / "base"], base=True)
    from mergedb.check import check_catalog

    assert check_catalog(cat) == []

    # a base only re-timed meanwhile (same bytes, id and layout) is the base the experts were read against
    def retime(other):
        for f in (fam / "base").glob("*.safetensors"):
            os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
        return other.register([fam / "base"], base=True, refresh=True)

    assert cat.register([fam / "expert_01"], base_model="base", progress=meanwhile(retime)).registered == ("expert_01",)
    # a copy registered meanwhile under a base this very call registers (new when its scan began; review)
    fresh = Catalog(tmp_path / "fresh.duckdb")

    def base_and_copy(other):
        other = Catalog(fresh.path)
        other.register([fam / "base"], base=True)
        return other.register([tmp_path / "copy_of_expert_00"], base_model="base")

    done = []

    def progress(_n):
        if not done:
            done.append(base_and_copy(None))

    with pytest.raises(CatalogError, match=r"holds the same weights as expert 'copy_of_expert_00'"):
        fresh.register([fam / "base", fam / "expert_00"], base_model="base", progress=progress)
    assert [c.name for c in fresh.checkpoints()] == ["base", "copy_of_expert_00"]


@pytest.mark.parametrize("where", ["open", "version", "transaction"])
def test_an_interrupt_while_the_first_registration_makes_the_catalog_leaves_no_file(tmp_path, monkeypatch, where):
    """SIGTERM or Ctrl-C while the first registration opened the new file (DuckDB's connect, reading
    its version, or before the transaction began) left an empty DuckDB file, which every command but
    register then refused (concurrency review). The interrupt is simulated at each place."""
    from mergedb import catalog, schemaversion

    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=2)
    cat = Catalog(tmp_path / "c.duckdb")
    if where == "open":
        opened = catalog.Catalog._open

        def interrupted_open(self, *args, **kwargs):
            con = opened(self, *args, **kwargs)  # the file exists now
            con.close()
            raise KeyboardInterrupt

        monkeypatch.setattr(catalog.Catalog, "_open", interrupted_open)
    elif where == "version":
        monkeypatch.setattr(schemaversion, "read", lambda *args, **kwargs: (_ for _ in ()).throw(KeyboardInterrupt()))
    else:
        calls = []
        blank = catalog.Catalog.is_blank

        def interrupted_blank(con):
            calls.append(1)
            if len(calls) == 1:
                raise KeyboardInterrupt
            return blank(con)

        monkeypatch.setattr(catalog.Catalog, "is_blank", staticmethod(interrupted_blank))
    with pytest.raises(KeyboardInterrupt):
        cat.register([fam], base_model="base")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fam"]
    monkeypatch.undo()
    assert cat.register([fam], base_model="base").registered == ("base", "expert_00")


def test_a_reader_holding_the_catalog_at_the_commit_does_not_throw_the_scan_away(tmp_path):
    """With the default --wait 0, a registration read every file and then failed at its commit if a
    reader (a `mergedb sql`, a plan) held the catalog at that moment: minutes of reading lost
    (concurrency review). The commit waits up to 30 s, as execute's record does, and says so."""
    import subprocess
    import sys

    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=8)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam / "base"], base=True)
    hold = (
        "import duckdb, sys, time; con = duckdb.connect(sys.argv[1], read_only=True); "
        "print(1, flush=True); time.sleep(2)"
    )
    holders: list[subprocess.Popen] = []

    def progress(_n):
        if not holders:  # mid-scan, a reader takes the catalog for 2 s: it holds it at the commit
            holders.append(subprocess.Popen([sys.executable, "-c", hold, str(cat.path)], stdout=subprocess.PIPE))
            assert holders[0].stdout.readline().strip() == b"1"

    told: list[str] = []
    try:
        res = Catalog(cat.path, on_wait=told.append).register([fam], base_model="base", progress=progress)
    finally:
        for h in holders:
            h.kill()
            h.wait()
    assert res.registered == ("expert_00", "expert_01")
    assert len(told) == 1 and f"is locked by process {holders[0].pid}; waiting for it (up to 30 s)" in told[0]
