"""Help that reads well and answers at once: no heavy import for `--help`, plain metavars, examples."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mergedb import native
from mergedb.catalog import Catalog
from mergedb.cli import app

runner = CliRunner()
COMMANDS = sorted(app.registered_commands, key=lambda c: c.name or c.callback.__name__)


def test_cli_import_loads_no_heavy_module():
    code = "import sys, mergedb.cli; print(' '.join(m for m in ('numba', 'duckdb', 'pyarrow') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_executor_imports_the_merge_engine_only_when_a_merge_starts():
    # numba's import (~0.12 s) runs inside execute, while fetchplan.Prefetch reads the first inputs
    code = "import sys, mergedb.executor; print(' '.join(m for m in ('numba', 'mergedb.merger') if m in sys.modules))"
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


# What `mergedb execute` and `mergedb plan` must not load: each is a cost paid by every such process
# (planning, registration and the statistics kernels for execute; the merge engine, and numba (~0.17 s
# to import) below planpass's 4M candidates, for plan).
# Neither loads pydantic (typer's coercion: cliparse.py) nor pyarrow.compute (~0.03-0.06 s each); plan
# not numpy.ma either (np.unique and pa.array(ndarray) import it: ~9 ms of a first plan). A quiet
# execute prints nothing, so it does not load rich (~20 ms) either.
LIGHT = ("pydantic", "pyarrow.compute")
NOT_FOR_EXECUTE = (
    "planner",
    "register",
    "stats",
    "scan",
    "lorascan",
    "loramerge",
    "frontier",
    "mkplan",
    "sweep",
    "rich",
    *LIGHT,
)
NOT_FOR_PLAN = (
    "executor",
    "merger",
    "kernels",
    "register",
    "scan",
    "lorascan",
    "loramerge",
    "sweep",
    "numba",
    *LIGHT,
    "numpy.ma",
)
# runs the CLI as `mergedb` does and prints the mergedb modules loaded when the process ends
RUN_CLI = (
    "import atexit, runpy, sys\n"
    "mine = lambda m: m.startswith('mergedb.') or m in ('numba', 'pydantic', 'pyarrow.compute', 'numpy.ma', 'rich')\n"
    "atexit.register(lambda: print('LOADED', *sorted(filter(mine, sys.modules))))\n"
    "sys.argv = ['mergedb', *sys.argv[1:]]\n"
    "runpy.run_module('mergedb.cli', run_name='__main__')\n"
)


def _loaded(cwd: Path, *args: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", RUN_CLI, *args], capture_output=True, text=True, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return {m.removeprefix("mergedb.") for m in out.stdout.split("LOADED", 1)[1].split()}


def test_execute_and_plan_import_only_what_they_use(tmp_path, tiny_family):
    db = str(tmp_path / "c.duckdb")
    Catalog(db).register([tiny_family], base_model="base")
    plan = _loaded(tmp_path, "plan", "--base", "base", "--all", "--method", "ties", "--budget", "50%", "-c", db)
    assert "planner" in plan and not set(NOT_FOR_PLAN) & plan, sorted(plan)
    execute = _loaded(tmp_path, "execute", "1", "--out", str(tmp_path / "out"), "-c", db, "-q")
    assert (tmp_path / "out" / "model.safetensors").exists()
    assert "executor" in execute and not set(NOT_FOR_EXECUTE) & execute, sorted(execute)
    if native.load() is not None:  # the merge kernels in C: numba is neither imported nor loaded
        assert not {"numba", "jitkernels", "jitload"} & execute, sorted(execute)


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


def test_plan_help_states_each_methods_defaults():
    """plan's (and frontier's) --density, --lambda, --gamma, --epsilon and --normalize help state the
    per-method defaults, written out in cli.py; they must say what methods.METHODS does."""
    import inspect

    from mergedb import cli
    from mergedb.methods import METHODS

    said = {}  # "[default: ties 0.2; dare_linear, dare_ties 0.5; …]" -> {"ties": "0.2", …}
    for group in re.fullmatch(r"\[default: (.*)\]", cli.DENSITY_DEFAULTS).group(1).split("; "):
        names, value = group.rsplit(" ", 1)
        said |= {name: value for name in names.split(", ")}
    assert said == {m.name: f"{m.defaults['density']:g}" for m in METHODS.values() if "density" in m.defaults}
    normalized = [m.name for m in METHODS.values() if m.defaults.get("normalize")]
    assert cli.NORMALIZE_DEFAULTS == f"[default: on for {', '.join(normalized)}]"
    helps: dict[str, set[str]] = {}
    for c in app.registered_commands:
        if c.callback.__name__ in ("plan", "frontier"):
            for p in inspect.signature(c.callback).parameters.values():
                for decl in p.default.param_decls:
                    helps.setdefault(decl, set()).add(p.default.help)
    for key in ("lambda", "gamma", "epsilon"):
        (value,) = {m.defaults[key] for m in METHODS.values() if key in m.defaults}  # one for every method
        (text,) = helps[f"--{key}"]  # the same words in both commands
        assert text.endswith(f"[default: {value:g}]"), text
    assert helps["--density"] == {f"Fraction of each delta kept. {cli.DENSITY_DEFAULTS}"}
