"""Kill torture: SIGKILL `mergedb register` and `mergedb execute` at random moments, many times.

Each trial checks that the catalog opens and is consistent (exactly the state before or after),
that no output folder looks complete unless it is, and that rerunning succeeds with the same bytes
as an uninterrupted run. MERGEDB_TORTURE_KILLS sets the number of kills per command (default 5;
the recorded run used 50: `MERGEDB_TORTURE_KILLS=50 python -m pytest -m torture`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mergedb import executor, synth
from mergedb.catalog import Catalog
from mergedb.check import check_catalog, check_output
from mergedb.planner import PlanRequest

KILLS = int(os.environ.get("MERGEDB_TORTURE_KILLS", "5"))
CLI = [sys.executable, "-m", "mergedb.cli"]
pytestmark = pytest.mark.torture


def content(cat: Catalog) -> dict:
    q = {
        "checkpoints": "SELECT name, role, fingerprint, content_hash FROM checkpoints ORDER BY name",
        "blocks": "SELECT c.name, eb.tensor_idx, eb.block_idx, eb.delta_norm, eb.content_hash FROM expert_blocks eb "
        "JOIN checkpoints c USING (checkpoint_id) ORDER BY 1, 2, 3",
        "tensors": "SELECT c.name, et.tensor_idx, et.grid_threshold FROM expert_tensors et "
        "JOIN checkpoints c USING (checkpoint_id) ORDER BY 1, 2",
    }
    return {k: cat.sql(v).to_pylist() for k, v in q.items()}


def kill_after(cmd: list[str], delay: float) -> int:
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay)
    p.send_signal(signal.SIGKILL)
    return p.wait()


def test_kill_register(tmp_path):
    fam = synth.make_family(tmp_path / "fam", experts=3, size="tiny", seed=41)
    ref = Catalog(tmp_path / "ref.duckdb")
    ref.register([fam], base_model="base")
    want = content(ref)
    t0 = time.perf_counter()
    subprocess.run(
        CLI + ["register", str(fam), "--base-model", "base", "-c", str(tmp_path / "t.duckdb"), "-q"], check=True
    )
    duration = time.perf_counter() - t0
    rng = random.Random(0)
    outcomes = {"before": 0, "after": 0}
    for i in range(KILLS):
        db = tmp_path / f"k{i}.duckdb"
        kill_after(CLI + ["register", str(fam), "--base-model", "base", "-c", str(db), "-q"], rng.uniform(0, duration))
        cat = Catalog(db)
        if db.exists():
            got = content(cat) if _has_schema(cat) else None
            assert got is None or got == want or got == {k: [] for k in want}, f"torn catalog after kill {i}"
            outcomes["after" if got == want else "before"] += 1
            if got is not None:
                assert check_catalog(cat) == []
        else:
            outcomes["before"] += 1
        cat.register([fam], base_model="base")
        assert content(cat) == want
        for p in tmp_path.glob(f"k{i}.duckdb*"):
            p.unlink()
    print("register kills:", outcomes)


def _has_schema(cat: Catalog) -> bool:
    try:
        cat.sql("SELECT 1 FROM expert_blocks LIMIT 1")
        return True
    except Exception:
        return False


def test_kill_execute(tmp_path):
    fam = synth.make_family(tmp_path / "fam", experts=3, size="small", seed=42)
    db = tmp_path / "c.duckdb"
    cat = Catalog(db)
    cat.register([fam], base_model="base")
    plan = cat.plan(PlanRequest("base", None, "ties", "60%"))
    ref = executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "ref")
    t0 = time.perf_counter()
    subprocess.run(
        CLI + ["execute", str(plan.plan_id), "--out", str(tmp_path / "timing"), "-c", str(db), "-q"], check=True
    )
    duration = time.perf_counter() - t0
    rng = random.Random(1)
    outcomes = {"absent": 0, "complete": 0}
    for i in range(KILLS):
        out = tmp_path / "out"
        kill_after(
            CLI + ["execute", str(plan.plan_id), "--out", str(out), "-c", str(db), "-q", "--force"],
            rng.uniform(0, duration),
        )
        if out.exists():
            # whatever exists under the final name is complete and intact
            assert check_output(out) == [], f"torn output after kill {i}"
            outcomes["complete"] += 1
        else:
            outcomes["absent"] += 1
        r = subprocess.run(
            CLI + ["execute", str(plan.plan_id), "--out", str(out), "-c", str(db), "-q", "--force"],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        m = json.loads((out / "mergedb_manifest.json").read_text())
        assert m["content_hash"] == ref.manifest["content_hash"]
        assert (out / "model.safetensors").read_bytes() == (tmp_path / "ref" / "model.safetensors").read_bytes()
        assert not [p for p in tmp_path.iterdir() if "mergedb-tmp" in p.name], "stale temporary folders pile up"
        assert check_catalog(cat) == []
        if i % 2:
            shutil.rmtree(out)  # alternate: kill into a fresh folder, and over a previous output (--force)
    print("execute kills:", outcomes)


def test_kill_sweep(tmp_path):
    """SIGKILL `mergedb sweep` anywhere: its plans are all stored or none, every output folder under
    its final name is complete and has the bytes of an uninterrupted sweep, every run recorded ok
    names a complete output, and `mergedb execute` finishes the rest with the same bytes."""
    fam = synth.make_family(tmp_path / "fam", experts=3, size="small", seed=43)
    db = tmp_path / "c.duckdb"
    cat = Catalog(db)
    cat.register([fam], base_model="base")
    points = [f"density={d}-lambda={lam}" for d in ("0.2", "0.5") for lam in ("0.5", "1")]

    grid = ["--grid", "density=0.2,0.5", "--grid", "lambda=0.5,1", "--max-parallel", "2", "-c", str(db)]

    def sweep(prefix: str, out) -> list[str]:
        return (
            CLI
            + ["sweep", "--base", "base", "--all", "-m", "ties", "-b", "60%", "--name", prefix, "--out", str(out)]
            + grid
        )

    t0 = time.perf_counter()
    subprocess.run(sweep("ref", tmp_path / "ref"), check=True, capture_output=True)
    duration = time.perf_counter() - t0
    want = {p: (tmp_path / "ref" / f"ref-{p}" / "model.safetensors").read_bytes() for p in points}
    rng = random.Random(2)
    outcomes = {"planned": 0, "not planned": 0, "outputs complete": 0}
    for i in range(KILLS):
        prefix, out = f"k{i}", tmp_path / f"out{i}"
        kill_after(sweep(prefix, out), rng.uniform(0, duration))
        stored = [
            r["name"] for r in cat.sql("SELECT name FROM plans WHERE starts_with(name, ?)", [f"{prefix}-"]).to_pylist()
        ]
        assert sorted(stored) in ([], sorted(f"{prefix}-{p}" for p in points)), f"torn plans after kill {i}"
        assert check_catalog(cat) == []
        outcomes["planned" if stored else "not planned"] += 1
        for d in sorted(out.iterdir()) if out.exists() else []:
            if d.name.startswith("."):  # a killed run's temporary folder or lock: never under a plan's name
                continue
            assert check_output(d) == [], f"torn output {d.name} after kill {i}"
            assert (d / "model.safetensors").read_bytes() == want[d.name.removeprefix(f"{prefix}-")]
            outcomes["outputs complete"] += 1
        for r in cat.sql("SELECT out FROM runs WHERE status = 'ok' AND starts_with(out, ?)", [str(out)]).to_pylist():
            assert check_output(Path(r["out"])) == [], f"a run recorded ok without its output after kill {i}"
        for name in stored:  # finish the sweep plan by plan
            r = subprocess.run(
                CLI + ["execute", name, "--out", str(out / name), "--force", "-q", "-c", str(db)],
                capture_output=True,
                text=True,
            )
            assert r.returncode == 0, r.stderr
            assert (out / name / "model.safetensors").read_bytes() == want[name.removeprefix(f"{prefix}-")]
        if stored:
            assert not [p for p in out.iterdir() if "mergedb-tmp" in p.name], "stale temporary folders pile up"
    print("sweep kills:", outcomes)
