"""The library as an embedding program calls it: arguments of the wrong type or value get a
MergeDBError naming them, before anything is planned, read or stored (a set of experts used to
bind the weights in no fixed order, a str path was scanned letter by letter, flags given as
"no" were true, and bare TypeErrors came from deep inside)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import mergedb
from mergedb import check, executor, synth
from mergedb.catalog import Catalog
from mergedb.errors import CatalogError, MergeDBError, PlanError
from mergedb.planner import PlanRequest


@pytest.fixture(scope="module")
def cat(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    fam = synth.make_family(root / "fam", experts=2, size="tiny", seed=1)
    cat = Catalog(root / "c.duckdb")
    cat.register(str(fam / "base"), base=True)  # one path as a str: that folder, not its letters
    cat.register(fam / "expert_00", base_model="base")
    cat.register([fam / "expert_01"], base_model="base")
    cat.plan(PlanRequest("base", None, "ties", "50%"))
    return cat


def _plans(cat: Catalog) -> int:
    return cat.sql("SELECT count(*) AS n FROM plans").column("n")[0].as_py()


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"experts": {"expert_00", "expert_01"}}, "experts must be a list or tuple of names"),
        ({"experts": "expert_00"}, "experts must be a list or tuple of names"),
        ({"experts": 3}, "experts must be a list or tuple"),
        ({"weights": 1.0}, "weights must be a list or tuple, one per expert"),
        ({"params": None}, "params must be a dict"),
        ({"name": 5}, "name must be a str or None"),
        ({"estimate": "no"}, "estimate must be True, False or None"),
        ({"allow_nonfinite": "no"}, "allow_nonfinite must be True or False"),
        ({"tensor_params": {"a": 1}}, "tensor_params must be a pyarrow Table"),
        ({"method": ["ties"]}, "method must be a method's name"),
        ({"strategy": "bogus"}, "unknown strategy 'bogus'"),
        ({"seed": 1.5}, "seed must be a whole number"),
    ],
)
def test_plan_requests_of_the_wrong_type_are_refused_when_made(fields, words):
    with pytest.raises(PlanError, match=words):
        PlanRequest(**{"base": "base", "experts": None, "method": "ties", **fields})


def test_lists_become_tuples_and_non_requests_are_refused(cat):
    req = PlanRequest("base", ["expert_01", "expert_00"], "linear", "all", [1.0, 0.25])
    assert req.experts == ("expert_01", "expert_00") and req.weights == (1.0, 0.25)
    assert PlanRequest("base", None, "linear", weights=np.array([1.0, 0.25])).weights == (1.0, 0.25)
    before = _plans(cat)
    for call in (cat.plan, cat.plan_candidates, cat.frontier):
        with pytest.raises(PlanError, match="expected a PlanRequest"):
            call(None)
    got = cat.frontier(req, "50%")  # one budget, not "5", "0", "%"
    assert [p.budget_spec for p in got] == ["50%"]
    assert _plans(cat) == before


def test_execute_sql_score_register_and_connect_arguments(cat, tmp_path):
    before = _plans(cat)
    for kw, words in (
        ({"out": None}, "writes into a folder path"),
        ({"out": 5}, "writes into a folder path"),
        ({"max_shard_size": -1}, "max_shard_size is a whole number of bytes"),
        ({"max_shard_size": 1.5}, "max_shard_size is a whole number of bytes"),
        ({"max_shard_size": True}, "max_shard_size is a whole number of bytes"),
        ({"verify": "no"}, "verify is True or False"),
        ({"force": "yes"}, "force is True or False"),
        ({"progress": 5}, "progress is a function or None"),
        ({"out": ""}, "got an empty one"),
    ):
        with pytest.raises(MergeDBError, match=words):
            cat.execute(1, **{"out": tmp_path / "o", **kw})
        # the README's library route checked none of them: force="no" replaced an output (embed review)
        with pytest.raises(MergeDBError, match=words):
            executor.execute(cat.execution_plan(1), **{"out": tmp_path / "o", **kw})
    assert not (tmp_path / "o").exists()
    executor.execute(cat.execution_plan(1), tmp_path / "o", max_shard_size=np.int64(10**9))  # a whole number
    assert json.loads((tmp_path / "o" / "mergedb_manifest.json").read_text())["run"]["max_shard_size"] == 10**9
    for kw, words in (({"force": "no"}, "force is True or False"), ({"progress": 5}, "progress is a function")):
        with pytest.raises(MergeDBError, match=words):
            executor.replay(tmp_path / "o", tmp_path / "o", **kw)
    assert check.check_output(tmp_path / "o") == []
    with pytest.raises(MergeDBError, match="takes the query as a str"):
        cat.sql(None)
    with pytest.raises(MergeDBError, match="params are a list"):
        cat.sql("SELECT ? AS a", 5)
    assert cat.sql("SELECT $a AS a", {"a": 7}).column("a")[0].as_py() == 7
    with pytest.raises(MergeDBError, match="not finite"):
        cat.record_score(1, "loss", 10**400)
    for paths, kw, words in (
        (None, {}, "takes a list of paths"),
        ([1], {}, "takes a list of paths"),
        ([], {}, "needs a path"),
        ([tmp_path], {"refresh": "no"}, "refresh is True or False"),
        ([tmp_path], {"progress": 5}, "progress is a function or None"),
        ([tmp_path], {"on_total": "x"}, "on_total is a function or None"),
        ([tmp_path], {"scanner": 5}, "scanner is a function or None"),
    ):
        with pytest.raises(MergeDBError, match=words):
            cat.register(paths, base_model="base", **kw)
    with pytest.raises(MergeDBError, match="is not a str"):
        cat.register([tmp_path], base_model="base", name=5)
    with pytest.raises(MergeDBError, match="base is True or False"):
        cat.register([tmp_path], base="yes")
    with pytest.raises(CatalogError, match="a catalog path is a str or a path"):
        mergedb.connect(5)
    assert _plans(cat) == before


def test_in_memory_sweep_checks_its_options_before_planning(cat):
    before = _plans(cat)
    req = PlanRequest("base", None, "ties", "50%", name="s1")
    for kw, words in (
        ({"dtype": "fp8"}, "unknown --dtype 'fp8'"),
        ({"dtype": 5}, "dtype is bf16, fp16, fp32 or None"),
        ({"cache_bytes": None}, "cache_bytes is a whole number"),
        ({"cache_bytes": -1}, "cache_bytes is a whole number"),
        ({"into": object()}, "into= takes a torch module"),
        ({"threads": 0}, "threads must be"),
    ):
        with pytest.raises(MergeDBError, match=words):
            list(cat.sweep([req], **kw))
    assert _plans(cat) == before
    (plan, state), *rest = list(cat.sweep(req, dtype=["fp32"]))  # one request alone; a dtype per plan
    assert plan.name == "s1" and not rest and {a.dtype.name for a in state.values()} >= {"float32"}


def test_executor_functions_name_what_they_take(cat, tmp_path):
    """executor.execute and merge_to_dict given a plan id or summary failed deep inside with an
    AttributeError ('int' object has no attribute 'base'), and a bad folder with a TypeError."""
    from mergedb import executor

    pid = cat.plans()[0].plan_id if cat.plans() else cat.plan(mergedb.PlanRequest("base", None, "linear")).plan_id
    for call in (
        lambda: executor.execute(pid, tmp_path / "o"),
        lambda: executor.execute(cat.get_plan(pid), tmp_path / "o"),
        lambda: executor.merge_to_dict(pid),
    ):
        with pytest.raises(MergeDBError, match=r"takes an ExecutionPlan \(Catalog.execution_plan\(PLAN\)\)"):
            call()
    xp = cat.execution_plan(pid)
    for out in (None, 5, ""):
        with pytest.raises(MergeDBError, match="writes into a folder path"):
            executor.execute(xp, out)
    assert not (tmp_path / "o").exists()


def test_method_parameters_are_numbers_not_bools_or_text(cat):
    """float() took True as 1.0 and "0.3" as 0.3, while normalize refused "false": a number is asked
    for, and anything else refused before a plan is stored."""
    before = _plans(cat)
    for value in (True, "0.3", b"0.3"):
        with pytest.raises(PlanError, match=r"density must be a number, got"):
            cat.plan(mergedb.PlanRequest("base", None, "ties", params={"density": value}))
    assert _plans(cat) == before
    numpy_number = mergedb.PlanRequest("base", None, "ties", params={"density": np.float32(0.5)})
    assert cat.plan(numpy_number).params["density"] == 0.5


def test_weights_of_any_number_type_make_one_plan(cat):
    """numpy float32 weights raised a TypeError from json while hashing the plan, and (1, 2) hashed
    apart from (1.0, 2.0); a bool weight was taken as 1."""
    n = len(cat.checkpoints()) - 1
    hashes = {
        cat.plan(mergedb.PlanRequest("base", None, "task_arithmetic", weights=w)).plan_hash
        for w in ((1,) * n, (1.0,) * n, tuple(np.float32(1) for _ in range(n)), np.ones(n, np.int64))
    }
    assert len(hashes) == 1
    import warnings

    with warnings.catch_warnings():  # float16 weights compared with the limits warned of overflow on stderr
        warnings.simplefilter("error")
        half = cat.plan(mergedb.PlanRequest("base", None, "task_arithmetic", weights=(np.float16(1),) * n))
    assert {half.plan_hash} == hashes
    with pytest.raises(PlanError, match="weight 1 of .* is True"):
        cat.plan(mergedb.PlanRequest("base", None, "task_arithmetic", weights=(True,) + (1.0,) * (n - 1)))


def test_record_run_and_frontier_refuse_what_they_cannot_use(cat, tmp_path):
    """record_run() stored a run for a plan that does not exist (`mergedb check` then called the catalog
    damaged) and took out=None or error=5 to a bare TypeError; frontier() made no plans from a
    generator of budgets (a check used it up) and stored them for keep="no" (review, 2026-12-02)."""
    from mergedb.check import check_catalog

    runs = cat.sql("SELECT count(*) AS n FROM runs").column("n")[0].as_py()
    for args, words in (
        ((-1, tmp_path / "o"), "no plan -1 in catalog"),
        ((999, tmp_path / "o"), "no plan 999 in catalog"),
        (("1", tmp_path / "o"), "takes a stored plan's id"),
        ((True, tmp_path / "o"), "takes a stored plan's id"),
        ((1, None), "out is the output folder"),
        ((1, tmp_path / "o", 5), "result is an ExecuteResult or None"),
        ((1, tmp_path / "o", None, 5), "error is a message"),
    ):
        with pytest.raises(MergeDBError, match=words):
            cat.record_run(*args)
    assert cat.sql("SELECT count(*) AS n FROM runs").column("n")[0].as_py() == runs
    assert check_catalog(cat) == []
    assert cat.record_run(np.int64(1), tmp_path / "o", error="failed") > 0  # a numpy id is an id
    req = PlanRequest("base", None, "task_arithmetic")
    plans = _plans(cat)
    with pytest.raises(PlanError, match="budgets are a list or tuple"):
        cat.frontier(req, (b for b in ["10%", "50%"]))
    with pytest.raises(PlanError, match="keep is True or False"):
        cat.frontier(req, ["10%"], keep="no")
    assert _plans(cat) == plans
    assert len(cat.frontier(req, ("10%", "50%"))) == 2


def test_text_that_is_not_utf8_and_paths_with_nul_are_refused_by_name(cat, tmp_path):
    """A command-line argument in another encoding reaches Python as lone surrogates, which DuckDB
    refused deep in a statement (InvalidInputException, a TypeError for SQL); a NUL byte in a path made
    os calls raise a bare ValueError (review, 2026-12-02). MergeDBErrors naming the value now."""
    bad = "p\udcff"
    for call, words in (
        (lambda: cat.sql(f"SELECT '{bad}'"), "is not valid UTF-8"),
        (lambda: cat.get_plan(bad), "is not valid UTF-8"),
        (lambda: cat.plan(PlanRequest("base", None, "linear", name=bad)), "is not valid UTF-8"),
        (lambda: cat.record_score(1, bad, 1.0), "is not valid UTF-8"),
        (lambda: Catalog(tmp_path / "c\x00.duckdb"), "holds a NUL byte"),
        (lambda: cat.register([tmp_path / "f\x00"], base_model="base"), "holds a NUL byte"),
        (lambda: cat.execute(1, tmp_path / "o\x00"), "holds a NUL byte"),
    ):
        with pytest.raises(MergeDBError, match=words):
            call()


def test_numpy_whole_numbers_are_whole_numbers(cat, tmp_path):
    """seed, threads and max_shard_size given as numpy integers were refused as "not a whole number"
    (review, 2026-12-02); they are taken as the ints they are, and plan the same as Python ints."""
    a = cat.plan(PlanRequest("base", None, "dare_ties", "50%", seed=np.int64(5)))
    b = cat.plan(PlanRequest("base", None, "dare_ties", "50%", seed=5))
    assert a.plan_hash == b.plan_hash and isinstance(PlanRequest("base", None, "linear", seed=np.uint8(5)).seed, int)
    res = cat.execute(a.plan_id, tmp_path / "o", threads=np.int64(1), max_shard_size=np.int64(10**9))
    assert res.manifest["tensor_hashes"]


def test_numpy_min_coverage_is_a_number(cat):
    """min_coverage given as np.float32 was refused as "must be a number" (a float64 passed, being a
    float subclass); it plans the same as the Python float it equals."""
    c = float(np.float32(0.25))
    a = cat.plan(PlanRequest("base", None, "linear", "50%", min_coverage=np.float32(0.25)))
    b = cat.plan(PlanRequest("base", None, "linear", "50%", min_coverage=c))
    assert a.plan_hash == b.plan_hash
    assert type(PlanRequest("base", None, "linear", min_coverage=np.float16(1)).min_coverage) is float


def test_a_catalog_named_by_a_relative_path_stays_where_it_was_when_the_folder_changes(tmp_path, monkeypatch):
    """Catalog('catalog.duckdb') resolved its path again at every call: after os.chdir it reported
    "no catalog", and a register created a second catalog in the new folder (embed review)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=8)
    monkeypatch.chdir(tmp_path / "a")
    cat = Catalog("catalog.duckdb")
    cat.register([fam], base_model="base")
    monkeypatch.chdir(tmp_path / "b")
    assert [c.name for c in cat.checkpoints()] == ["base", "expert_00"]
    cat.plan(PlanRequest("base", None, "linear"))
    assert not (tmp_path / "b" / "catalog.duckdb").exists() and len(cat.plans()) == 1
    assert repr(cat) == f"Catalog({str(tmp_path / 'a' / 'catalog.duckdb')!r})"


def test_arguments_of_the_wrong_type_get_a_mergedb_error_not_a_type_error(cat, tmp_path):
    """Each of these escaped as a bare TypeError from deep inside (embed review)."""
    xp = cat.execution_plan(1)
    for call, words in (
        (lambda: cat.register([tmp_path], base_model=["base"]), "base_model is a registered base's name"),
        (lambda: cat.execute(1, tmp_path / "o", dtype=["bf16"]), "an output dtype is bf16, fp16, fp32 or None"),
        (lambda: executor.merge_to_dict(xp, dtype=["bf16"]), "an output dtype is bf16"),
        (lambda: executor.merge_to_dict(xp, on_tensor=5), "on_tensor is a function or None"),
        (lambda: cat.plan_from_config("merge_method: linear\nmodels: [{model: base}]", cwd=5), "cwd is a folder"),
        (lambda: check.check_output(None), "check_output\\(\\) takes an output folder"),
        (lambda: executor.replay(None, tmp_path / "o"), "replay\\(\\) reads an output's manifest"),
    ):
        with pytest.raises(MergeDBError, match=words):
            call()
    assert not (tmp_path / "o").exists()
