"""Help that reads well and answers at once: no heavy import for `--help`, plain metavars, examples."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from mergedb.cli import app

runner = CliRunner()
COMMANDS = sorted(app.registered_commands, key=lambda c: c.name or c.callback.__name__)


def test_cli_import_loads_no_heavy_module():
    code = "import sys, mergedb.cli; print(' '.join(m for m in ('numba', 'duckdb', 'pyarrow') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_library_names_still_import_lazily():
    code = (
        "import mergedb, sys; assert 'duckdb' not in sys.modules; "
        "from mergedb import Catalog, PlanRequest, MergeDBError, RegisterResult, connect, CheckpointRow; "
        "assert mergedb.connect is connect and issubclass(MergeDBError, Exception); print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("name", [c.name or c.callback.__name__.replace("_cmd", "") for c in COMMANDS])
def test_every_command_help_is_plain_and_has_an_example(name):
    res = runner.invoke(app, [name, "--help"], env={"COLUMNS": "100"})
    assert res.exit_code == 0, res.output
    assert "Example:" in res.output
    assert "{" not in res.output and "<list" not in res.output and "<bool>" not in res.output
    assert not re.search(r"\w \.(\s|$)", res.output)  # no "Catalog file ." left by swallowed markup


def test_top_level_help_lists_frontier():
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0 and "frontier" in res.output
