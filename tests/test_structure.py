"""The code's shape (no import cycles, modules a person can read) and the planner's guard rails."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mergedb import planner, synth
from mergedb.catalog import Catalog
from mergedb.cli import app
from mergedb.errors import PlanError
from mergedb.planner import PlanRequest

PACKAGE = Path(__file__).resolve().parent.parent / "mergedb"
runner = CliRunner(env={"COLUMNS": "200"})


def _imports() -> dict[str, set[str]]:
    """module -> the mergedb modules it imports (at any level, lazily or not; TYPE_CHECKING excluded)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.glob("*.py"):
        tree = ast.parse(path.read_text())
        checking = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        deps = set()
        for node in ast.walk(tree):
            if id(node) in checking or not isinstance(node, ast.ImportFrom) or node.level != 1:
                continue
            if node.module:
                deps.add(node.module.split(".")[0])
            else:
                deps.update(a.name for a in node.names)
        graph[path.stem] = deps - {path.stem}
    return graph


def test_import_graph_has_no_cycle():
    graph = _imports()
    assert {"catalog", "planner", "executor", "register", "check", "manifest", "layout"} <= set(graph)
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        if state.get(m) == 1:
            raise AssertionError("import cycle: " + " -> ".join([*stack, m]))
        if state.get(m) == 2:
            return
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if d in graph:
                visit(d, [*stack, m])
        state[m] = 2

    for m in sorted(graph):
        visit(m, [])


def test_modules_are_short_or_say_why():
    for path in PACKAGE.glob("*.py"):
        n = len(path.read_text().splitlines())
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert n <= 470 or "long because" in doc, f"{path.name} has {n} lines and no word on why"


def test_readme_module_map_names_every_module():
    """README's module map ("One module per concept") is where a newcomer starts: every module of the
    package has a row there (16 had none before this test)."""
    readme = (PACKAGE.parent / "README.md").read_text()
    table = readme[readme.index("| module | what it answers |") :].split("\n\n", 1)[0]
    named = {cell.strip("` ") for line in table.splitlines()[2:] for cell in line.split("|")[1].split(",")}
    modules = {p.name for p in PACKAGE.glob("*.py")} - {"__init__.py"}
    assert sorted(modules - named) == []
    assert sorted(named - modules) == []  # and names none that is gone


def _packages(module: str) -> set[str]:
    """The top-level packages `module` imports from outside mergedb (at any level, lazily or not)."""
    out = set()
    for node in ast.walk(ast.parse((PACKAGE / f"{module}.py").read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out - {"__future__"}


def test_the_tensor_math_imports_neither_duckdb_nor_the_file_formats():
    """What the README's code map says of the tensor math (the check only followed mergedb's own
    imports, so `import duckdb` in kernels.py would have passed: code-health review)."""
    graph = _imports()
    math = {"kernels", "jitkernels", "native", "kernelargs", "deltapass", "regkernels", "stats", "summary"}
    math |= {"lowrank", "methods"}
    for m in sorted(math):
        assert not _packages(m) & {"duckdb", "pyarrow", "safetensors", "torch", "fsspec", "ray"}, m
        assert graph[m] <= math | {"errors", "jitload"}, (m, graph[m] - math)


def test_layers_never_reach_upward():
    graph = _imports()
    assert not graph["methods"] - {"errors"}, "methods is pure parameter logic"
    assert not graph["kernels"] - {"methods", "errors", "jitkernels", "native"}, "kernels are pure tensor math"
    assert not graph["native"] - {"errors", "kernelargs"}, "native is C kernels loaded with ctypes"
    assert not graph["kernelargs"], "kernelargs is a leaf: numpy arrays checked for the C kernels"
    assert not graph["jitkernels"] - {"jitload"}, "jitkernels is numba's kernels"
    assert not graph["deltapass"] - {"jitload"}, "deltapass is numba's registration kernels"
    assert not graph["regkernels"] - {"native", "deltapass"}, "regkernels only chooses registration's kernels"
    assert not graph["jitload"], "jitload is a leaf: numba, imported with Ctrl-C held"
    assert not graph["plainfile"], "plainfile is a leaf: small files read whole"
    assert not graph["stray"] - {"errors"}, "stray only looks at names in a folder"
    assert not graph["jsondoc"] - {"errors"}, "jsondoc is JSON text read and written, nothing of mergedb's"
    assert not graph["tensorfile"] - {"errors", "plainfile", "jsondoc", "writeout"}
    assert not graph["writeout"], "writeout is a leaf: one libc call"
    assert not graph["attach"], "attach is a leaf: DuckDB's ATTACH and DETACH on the process's database"
    for m in ("executor", "manifest", "layout", "kernels"):
        assert "catalog" not in graph[m] and "planner" not in graph[m], m


@pytest.fixture
def registered(tmp_path):
    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=11)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base", block_size=32 * 1024)
    return cat, tmp_path / "c.duckdb"


def _n_plans(cat: Catalog) -> int:
    return cat.sql("SELECT count(*) AS n FROM plans").column("n")[0].as_py()


def test_plan_and_show_plan_print_when_the_estimate_is_skipped(registered, monkeypatch):
    # Large families skip the sketch estimate (above ESTIMATE_MAX_ROWS omitted blocks); printing such
    # a plan used to raise a TypeError. Reach it both ways: the default threshold and --no-estimate.
    cat, db = registered
    monkeypatch.setattr(planner, "ESTIMATE_MAX_ROWS", 0)
    res = runner.invoke(app, ["plan", "--base", "base", "--all", "-m", "task_arithmetic", "-b", "30%", "-c", str(db)])
    assert res.exit_code == 0, res.output
    assert "estimate not computed (--no-estimate, or skipped for a large plan" in res.output
    res = runner.invoke(app, ["show-plan", "1", "-c", str(db)])
    assert res.exit_code == 0, res.output
    assert "estimate not computed" in res.output
    monkeypatch.setattr(planner, "ESTIMATE_MAX_ROWS", 10**9)
    res = runner.invoke(
        app, ["plan", "--base", "base", "--all", "-m", "linear", "-b", "30%", "--no-estimate", "-c", str(db)]
    )
    # it said "skipped (too many omitted blocks …)" of a plan whose user turned it off (review, 2026-12-03)
    assert res.exit_code == 0 and "estimate not computed (--no-estimate" in res.output, res.output
    assert cat.get_plan(1).est_error is None and cat.get_plan(2).est_error is None


def test_unknown_strategy_is_refused_before_any_sql(registered, monkeypatch):
    cat, _ = registered

    def no_sql(*a, **k):
        raise AssertionError("the planner ran SQL before validating the strategy")

    monkeypatch.setattr(planner, "_resolve", no_sql)
    with pytest.raises(PlanError, match="unknown strategy"):
        cat.plan(PlanRequest("base", None, "linear", "50%", strategy="best"))
    assert _n_plans(cat) == 0


def test_fill_that_does_not_settle_raises_and_stores_nothing(registered, monkeypatch):
    cat, _ = registered
    monkeypatch.setattr(planner, "MAX_FILL_PASSES", 0)
    with pytest.raises(PlanError, match="did not settle"):
        cat.plan(PlanRequest("base", None, "task_arithmetic", "40%"))
    assert _n_plans(cat) == 0


def test_every_test_the_readme_cites_exists():
    """The README's failure-mode table and prose cite tests as `test_module::test_name` (119 today): a
    test renamed or removed would leave a claim that nothing checks."""
    import re

    readme = (PACKAGE.parent / "README.md").read_text()
    cited = set(re.findall(r"\b(test_\w+)::(test_\w+)", readme))
    assert len(cited) > 100
    tests = PACKAGE.parent / "tests"
    missing = []
    for module, name in sorted(cited):
        path = tests / f"{module}.py"
        tree = ast.parse(path.read_text()) if path.exists() else ast.Module(body=[], type_ignores=[])
        if name not in {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}:
            missing.append(f"{module}::{name}")
    assert missing == []
