"""Adversarial end-to-end cases of issue 10, through the CLI on real files: outputs over inputs,
concurrent writers, crashes inside the --force swap, tampered replays, failed run records,
edited manifests, symlinked or current-folder outputs. Every data-loss case hashes each file
under the user's folders before and after and requires them identical."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from mergedb import executor, manifest, synth
from mergedb.catalog import Catalog
from mergedb.check import check_output
from mergedb.cli import app
from mergedb.errors import CatalogError, MergeDBError
from mergedb.planner import PlanRequest

runner = CliRunner()


def _snapshot(*folders: Path) -> dict[str, str]:
    """sha256 of every file under `folders` (symlinks by their target text), by path; the
    catalog, which records failed runs, is left out."""
    out = {}
    for folder in folders:
        for p in sorted(Path(folder).rglob("*")):
            if ".duckdb" in p.name:
                continue
            if p.is_symlink():
                out[str(p)] = "link:" + os.readlink(p)
            elif p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _cli(*args: str) -> tuple[int, str]:
    """Run `mergedb ARGS` in-process: (exit code, output); a traceback fails the test."""
    res = runner.invoke(app, [str(a) for a in args])
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        raise res.exception
    assert "Traceback" not in res.output
    return res.exit_code, res.output


@pytest.fixture
def setup(tmp_path):
    """(folder, catalog path, plan ids {all, half}) over a fresh tiny family of 2 experts."""
    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=11)
    db = tmp_path / "c.duckdb"
    cat = Catalog(db)
    cat.register([fam], base_model="base")
    full = cat.plan(PlanRequest("base", None, "task_arithmetic", "all")).plan_id
    half = cat.plan(PlanRequest("base", None, "ties", "50%")).plan_id
    return fam, db, {"all": full, "half": half}


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.glob(f".{out.name}.mergedb-*"))


# -- 2: never write over, into or around a checkpoint being read ------------------------------


@pytest.mark.parametrize("as_url", [False, True], ids=["path", "file-url"])
def test_force_never_overwrites_a_registered_checkpoint(setup, tmp_path, as_url):
    """as_url: the output registered as file:///…, which the overlap check once resolved as a
    relative path (CWD/file:/…), so --force replaced the expert's files (review, 2026-12-02)."""
    fam, db, plan = setup
    out = tmp_path / "out"
    assert _cli("execute", plan["all"], "--out", out, "-c", db, "-q")[0] == 0
    Catalog(db).register([f"file://{out}" if as_url else out], base_model="base", name="merged")  # now an expert
    pid = Catalog(db).plan(PlanRequest("base", None, "task_arithmetic", "all")).plan_id
    (out / "NOTES.md").write_text("mine")
    before = _snapshot(tmp_path)
    for target in (out, fam, fam / "expert_00", fam / "expert_00" / "sub", tmp_path):
        code, text = _cli("execute", pid, "--out", target, "--force", "-c", db, "-q")
        assert code == 1 and "overlaps" in text, text
    assert _snapshot(tmp_path) == before
    # replay with a catalog: the same rule (it replaced the registered output's model file; review)
    other = tmp_path.parent / f"{tmp_path.name}-other"
    assert _cli("execute", plan["half"], "--out", other, "-c", db, "-q")[0] == 0
    code, text = _cli("replay", other / "mergedb_manifest.json", "--out", out, "--force", "-c", db, "-q")
    assert code == 1 and "--out" in text and "overlaps" in text and "a registered checkpoint" in text, text
    assert _snapshot(tmp_path) == before
    # the executor alone (no catalog) refuses the plan's own inputs too
    xp = Catalog(db).execution_plan(pid)
    with pytest.raises(MergeDBError, match="an input of this plan"):
        executor.execute(xp, out, force=True)
    assert _snapshot(tmp_path) == before


def test_force_never_overwrites_what_a_checkpoints_links_point_at(setup, tmp_path):
    """An expert folder whose model file is a link into an output (a Hugging Face snapshot is a folder
    of such links): --force into that output would replace the expert's bytes, so it is refused
    (the folder check resolved the folder, not the files in it)."""
    fam, db, plan = setup
    out = tmp_path / "out"
    assert _cli("execute", plan["all"], "--out", out, "-c", db, "-q")[0] == 0
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "model.safetensors").symlink_to(out / "model.safetensors")
    shutil.copy(out / "config.json", linked / "config.json")
    Catalog(db).register([linked], base_model="base")
    pid = Catalog(db).plan(PlanRequest("base", ("expert_00", "linked"), "task_arithmetic", "all")).plan_id
    before = _snapshot(tmp_path)
    code, text = _cli("execute", pid, "--out", out, "--force", "-c", db, "-q")
    assert code == 1 and f"overlaps {out / 'model.safetensors'}" in text, text
    assert _snapshot(tmp_path) == before
    with pytest.raises(MergeDBError, match="an input of this plan"):  # the executor alone too
        executor.execute(Catalog(db).execution_plan(pid), out, force=True)
    assert _snapshot(tmp_path) == before


# -- 3: two writers of one output: exactly one wins -------------------------------------------


def test_two_executes_into_one_out_exactly_one_wins(setup, tmp_path):
    fam, db, plan = setup
    for trial in range(2):
        out = tmp_path / f"out{trial}"
        cmd = [sys.executable, "-m", "mergedb.cli", "execute", str(plan["all"]), "--out", str(out)]
        cmd += ["-c", str(db), "--wait", "60", "-q"]
        procs = [subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        results = [(p.wait(), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
        codes = sorted(rc for rc, _ in results)
        assert codes == [0, 1], results
        err = next(e for rc, e in results if rc == 1)
        assert "Traceback" not in err
        assert "another mergedb" in err or "exists and is not empty" in err, err
        assert check_output(out) == [] and _leftovers(out) == []
        runs = Catalog(db).sql("SELECT status FROM runs WHERE out = ? ORDER BY status", [str(out)])
        assert runs.column("status").to_pylist() == ["failed", "ok"]


# -- 4: a crash at any step of the --force swap never loses a user's file ---------------------

_CRASHER = r"""
import json, os, pickle, sys
from pathlib import Path
from typer.testing import CliRunner
from mergedb import executor
from mergedb.check import check_output
from mergedb.cli import app

xps, db, out, ids, shard, points = pickle.loads(Path(sys.argv[1]).read_bytes())
out = Path(out)
real_rename, real_replace = os.rename, os.replace

def run_child(fn):
    pid = os.fork()
    if pid == 0:
        try:
            fn()
        except BaseException:
            os._exit(3)
        os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

def crash_at(n, xp):
    # die (os._exit: no cleanup, no finally) at rename number n, or with n == "cleanup" at the
    # first unlink after every rename of the swap is done
    calls = [0]
    real_unlink = os.unlink
    def counted(real):
        def f(a, b):
            calls[0] += 1
            if calls[0] == n:
                os._exit(9)
            return real(a, b)
        return f
    def unlink(p, *a, **k):
        if n == "cleanup" and (out / "mergedb_manifest.json").exists() and Path(p).parent != out.parent:
            os._exit(9)
        return real_unlink(p, *a, **k)
    os.rename, os.replace, os.unlink = counted(real_rename), counted(real_replace), unlink
    executor.execute(xp, out, force=True, max_shard_size=shard[xp.plan_id])

def rerun(pid):
    res = CliRunner().invoke(app, ["execute", str(pid), "--out", str(out), "--force", "-c", db, "-q",
                                   "--max-shard-size", str(shard[pid])])
    if res.exit_code != 0:
        print(res.output, file=sys.stderr)
        os._exit(4)

log = []
for n, k in points:  # swap one way (crash, rerun), then back: the rerun restores the other old output
    xp = xps[k]
    code = run_child(lambda: crash_at(n, xp))
    after_crash = check_output(out) if (out / "mergedb_manifest.json").exists() else ["no manifest"]
    rc = run_child(lambda: rerun(ids[k]))
    log.append({"n": n, "k": k, "crash": code, "after_crash": after_crash, "rerun": rc, "check": check_output(out),
                "hash": json.loads((out / "mergedb_manifest.json").read_text())["content_hash"]})
print(json.dumps(log))
"""


def test_crash_at_every_step_of_the_force_swap_keeps_user_files(setup, tmp_path):
    fam, db, plan = setup
    out = tmp_path / "out"
    cat = Catalog(db)
    shard = {plan["all"]: 10**9, plan["half"]: 700_000}  # one file one way, two shards and an index the other
    assert _cli("execute", plan["all"], "--out", out, "-c", db, "-q")[0] == 0
    want = {}
    for name, pid in plan.items():
        tmp = tmp_path / f"ref-{name}"
        want[pid] = executor.execute(cat.execution_plan(pid), tmp, max_shard_size=shard[pid]).manifest["content_hash"]
    (out / "NOTES.md").write_text("my notes\n")
    (out / "eval_results").mkdir()
    (out / "eval_results" / "scores.json").write_bytes(b'{"mmlu": 0.61}\xff')
    (out / "tokenizer.model.bak").write_bytes(os.urandom(1000))
    user = {
        k: v for k, v in _snapshot(out).items() if Path(k).name in ("NOTES.md", "scores.json", "tokenizer.model.bak")
    }
    xps = [cat.execution_plan(plan["half"]), cat.execution_plan(plan["all"])]
    # the swap renames the old manifest, the old files, the new files, the new manifest (r calls);
    # cut it: after the old manifest left, midway through the new files (all old files gone), just
    # before the new manifest, and in the cleanup after it. Directions alternate.
    files = {
        k: len(json.loads((tmp_path / f"ref-{n}" / manifest.MANIFEST).read_text())["run"]["files"])
        for k, n in ((0, "half"), (1, "all"))
    }
    r = files[0] + files[1]
    points = []
    for step in range(4):
        for k in (0, 1):  # k = 0: "all" is the old output, "half" the new; k = 1: back
            n_old, n_new = files[1 - k], files[k]
            points.append(((2, n_old + n_new // 2, r, "cleanup")[step], k))
    job = tmp_path / "job.pkl"
    job.write_bytes(pickle.dumps((xps, str(db), str(out), [plan["half"], plan["all"]], shard, points)))
    res = subprocess.run([sys.executable, "-c", _CRASHER, str(job)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    log = json.loads(res.stdout)
    now = _snapshot(out)
    assert {k: now.get(k) for k in user} == user  # every file of the user's, byte for byte
    assert [e["crash"] for e in log] == [9] * len(points), log  # every cut landed
    for e in log:
        target = [plan["half"], plan["all"]][e["k"]]
        assert e["rerun"] == 0 and e["check"] == [], e
        assert e["hash"] == want[target], e
        # after the crash itself: the old or the new output whole, or (mid-swap) no manifest at all
        assert e["after_crash"] in ([], ["no manifest"]), e
    assert _leftovers(out) == []


def test_an_output_named_with_glob_characters_leaves_other_outputs_leftovers_alone(setup, tmp_path):
    """A killed run into `merged1` left its temporary folder and, mid --force swap, the old output's
    files: a run into `merged[1]` (a glob pattern matching `merged1`) must not delete or move them,
    and the next run into `merged1` still finishes that swap."""
    fam, db, plan = setup
    out, other = tmp_path / "merged1", tmp_path / "merged[1]"
    assert _cli("execute", plan["all"], "--out", out, "-c", db, "-q")[0] == 0
    tag = f"{os.getpid()}-0123abcd"
    tmp, old = tmp_path / f".merged1.mergedb-tmp-{tag}", tmp_path / f".merged1.mergedb-old-{tag}"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"half-written shard")
    old.mkdir()  # a swap cut after the old manifest left `out`: its output is in `old`
    os.rename(out / manifest.MANIFEST, old / manifest.MANIFEST)
    before = _snapshot(tmp_path / "fam", out, tmp, old)
    assert _cli("execute", plan["half"], "--out", other, "-c", db, "-q")[0] == 0
    assert _snapshot(tmp_path / "fam", out, tmp, old) == before
    assert check_output(other) == []
    assert _cli("execute", plan["all"], "--out", out, "-c", db, "-q", "--force")[0] == 0
    assert not tmp.exists() and not old.exists() and check_output(out) == []
    assert _leftovers(out) == [] and _leftovers(other) == []


def test_an_empty_out_keeps_its_mode_and_a_failed_run_leaves_no_folders(setup, tmp_path, monkeypatch):
    """An empty --out folder (a volume, a folder made for the result) is filled, keeping its mode;
    a file or a mount point as --out is refused before merging, by name; the folders a run made to
    hold its output go again when it fails."""
    fam, db, plan = setup
    empty = tmp_path / "empty"
    empty.mkdir(mode=0o700)
    os.chmod(empty, 0o710)  # not the umask's default: it must survive the install
    assert _cli("execute", plan["all"], "--out", empty, "-c", db, "-q")[0] == 0
    assert check_output(empty) == [] and oct(empty.stat().st_mode & 0o7777) == oct(0o710)
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, text = _cli("execute", plan["all"], "--out", afile, "-c", db, "-q", "--force")
    assert code == 1 and "is a file, not a folder" in text and afile.read_text() == "x"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == mnt or real_ismount(p))
    code, text = _cli("execute", plan["all"], "--out", mnt, "-c", db, "-q")
    assert code == 1 and "is a mount point" in " ".join(text.split()) and not any(mnt.iterdir())
    code, text = _cli("execute", plan["all"], "--out", tmp_path / ("n" * 240), "-c", db, "-q")
    assert code == 1 and "choose a shorter --out name" in " ".join(text.split())  # its temporary name is longer
    expert = fam / "expert_00" / "model.safetensors"
    expert.write_bytes(expert.read_bytes()[:-8] + b"changed!")  # the run fails: the expert changed
    code, text = _cli("execute", plan["all"], "--out", tmp_path / "new" / "deep" / "out", "-c", db, "-q")
    assert code == 1 and "changed" in text
    assert not (tmp_path / "new").exists()


# -- 5: a replay that differs installs nothing -------------------------------------------------


def test_tampered_replay_installs_nothing(setup, tmp_path):
    fam, db, plan = setup
    out, old = tmp_path / "out", tmp_path / "old"
    assert _cli("execute", plan["all"], "--out", out, "-c", db, "-q")[0] == 0
    assert _cli("execute", plan["half"], "--out", old, "-c", db, "-q")[0] == 0
    (old / "NOTES.md").write_text("keep")
    expert = fam / "expert_00" / "model.safetensors"
    st, original = expert.stat(), expert.read_bytes()
    tampered = bytearray(original)
    mid = len(tampered) // 2
    tampered[mid : mid + 64] = bytes(255 - b for b in tampered[mid : mid + 64])  # same size and mtime
    expert.write_bytes(bytes(tampered))
    os.utime(expert, ns=(st.st_atime_ns, st.st_mtime_ns))
    before = _snapshot(tmp_path)
    code, text = _cli("replay", out / "mergedb_manifest.json", "--out", tmp_path / "again")
    assert code == 1 and "differs from the recorded one" in text, text
    assert not (tmp_path / "again").exists() and _leftovers(tmp_path / "again") == []
    code, text = _cli("replay", out / "mergedb_manifest.json", "--out", old, "--force")
    assert code == 1 and "nothing was installed" in text, text
    assert _snapshot(tmp_path) == before and _leftovers(old) == []
    expert.write_bytes(original)
    os.utime(expert, ns=(st.st_atime_ns, st.st_mtime_ns))
    code, text = _cli("check", "--output", out, "-c", db)
    assert code == 0, text
    code, text = _cli("replay", out / "mergedb_manifest.json", "--out", tmp_path / "again", "-q")  # as execute -q
    assert code == 0 and text.strip() == "", text
    code, text = _cli("replay", out / "mergedb_manifest.json", "--out", tmp_path / "again2")
    assert code == 0 and "tensors identical to the original" in text, text


# -- 14: the run record, unwritable --out folders, names not in UTF-8 --------------------------


def test_run_record_failure_says_the_output_is_good(setup, tmp_path, monkeypatch):
    fam, db, plan = setup

    def locked(*a, **k):
        raise CatalogError(f"catalog {db} is locked by process 1; wait for it to finish, or pass --wait SECONDS")

    monkeypatch.setattr(Catalog, "record_run", locked)
    code, text = _cli("execute", plan["all"], "--out", tmp_path / "out", "-c", db, "-q")
    assert code == 1 and "complete and good" in text and "locked by process 1" in text, text
    assert check_output(tmp_path / "out") == []
    # a failed merge shows its own error, with the recording failure as a note
    os.utime(fam / "expert_00" / "model.safetensors", ns=(5, 5))
    code, text = _cli("execute", plan["all"], "--out", tmp_path / "out2", "-c", db, "-q")
    assert code == 1 and "changed since it was registered" in text and "failed too" in text, text
    assert not (tmp_path / "out2").exists()


def test_a_finished_merge_waits_for_its_record_at_least_as_long_as_the_catalog_was_told(setup, tmp_path, monkeypatch):
    """A merge's run record waits Catalog.RECORD_WAIT for a held catalog, or the catalog's own longer
    --wait (a review found the longer wait dropped when RECORD_WAIT became a class attribute)."""
    _, db, plan = setup
    waits = []
    real = Catalog.record_run

    def noting(self, *a, **k):
        waits.append(k["wait"])
        return real(self, *a, **k)

    monkeypatch.setattr(Catalog, "record_run", noting)
    Catalog(db).execute(plan["all"], tmp_path / "a")
    Catalog(db, wait=Catalog.RECORD_WAIT + 90).execute(plan["all"], tmp_path / "b")
    assert waits == [Catalog.RECORD_WAIT, Catalog.RECORD_WAIT + 90]


def test_unwritable_and_non_utf8_out_fail_clearly(setup, tmp_path):
    fam, db, plan = setup
    (tmp_path / "afile").write_text("x")
    code, text = _cli("execute", plan["all"], "--out", tmp_path / "afile" / "out", "-c", db, "-q")
    assert code == 1 and "cannot create" in text, text
    code, text = _cli("execute", plan["all"], "--out", os.fsdecode(bytes(tmp_path) + b"/out\xff"), "-c", db)
    assert code == 1 and "not valid UTF-8" in text and "out\\xff" in text, text
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        code, text = _cli("execute", plan["all"], "--out", ro / "out", "-c", db, "-q")
        assert code == 1 and "folder you can write" in text, text
    assert [p.name for p in tmp_path.iterdir() if "mergedb" in p.name] == []


# -- 16: edited manifests, re-hashed consistently ----------------------------------------------


def _edits():
    def rows_huge(d):
        d["layout"][0]["rows"] = [[0, 10**12]]

    def shape_huge(d):
        t = d["layout"][0]
        t["shape"] = [10**12, 10**6]
        t["rows"] = [[0, 10**12]]
        t["base_hashes"] = []

    def drop_key(d):
        del d["layout"][1]["rows"]

    def wrong_type(d):
        d["experts"][0]["weight"] = "heavy"

    def bad_dtype(d):
        d["layout"][0]["dtype"] = "F128"

    def rows_backwards(d):
        t = next(t for t in d["layout"] if len(t["shape"]) == 2)
        n = t["shape"][0]
        t["rows"] = [[n // 2, n], [0, n // 2]]

    def rows_negative(d):
        t = next(t for t in d["layout"] if len(t["shape"]) == 2)
        t["rows"] = [[-5, t["shape"][0]]]

    def trim_position(d):
        d["trims"] = [{"position": 99, "tensor_idx": 0, "t_lo": 0.0, "t_hi": 1.0}]

    def hashes_list(d):
        d["tensor_hashes"] = list(d["tensor_hashes"])

    def nul_path(d):  # a ValueError ("embedded null byte") traceback from the file system call
        d["base"]["path"] += "\0x"

    return [
        nul_path,
        rows_huge,
        shape_huge,
        drop_key,
        wrong_type,
        bad_dtype,
        rows_backwards,
        rows_negative,
        trim_position,
        hashes_list,
    ]


def test_edited_manifests_fail_cleanly(setup, tmp_path):
    fam, db, plan = setup
    out = tmp_path / "out"
    assert _cli("execute", plan["all"], "--out", out, "-c", db, "-q")[0] == 0
    for edit in _edits():
        copy = tmp_path / edit.__name__
        shutil.copytree(out, copy)
        path = copy / manifest.MANIFEST
        doc = json.loads(path.read_text())
        edit(doc)
        doc["content_hash"] = manifest.content_hash(doc)  # edited and re-hashed: consistent
        path.write_text(json.dumps(doc))
        code, text = _cli("replay", path, "--out", tmp_path / "again")
        text = text.replace("\n", "")
        # refused by the manifest's own checks, or (a huge shape, consistent in itself) by the base's header,
        # or (fewer layout rows) because the mask then holds more rows than the layout has blocks
        why = (str(path), "does not describe these files", "(expert, block) pairs the manifest has")
        assert code == 1 and any(w in text for w in why), (edit, text)
        assert not (tmp_path / "again").exists() and _leftovers(tmp_path / "again") == []
        code, text = _cli("check", "--output", copy, "-c", db)
        assert code == 1 and "problem:" in text, (edit, text)


def test_a_manifest_nested_too_deeply_and_an_output_checked_alone(setup, tmp_path, monkeypatch):
    """JSON nested deeper than Python's stack (in the unhashed `run`, so no re-hash is needed) gave a
    RecursionError traceback from replay and check --output; and check --output refused to run on a
    machine without the catalog ('no catalog at mergedb.duckdb'), where an output is verified alone."""
    fam, db, plan = setup
    out = tmp_path / "out"
    assert _cli("execute", plan["all"], "--out", out, "-c", db, "-q")[0] == 0
    monkeypatch.chdir(tmp_path)  # no catalog here, and none named
    assert _cli("check", "--output", out) == (0, "ok: outputs verified\n")
    text = (out / manifest.MANIFEST).read_text()
    (out / manifest.MANIFEST).write_text(text.rstrip()[:-1] + ', "zz": ' + "[" * 100_000 + "]" * 100_000 + "}")
    code, said = _cli("replay", out / manifest.MANIFEST, "--out", tmp_path / "again")
    assert code == 1 and "nests too deeply" in said and "Traceback" not in said, said
    code, said = _cli("check", "--output", out)
    assert code == 1 and "nests too deeply" in said, said


def test_edited_mask_fails_cleanly(setup, tmp_path):
    fam, db, plan = setup
    out = tmp_path / "out"
    assert _cli("execute", plan["all"], "--out", out, "-c", db, "-q")[0] == 0
    mask = pq.read_table(out / manifest.MASK)
    pos = mask.column("block_idx").to_pylist()
    pos[0] = 10**9
    mask = mask.set_column(mask.column_names.index("block_idx"), "block_idx", pa.array(pos, pa.int32()))
    pq.write_table(mask, out / manifest.MASK)
    doc = json.loads((out / manifest.MANIFEST).read_text())
    doc["mask_digest"] = manifest.mask_digest(mask)
    doc["content_hash"] = manifest.content_hash(doc)
    (out / manifest.MANIFEST).write_text(json.dumps(doc))
    code, text = _cli("replay", out / manifest.MANIFEST, "--out", tmp_path / "again")
    assert code == 1 and "refers to no expert block" in text, text
    code, text = _cli("check", "--output", out, "-c", db)
    assert code == 1 and "refers to no expert block" in text, text


@pytest.mark.parametrize("bomb", ["rows", "bytes"])
def test_a_mask_that_decodes_to_far_more_than_it_holds_is_refused_unread(setup, tmp_path, monkeypatch, bomb):
    """A mask.parquet of one value repeated compresses to almost nothing: a 1 MB file decoded to 30M
    rows (6.5 GB) in replay and check --output before any of its rows was checked, and the replay
    read it even before the content hash (review, 2026-12-02). Its metadata is checked first now:
    no more rows than the manifest's (expert, block) pairs, no more bytes than such rows hold."""
    fam, db, plan = setup
    out = tmp_path / "out"
    assert _cli("execute", plan["all"], "--out", out, "-c", db, "-q")[0] == 0
    schema = pq.read_schema(out / manifest.MASK)
    n, text = (2_000_000, "x" * 32) if bomb == "rows" else (1, "x" * (64 << 20))
    big = pa.table(
        {f.name: pa.array([text] * n, f.type) if pa.types.is_string(f.type) else pa.array([0] * n, f.type)
         for f in schema},
        schema=schema,
    )  # fmt: skip
    pq.write_table(big, out / manifest.MASK, compression="zstd")
    assert (out / manifest.MASK).stat().st_size < 2 << 20
    read = []
    monkeypatch.setattr(manifest.pq, "read_table", lambda *a, **k: read.append(a) or pytest.fail("read whole"))
    words = "rows, more than the" if bomb == "rows" else "more than 1 mask rows hold"
    code, text = _cli("replay", out / manifest.MANIFEST, "--out", tmp_path / "again")
    assert code == 1 and words in text, text
    assert check_output(out) and words in check_output(out)[0]
    assert read == []


# -- 18: symlinked --out, the current folder ---------------------------------------------------


def test_symlink_and_current_folder_out_refused(setup, tmp_path, monkeypatch):
    fam, db, plan = setup
    real = tmp_path / "real"
    assert _cli("execute", plan["all"], "--out", real, "-c", db, "-q")[0] == 0
    (real / "NOTES.md").write_text("mine")
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    before = _snapshot(tmp_path)
    code, text = _cli("execute", plan["half"], "--out", tmp_path / "link", "--force", "-c", db, "-q")
    assert code == 1 and "symbolic link" in text, text
    work = tmp_path / "work" / "sub"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    for target in (".", "..", str(work)):
        code, text = _cli("execute", plan["all"], "--out", target, "--force", "-c", db, "-q")
        assert code == 1 and "current folder" in text, (target, text)
    shutil.rmtree(tmp_path / "work")
    assert _snapshot(tmp_path) == before


def test_an_out_that_is_a_url_is_refused_not_written_as_a_local_folder(setup, tmp_path, monkeypatch):
    """`--out s3://models/merged` exited 0 having written a local folder ./s3:/models/merged (a Path
    makes its // one /), and replay did the same (review, 2026-12-03). Refused for execute, replay and
    sweep; the absolute path of such a folder still works."""
    fam, db, plan = setup
    monkeypatch.chdir(tmp_path)
    done = tmp_path / "done"
    assert _cli("execute", plan["all"], "--out", done, "-c", db, "-q")[0] == 0
    n_plans = Catalog(db).sql("SELECT count(*) FROM plans").column(0).to_pylist()
    for args in (
        ("execute", plan["all"], "--out", "s3://models/merged", "-c", db),
        ("replay", done / "mergedb_manifest.json", "--out", "file://x/again"),
        ("sweep", "--base", "base", "--all", "-m", "ties", "--grid", "density=0.5", "--out", "gs://b/sw", "-c", db),
    ):
        code, text = _cli(*args)
        assert code == 1 and "are written to a folder on this machine or a shared file system, not to a URL" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["c.duckdb", "done", "fam"])
    assert Catalog(db).sql("SELECT count(*) FROM plans").column(0).to_pylist() == n_plans
    assert _cli("execute", plan["all"], "--out", tmp_path / "s3:" / "m", "-c", db, "-q")[0] == 0


@pytest.mark.parametrize("force", [False, True])
def test_a_folder_filled_while_the_merge_runs_is_left_as_it_is(setup, tmp_path, force):
    """--out was empty when the merge started, and another program wrote into it meanwhile: the
    install took the --force swap path without --force and failed with 'No such file or directory'.
    Now a clear refusal; the newcomer's file stays, no temporary folder or lock is left."""
    fam, db, plan = setup
    out = tmp_path / "out"

    def fill(n: int) -> None:
        out.mkdir(exist_ok=True)
        (out / "NOTES.md").write_text("mine")

    with pytest.raises(MergeDBError, match="was filled by another program while the merge ran .*NOTES.md"):
        Catalog(db).execute(plan["all"], out, force=force, progress=fill)
    assert sorted(p.name for p in out.iterdir()) == ["NOTES.md"] and (out / "NOTES.md").read_text() == "mine"
    assert _leftovers(out) == []


@pytest.mark.parametrize("mount_ro", [False, True])
def test_a_read_only_catalog_is_refused_before_merging_with_the_fix_that_works(setup, tmp_path, monkeypatch, mount_ro):
    """A catalog that cannot record the run is refused before the merge; on a read-only file system
    the advice is a writable copy, since chmod cannot help there. (Simulated: tests run as root,
    whom permissions do not stop, and a read-only mount needs privileges.)"""
    import types

    from mergedb import catalog as catalog_mod

    fam, db, plan = setup
    real_access = os.access
    monkeypatch.setattr(catalog_mod.os, "access", lambda p, m: False if Path(p) == db else real_access(p, m))
    flags = os.ST_RDONLY if mount_ro else 0
    monkeypatch.setattr(catalog_mod.os, "statvfs", lambda p: types.SimpleNamespace(f_flag=flags))
    words = "on a read-only file system.*copy it to a writable folder" if mount_ro else r"is read-only.*chmod u\+w"
    with pytest.raises(MergeDBError, match=words):
        Catalog(db).execute(plan["all"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_replay_of_moved_or_retimed_inputs_says_what_to_do(setup, tmp_path):
    """Replay reads its inputs where the manifest recorded them: moved, it said a bare 'no such file or
    folder'; copied without their times, it advised re-registering, which replay does not read."""
    fam, db, plan = setup
    out = tmp_path / "out"
    assert _cli("execute", plan["all"], "--out", out, "-c", db, "-q")[0] == 0
    shutil.move(fam, tmp_path / "moved")
    code, said = _cli("replay", out / manifest.MANIFEST, "--out", tmp_path / "again")
    assert code == 1 and "is gone from" in said and "where its plan or manifest found it" in said, said
    shutil.copytree(tmp_path / "moved", fam, copy_function=shutil.copyfile)  # back, with new times
    code, said = _cli("replay", out / manifest.MANIFEST, "--out", tmp_path / "again")
    assert code == 1 and "a replay needs the files as" in said.replace("\n", " "), said
    assert not (tmp_path / "again").exists()


def test_a_swap_recovery_cut_short_and_run_again_keeps_what_it_had_restored(setup, tmp_path):
    """A --force swap killed, then the run recovering it killed after moving some old files back:
    the next recovery took "the new output's files" as its manifest's names less those still in the
    old folder, so it deleted the old files already restored (config.json here), and the old output
    came back with its manifest but without them (review, 2026-12-02). The old output's own manifest
    now says which names are its."""
    from mergedb import outdir

    fam, db, plan = setup
    a, b = tmp_path / "a", tmp_path / "b"
    assert _cli("execute", plan["all"], "--out", a, "-c", db, "-q")[0] == 0
    assert _cli("execute", plan["half"], "--out", b, "-c", db, "-q")[0] == 0
    want = {p.name: p.read_bytes() for p in a.iterdir()}
    assert {"config.json", "model.safetensors", "mergedb_manifest.json"} <= set(want) <= {p.name for p in b.iterdir()}
    out, old, tmp = tmp_path / "out", tmp_path / ".out.mergedb-old-1", b  # the state the cut recovery left:
    shutil.copytree(a, old)  # the old output moved aside, its manifest first ...
    out.mkdir()
    os.replace(b / "model.safetensors", out / "model.safetensors")  # ... new files moved in ...
    os.replace(b / "config.json", out / "config.json")
    os.replace(old / "config.json", out / "config.json")  # ... and an old one already moved back over its new one
    outdir._undo_swap(out, old, tmp)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == want
    assert not old.exists()
    assert check_output(out) == []


@pytest.mark.parametrize("old_holds", ["manifest only", "the whole output"])
def test_an_output_removed_after_a_cut_swap_is_not_a_traceback_forever(setup, tmp_path, old_holds):
    """A --force swap cut after moving the old manifest aside left an output with no manifest; a user
    who removed it got a FileNotFoundError from every later execute into that path (the recovery
    moved the old files back into a folder that was gone; review, 2026-12-02). Now a whole old
    output comes back; a part of one is removed, never installed as if whole."""
    from mergedb import outdir

    fam, db, plan = setup
    a, out = tmp_path / "a", tmp_path / "out"
    assert _cli("execute", plan["all"], "--out", a, "-c", db, "-q")[0] == 0
    want = {p.name: p.read_bytes() for p in a.iterdir()}
    old = tmp_path / f".out{outdir.OLD}999999-0123abcd"
    if old_holds == "manifest only":
        old.mkdir()
        os.replace(a / "mergedb_manifest.json", old / "mergedb_manifest.json")
    else:
        os.replace(a, old)
    outdir.remove_stale(out)  # what the next execute into `out` runs first, under the output's lock
    assert not old.exists()
    if old_holds == "manifest only":
        assert not out.exists()
        code, text = _cli("execute", plan["all"], "--out", out, "-c", db, "-q")
        assert code == 0, text
    else:
        assert {p.name: p.read_bytes() for p in out.iterdir()} == want
    assert check_output(out) == []


def test_a_first_install_makes_its_rename_durable(tmp_path, monkeypatch):
    """Into a new folder the output is one rename; the folder holding it is fsynced after it, so the
    rename outlives a power cut that follows the run's record in the catalog (review, 2026-12-02)."""
    from mergedb import outdir

    synced = []
    real = outdir.fsync_dir
    monkeypatch.setattr(outdir, "fsync_dir", lambda d, files=True: (synced.append((Path(d), files)), real(d, files)))
    tmp = tmp_path / ".out.mergedb-tmp-1-ab"
    tmp.mkdir()
    (tmp / "mergedb_manifest.json").write_text("{}")
    outdir.install(tmp, tmp_path / "out", False)
    assert (tmp_path / "out" / "mergedb_manifest.json").is_file()
    assert (tmp_path, False) in synced


def test_an_out_through_a_loop_of_links_is_refused_by_name(setup, tmp_path):
    """--out under a loop of symbolic links (a -> b, b -> a) ended in RuntimeError and a traceback
    (Python before 3.13 raises that from Path.resolve; review, 2026-12-02); a registered checkpoint
    whose path became such a loop broke every execute the same way."""
    fam, db, plan = setup
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    for out in (tmp_path / "a" / "merged", tmp_path / "a"):
        code, text = _cli("execute", plan["all"], "--out", out, "-c", db, "-q")
        assert code == 1 and "passes through a loop of symbolic links" in text and "Traceback" not in text, text
    xp = Catalog(db).execution_plan(plan["all"])
    with pytest.raises(MergeDBError, match="loop of symbolic links"):
        executor.execute(xp, tmp_path / "a" / "merged")
    gone = tmp_path / "gone"  # a registered expert whose folder is now a loop: other executes still run
    shutil.copytree(fam / "expert_00", gone)
    data = bytearray((gone / "model.safetensors").read_bytes())
    data[-1] ^= 1  # other weights: a copy of expert_00 is refused as registering one model twice
    (gone / "model.safetensors").write_bytes(bytes(data))
    Catalog(db).register([gone], base_model="base", name="gone")
    shutil.rmtree(gone)
    gone.symlink_to(tmp_path / "a")
    code, text = _cli("execute", plan["all"], "--out", tmp_path / "ok", "-c", db, "-q")
    assert code == 0, text


@pytest.mark.parametrize("manifest", ['{"broken": ', "[1, 2]"], ids=["not-json", "not-an-object"])
def test_force_over_an_unreadable_manifest_is_refused_before_the_merge(setup, tmp_path, monkeypatch, manifest):
    """--force over an output whose manifest cannot be read ran the whole merge, then refused to
    install, blaming config.json as "not a file of the mergedb output there" (review, 2026-12-02):
    the manifest's run.files are what --force may replace. Now refused first, naming the manifest."""
    fam, db, plan = setup
    out = tmp_path / "out"
    assert _cli("execute", plan["all"], "--out", out, "-c", db, "-q")[0] == 0
    (out / "mergedb_manifest.json").write_text(manifest)
    before = _snapshot(tmp_path)
    merged = []
    real = executor._write
    monkeypatch.setattr(executor, "_write", lambda *a, **k: (merged.append(1), real(*a, **k))[1])
    code, text = _cli("execute", plan["half"], "--out", out, "--force", "-c", db, "-q")
    assert code == 1 and "mergedb_manifest.json" in text and "restore that file" in text, text
    assert merged == [] and _snapshot(tmp_path) == before and _leftovers(out) == []


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_force_never_replaces_a_file_rewritten_since_mergedb_wrote_it(setup, tmp_path, monkeypatch, name):
    """A user's own file under an output's name (save_pretrained over a merged model after fine-tuning
    it, an edited config.json) was deleted by --force, which chose files by name alone (review,
    2026-12-02). Each file's size and time are in the manifest (run.file_stats); one that differs is
    the user's: refused before the merge, nothing touched. An untouched output is still replaced."""
    fam, db, plan = setup
    out = tmp_path / "out"
    assert _cli("execute", plan["all"], "--out", out, "-c", db, "-q")[0] == 0
    data = (out / name).read_bytes()
    (out / name).write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # the user's version: same size, other bytes
    before = _snapshot(tmp_path)
    merged = []
    real = executor._write
    monkeypatch.setattr(executor, "_write", lambda *a, **k: (merged.append(1), real(*a, **k))[1])
    code, text = _cli("execute", plan["half"], "--out", out, "--force", "-c", db, "-q")
    assert code == 1 and f"{name} was changed since mergedb wrote it" in text, text
    assert merged == [] and _snapshot(tmp_path) == before and _leftovers(out) == []
    # changed while the merge ran (after the check before it): refused at the swap, nothing moved
    (out / name).write_bytes(data)
    os.utime(out / name, ns=(0, json.loads((out / "mergedb_manifest.json").read_text())["run"]["file_stats"][name][1]))
    monkeypatch.setattr(executor, "_write", lambda *a, **k: ((out / name).write_bytes(data + b" "), real(*a, **k))[1])
    code, text = _cli("execute", plan["half"], "--out", out, "--force", "-c", db, "-q")
    assert code == 1 and f"{name} was changed since mergedb wrote it" in text, text
    assert (out / name).read_bytes() == data + b" " and _leftovers(out) == []
    monkeypatch.setattr(executor, "_write", real)
    (out / name).rename(tmp_path / "mine")  # a link in its place: named as a link, not as unlisted
    (out / name).symlink_to(tmp_path / "mine")
    code, text = _cli("execute", plan["half"], "--out", out, "--force", "-c", db, "-q")
    assert code == 1 and f"{name} is a symbolic link, not the file mergedb wrote there" in text, text
    (out / name).unlink()  # the user took their file away: the output is replaced
    assert _cli("execute", plan["half"], "--out", out, "--force", "-c", db, "-q")[0] == 0
    assert check_output(out) == []


@pytest.mark.parametrize("edit", ["trims-key-of-two-types", "trims-count-past-int64", "lora-without-rank"])
def test_replay_refuses_manifest_rows_arrow_cannot_take(setup, tmp_path, edit):
    """Edits re-hashed consistently that pass the field checks but that Arrow cannot make a table of
    (an extra key holding an int in one row and a str in the next, a count past int64), and a lora
    section without its rank: tracebacks from replay until a review found them (2026-12-02)."""
    fam, db, plan = setup
    out = tmp_path / "out"
    assert _cli("execute", plan["half"], "--out", out, "-c", db, "-q")[0] == 0
    path = out / manifest.MANIFEST
    doc = json.loads(path.read_text())
    assert len(doc["trims"]) >= 2
    if edit == "trims-key-of-two-types":
        doc["trims"][0]["zz"], doc["trims"][1]["zz"] = 1, "x"
    elif edit == "trims-count-past-int64":
        doc["trims"][0]["zz"] = 2**64
    else:
        doc["lora"] = {}
    doc["content_hash"] = manifest.content_hash(doc)
    path.write_text(json.dumps(doc))
    code, text = _cli("replay", path, "--out", tmp_path / "again")
    assert code == 1 and ("re-execute the plan" in text or "lora section is missing or malformed" in text), text
    assert not (tmp_path / "again").exists()


def test_check_output_names_a_tensor_the_manifest_does_not_list(setup, tmp_path):
    """A tensor added to the output's own model file, every listed one unchanged, passed check
    --output (only the manifest's names were compared; review, 2026-12-02)."""
    import torch
    from safetensors.torch import load_file, save_file

    fam, db, plan = setup
    out = tmp_path / "out"
    assert _cli("execute", plan["all"], "--out", out, "-c", db, "-q")[0] == 0
    assert check_output(out) == []
    tensors = load_file(out / "model.safetensors")
    tensors["extra.bias"] = torch.ones(4)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    found = check_output(out)
    assert len(found) == 1 and "tensor 'extra.bias' is not in the manifest" in found[0], found


def test_check_output_names_index_entries_and_side_files_a_loader_would_trip_on(setup, tmp_path):
    """A sharded output's index naming a tensor no shard holds (transformers then fails to load), or a
    wrong metadata.total_size; a chat template or tokenizer file dropped into the output (transformers
    picks it up): all passed check --output (review, 2026-12-02). A user's own notes or code do not."""
    fam, db, plan = setup
    out = tmp_path / "out"
    assert _cli("execute", plan["all"], "--out", out, "-c", db, "-q", "--max-shard-size", "300KB")[0] == 0
    assert check_output(out) == []
    index = out / "model.safetensors.index.json"
    good = index.read_text()
    doc = json.loads(good)
    doc["weight_map"]["zzz.extra"] = sorted(set(doc["weight_map"].values()))[-1]
    index.write_text(json.dumps(doc))
    found = check_output(out)
    assert len(found) == 1 and "weight_map names tensors no shard of the output holds: ['zzz.extra']" in found[0]
    doc = json.loads(good)
    doc["metadata"]["total_size"] = 1
    index.write_text(json.dumps(doc))
    found = check_output(out)
    assert len(found) == 1 and "metadata.total_size is 1, the shards' tensors hold" in found[0], found
    index.write_text(good)
    (out / "NOTES.md").write_text("mine")
    (out / "train.py").write_text("print()")
    assert check_output(out) == []
    (out / "chat_template.jinja").write_text("{{ messages }}")
    found = check_output(out)
    assert len(found) == 1 and "chat_template.jinja: not part of this output" in found[0], found


@pytest.mark.parametrize("who", ["expert_01", "base"])
def test_an_input_rewritten_while_execute_reads_it_is_never_installed(setup, tmp_path, monkeypatch, who):
    """A training job saving into an expert's file while `execute` read it: the output (a merge of
    neither version) was installed and its run recorded ok, and `check --output` passed it, since it
    compares an output with its own manifest (review, 2026-12-02). The inputs' fingerprints are taken
    again after the last read: a change is refused, nothing installed, the failed run recorded."""
    fam, db, plan = setup
    out = tmp_path / "out"
    victim = fam / who / "model.safetensors"
    real = executor._write

    def write_then_save(*a, **k):
        res = real(*a, **k)
        data = victim.read_bytes()
        victim.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # the job's next save: same size, new time
        return res

    monkeypatch.setattr(executor, "_write", write_then_save)
    code, text = _cli("execute", plan["half"], "--out", out, "-c", db, "-q")
    assert code == 1 and f"{who} ({fam / who}) changed while this merge read it" in text, text
    assert not out.exists() and _leftovers(out) == []
    assert Catalog(db).sql("SELECT status FROM runs").column(0).to_pylist() == ["failed"]


def test_a_shards_metadata_edited_in_place_is_reported(setup, tmp_path):
    """check --output compared every tensor's bytes, shape and dtype but not a shard's __metadata__:
    {"format": "tf"} written over {"format": "pt"} (same length) passed it, and transformers reads the
    format from there (noticed in the last review, closed here)."""
    fam, db, plan = setup
    out = tmp_path / "out"
    assert _cli("execute", plan["all"], "--out", out, "-c", db, "-q")[0] == 0
    shard = sorted(out.glob("*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    at = raw.index(b'"format":"pt"', 8, 8 + n)
    raw[at : at + 13] = b'"format":"tf"'
    shard.write_bytes(bytes(raw))
    found = check_output(out)
    assert len(found) == 1 and "its __metadata__ is {'format': 'tf'}, not the {'format': 'pt'}" in found[0], found
