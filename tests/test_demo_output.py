"""The demo tells the truth in 80 columns: no cut cell, and every budget at least as fast as the full read
(cold cache for every run: the eviction must be real)."""

from __future__ import annotations

import os
import re
import subprocess
import sys


def _run(d) -> tuple[str, list[float]]:
    env = {**os.environ, "COLUMNS": "80"}
    out = subprocess.run(
        [sys.executable, "-m", "mergedb.cli", "demo", "--dir", str(d)], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if re.match(r"^\d+%\s", line)]
    assert [r.split()[0] for r in rows] == ["100%", "50%", "10%"], out.stdout
    for line in out.stdout.splitlines():
        assert len(line.rstrip()) <= 80, line
    table = out.stdout.split("\nread:")[0]  # the table, before its legend
    assert "…" not in table, out.stdout
    speedups = [float(re.search(r"([\d.]+)×", r).group(1)) for r in rows]
    return out.stdout, speedups


def test_demo_in_80_columns_is_whole_and_faster_at_every_budget(tmp_path):
    text, speedups = _run(tmp_path / "d")
    if min(speedups) < 1:  # a busy moment of a shared disk: once more
        text, speedups = _run(tmp_path / "d")
    assert min(speedups) >= 1, text
    assert speedups[-1] > 1.2, text  # 10% of the expert bytes: clearly faster
