"""examples/search.py: a search that is killed and restarted makes the choices of one never stopped.

The reference is the same search run without a kill in another folder: same candidates (plan
names, weights, density) and the same scores, each candidate scored once."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from mergedb.catalog import Catalog

SEARCH = Path(__file__).resolve().parents[1] / "examples" / "search.py"
ARGS = ["--generations", "3", "--population", "3", "--seed", "4"]


def _scores(workdir: Path) -> list[dict]:
    return (
        Catalog(workdir / "search.duckdb")
        .sql(
            "SELECT s.plan, s.value, s.params, list(e.weight ORDER BY e.position) AS weights FROM plan_scores s "
            "JOIN plan_experts e USING (plan_id) GROUP BY ALL ORDER BY s.plan"
        )
        .to_pylist()
    )


def test_search_resumes_after_a_kill(tmp_path):
    whole = subprocess.run(
        [sys.executable, str(SEARCH), "--workdir", str(tmp_path / "a"), *ARGS], capture_output=True, text=True
    )
    assert whole.returncode == 0, whole.stderr
    want = _scores(tmp_path / "a")
    assert len(want) == 9 and len({r["plan"] for r in want}) == 9
    assert "best after 3 generations" in whole.stdout

    cmd = [sys.executable, str(SEARCH), "--workdir", str(tmp_path / "b"), *ARGS]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in p.stdout:
        if line.startswith("generation 0"):  # the first generation is scored: kill during the second
            p.send_signal(signal.SIGKILL)
            break
    p.wait()
    p.stdout.close()
    part = _scores(tmp_path / "b")
    assert 3 <= len(part) < 9, "the kill was meant to land during the second generation"
    again = subprocess.run(cmd, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr
    assert f"resuming: {len(part)} candidates already scored" in again.stdout
    assert _scores(tmp_path / "b") == want
    assert again.stdout.splitlines()[-1] == whole.stdout.splitlines()[-1]


def test_a_run_killed_while_it_writes_its_family_does_not_break_the_next(tmp_path):
    """A kill while the family was written left family/base with a 0-byte file, which every restart
    then refused as a broken checkpoint (search review). The family is written beside its place and
    renamed into it: what a kill leaves is family.partial, which the next run writes again."""
    (tmp_path / "w" / "family.partial" / "base").mkdir(parents=True)
    (tmp_path / "w" / "family.partial" / "base" / "model.safetensors").write_bytes(b"")  # a killed run's
    run = subprocess.run(
        [sys.executable, str(SEARCH), "--workdir", str(tmp_path / "w"), "--generations", "1", "--population", "2"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert not (tmp_path / "w" / "family.partial").exists() and (tmp_path / "w" / "family" / "base").is_dir()
