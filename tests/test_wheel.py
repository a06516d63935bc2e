"""The SQL files load from an installed wheel, not only from a source checkout."""

from __future__ import annotations

import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_in_fresh_venv(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(ROOT)],
        check=True,
    )
    (wheel,) = dist.glob("mergedb-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "mergedb/schema/001_catalog.sql" in names
    assert any(n.startswith("mergedb/queries/") for n in names) or not list((ROOT / "queries").glob("*.sql"))

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    # dependencies come from this environment's site-packages (a .pth there is not processed, so
    # this environment's editable mergedb stays invisible); mergedb itself only from the wheel
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", purelib, str(wheel)], check=True
    )
    where = subprocess.run(
        [str(py), "-c", "import mergedb.resources as c; print(c.__file__, c.resource_dir('schema'))"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout
    assert str(ROOT) not in where and purelib in where
    cli = [str(py), "-m", "mergedb.cli"]
    assert subprocess.run(cli + ["--help"], capture_output=True, cwd=tmp_path).returncode == 0
    subprocess.run(cli + ["synth", "fam", "--experts", "1"], check=True, cwd=tmp_path, capture_output=True)
    res = subprocess.run(
        cli + ["register", "fam", "--base-model", "base", "-c", "c.duckdb", "-q"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    res = subprocess.run(
        cli + ["sql", "SELECT count(*) AS n FROM expert_costs", "-c", "c.duckdb", "-f", "csv"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert res.stdout.split() == ["n", "1"]
