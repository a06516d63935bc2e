"""The benchmark suite cannot rot: --quick runs every benchmark at tiny size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_suite_runs_and_reports(tmp_path):
    env = {**os.environ, "MERGEDB_BENCH_DIR": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--repeats", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name in ("physical", "execute_targets", "scaling", "fidelity", "overheads", "blocksize"):
        doc = json.loads((tmp_path / "results" / f"{name}-quick.json").read_text())
        assert doc["quick"] is True
    targets = json.loads((tmp_path / "results" / "execute_targets-quick.json").read_text())
    assert targets["10%"]["expert_bytes"] <= targets["10%"]["budget_bytes"]
    scaling = json.loads((tmp_path / "results" / "scaling-quick.json").read_text())
    for row in scaling["rows"]:
        if row["series"] != "mergekit":
            assert row["expert_bytes"] == row["selected_bytes"] <= row["budget_bytes"]
    report = (tmp_path / "RESULTS-quick.md").read_text()
    assert "Executor targets" in report and "Fidelity frontier" in report
    assert list((tmp_path / "results").glob("*.png"))


def test_bench_ray_quick_runs_and_reports(tmp_path):
    """benchmarks/bench_ray.py at tiny size: every arm wrote the same output, and its report section renders."""
    env = {**os.environ, "MERGEDB_BENCH_DIR": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_ray", "--quick", "--repeats", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "results" / "ray-quick.json").read_text())
    assert [row["arm"] for row in doc["rows"]] == ["local", "ray-1", "ray-2"]
    assert len({row["content_hash"] for row in doc["rows"]}) == 1
    assert {row["expert_bytes"] for row in doc["rows"]} == {doc["selected_bytes"]}
    assert all(row["shards"] >= 2 for row in doc["rows"])
    from benchmarks.report import _ray

    text = "\n".join(_ray(doc))
    assert "## Ray executor (issue 15)" in text and "| 0 | ray-2 |" in text


def test_bench_many_tensors_runs_both_sides(tmp_path):
    """benchmarks/bench_many_tensors.py at tiny size, this checkout against itself: every step of
    both sides measured, the same merged bytes (the benchmark refuses otherwise)."""
    env = {**os.environ, "MERGEDB_BENCH_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "benchmarks.bench_many_tensors", str(ROOT), "--tensors", "30", "--experts", "2"]
    r = subprocess.run([*cmd, "--rounds", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((tmp_path / "results" / "many-tensors.json").read_text())
    for side in ("new", "baseline"):
        for step in ("register", "task_arithmetic", "ties"):
            assert doc["summary"][f"{side}/{step}/seconds"] > 0 and doc["summary"][f"{side}/{step}/peak_rss"] > 0


def test_the_report_compares_only_measurements_of_one_run():
    """Ratios between a sweep and mergekit are printed only for entries of one run (bench_sweep writes a
    run id into each; the guard used to pass any two entries without one, so a --mergekit-only run would
    have been compared with sweeps of another); the targets table computes no share of a disk rate from
    another run, and judges planning on the whole call a user waits for (benchmark review, 2026-12-03)."""
    from benchmarks import report

    doc = json.loads((ROOT / "benchmarks" / "results" / "sweep.json").read_text())
    assert "faster than mergekit" not in "\n".join(report._sweep(doc))  # mergekit kept from another run
    for entry in doc["sweeps"] + doc.get("mergekit", []):
        entry["run"] = "2026-12-03T10:00:00"
    assert "faster than mergekit" in "\n".join(report._sweep(doc))
    for entry in doc.get("mergekit", []):
        del entry["run"]
    assert "faster than mergekit" not in "\n".join(report._sweep(doc))
    docs = {n: report._load(n, False) for n in ("scaling", "physical", "planner-small", "execute_targets", "share")}
    rows = [ln for ln in report._targets(docs) if ln.startswith("| ")]  # the table, not ANALYSIS.md below it
    assert rows and not [ln for ln in rows if "of sequential read" in ln]
    planning = [ln for ln in rows if ln.startswith("| planning ≤ 1%")]
    assert any("whole call" in ln for ln in planning) and any("planner alone (reported)" in ln for ln in planning)
