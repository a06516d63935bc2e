"""`mergedb sweep --configs a.yml b.yml`: each mergekit config a stored plan named after its file,
executed together; each output equals the config planned (`mergedb plan --config`) and executed
(`mergedb execute --dtype <the config's>`) alone, file for file.

The reference is the other path through the CLI, with no sweep involved; bad configs are checked
to name their file and to leave the catalog's plans as they were."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mergedb import synth
from mergedb.catalog import Catalog
from mergedb.cli import app
from mergedb.manifest import MANIFEST
from tests.reference import output_digest

runner = CliRunner(env={"COLUMNS": "200"})

TIES = """
merge_method: ties
base_model: base
models:
  - model: expert_00
    parameters: {{weight: 1.0, density: {d}}}
  - model: expert_01
    parameters: {{weight: 0.5, density: {d}}}
  - model: expert_02
    parameters: {{weight: [0.2, 0.9], density: {d}}}
parameters:
  lambda: {lam}
{extra}
"""

TA = """
merge_method: task_arithmetic
base_model: base
models:
  - model: expert_00
    parameters: {weight: 0.7}
  - model: expert_02
    parameters: {weight: [0.1, 0.6]}
parameters:
  lambda: 0.8
out_dtype: float32
"""


@pytest.fixture()
def fam(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    synth.make_family(tmp_path / "fam", experts=3, size="tiny", seed=8)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([tmp_path / "fam"], base_model="base", block_size="64KiB")
    files = {
        "ties-a.yml": TIES.format(d=0.3, lam=1.0, extra=""),
        "ties-b.yml": TIES.format(d=0.3, lam=0.6, extra="  normalize: false"),  # a's fold, its own finish
        "ties-c.yml": TIES.format(d=0.6, lam=1.0, extra="out_dtype: float16"),
        "ta.yml": TA,
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return tmp_path, cat, list(files)


def _plans(cat: Catalog) -> list[dict]:
    return cat.sql("SELECT plan_id, name FROM plans ORDER BY plan_id").to_pylist()


def test_configs_sweep_equals_each_config_planned_and_executed_alone(fam):
    root, cat, names = fam
    db = str(root / "c.duckdb")
    r = runner.invoke(app, ["sweep", "--configs", *names, "--budget", "70%", "--out", "sw", "-c", db])
    assert r.exit_code == 0, r.output
    assert "ties-a" in r.output and "3 fold group(s)" in r.output  # a and b fold once; c, ta alone
    stems = [Path(n).stem for n in names]
    assert [p["name"] for p in _plans(cat)] == stems
    for stem, fname in zip(stems, names):
        alone = f"alone-{stem}"
        r = runner.invoke(app, ["plan", "--config", fname, "--budget", "70%", "--name", alone, "-c", db])
        assert r.exit_code == 0, r.output
        dtype = {"ties-c": ["--dtype", "fp16"], "ta": ["--dtype", "fp32"]}.get(stem, [])
        r = runner.invoke(app, ["execute", alone, "--out", f"out-{stem}", "-c", db, "-q", *dtype])
        assert r.exit_code == 0, r.output
        assert output_digest(root / "sw" / stem) == output_digest(root / f"out-{stem}"), stem
    # the config's output dtype is the plan's: float16 and float32 where asked, the base's elsewhere
    dts = {s: json.loads((root / "sw" / s / MANIFEST).read_text())["dtype"] for s in stems}
    assert dts == {"ties-a": None, "ties-b": None, "ties-c": "F16", "ta": "F32"}


def test_configs_sweep_with_a_prefix_names_plans_prefix_stem(fam):
    root, cat, names = fam
    args = ["sweep", "--configs", names[0], names[3], "--name", "run1"]
    r = runner.invoke(app, [*args, "--out", "sw", "-c", "c.duckdb"])
    assert r.exit_code == 0, r.output
    assert [p["name"] for p in _plans(cat)] == ["run1-ties-a", "run1-ta"]
    assert (root / "sw" / "run1-ta" / MANIFEST).exists()


@pytest.mark.parametrize(
    "bad, said",
    [
        ("merge_method: ties\nbase_model: base\nmodels:\n  - model: nobody\n", "nobody"),
        ("merge_method: [ties\n", "not valid YAML"),
        ("merge_method: ties\nbase_model: base\nmodels:\n  - model: expert_00\nwhatever: 1\n", "whatever"),
    ],
)
def test_a_bad_config_names_its_file_and_plans_nothing(fam, bad, said):
    root, cat, names = fam
    (root / "broken.yml").write_text(bad)
    r = runner.invoke(app, ["sweep", "--configs", names[0], "broken.yml", "--out", "sw", "-c", "c.duckdb"])
    assert r.exit_code != 0
    assert "broken.yml" in r.output and said in r.output, r.output
    assert _plans(cat) == [] and not (root / "sw").exists()


def test_configs_refuse_what_a_config_sets_and_files_without_configs(fam):
    root, cat, names = fam
    r = runner.invoke(app, ["sweep", "--configs", names[0], "-m", "ties", "--out", "sw", "-c", "c.duckdb"])
    assert r.exit_code != 0 and "--method cannot be combined with --configs" in r.output
    r = runner.invoke(app, ["sweep", "--configs", names[0], "--grid", "lambda=1,2", "--out", "sw", "-c", "c.duckdb"])
    assert r.exit_code != 0 and "--grid cannot be combined with --configs" in r.output
    args = ["sweep", names[0], "--base", "base", "--all", "-m", "ties"]
    r = runner.invoke(app, [*args, "--out", "sw", "-c", "c.duckdb"])
    assert r.exit_code != 0 and "need --configs" in r.output
    r = runner.invoke(app, ["sweep", "--configs", "--out", "sw", "-c", "c.duckdb"])
    assert r.exit_code != 0 and "at least one config" in r.output
    (root / "sub").mkdir()
    (root / "sub" / names[0]).write_text((root / names[0]).read_text())
    r = runner.invoke(app, ["sweep", "--configs", names[0], f"sub/{names[0]}", "--out", "sw", "-c", "c.duckdb"])
    assert r.exit_code != 0 and "rename one of the files" in r.output
    assert _plans(cat) == []
