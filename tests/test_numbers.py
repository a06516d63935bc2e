"""Numbers at their limits: the error bound of the output as written (rounded to its dtype),
out-of-range sizes, scales, seeds and thread counts refused up front, and NaN/Inf in the base
blamed on the base."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from mergedb import synth
from mergedb.catalog import Catalog
from mergedb.cli import app
from mergedb.errors import MergeDBError, PlanError
from mergedb.planner import PlanRequest, parse_budget
from mergedb.units import MAX_BYTES, parse_size
from tests.reference import load_model

# ---------------------------------------------------------------------------------------------
# Item 9: the bound holds for what is written (bf16), not only for the float32 merge.


@pytest.fixture(scope="module")
def bf16_family(tmp_path_factory):
    """A registered tiny bf16 family (3 experts, small blocks) and its full-read outputs per method."""
    root = tmp_path_factory.mktemp("bf16bound")
    fam = synth.make_family(root / "fam", experts=3, size="tiny", dtype="bf16", seed=7)
    cat = Catalog(root / "c.duckdb")
    cat.register([fam], base_model="base", block_size="16KiB")
    return cat, root


CASES = {
    "linear": ((1.0, 2.0, 3.0), {}),
    "task_arithmetic": (None, {}),
}


def _distance(a: Path, b: Path) -> float:
    """‖θ_a − θ_b‖₂ over every float tensor of two written outputs, in float64."""
    ma, mb = load_model(a), load_model(b)
    return float(
        np.sqrt(
            sum(
                ((ma[n].astype(np.float64) - mb[n].astype(np.float64)) ** 2).sum()
                for n in ma
                if np.issubdtype(ma[n].dtype, np.floating)
            )
        )
    )


def _full_output(cat: Catalog, root: Path, method: str) -> Path:
    out = root / f"full-{method}"
    if not out.exists():
        weights, params = CASES[method]
        full = cat.plan(PlanRequest("base", None, method, "all", weights, params))
        assert full.bound_blockwise == 0 and full.bound_rounded == 0  # nothing omitted: identical outputs
        cat.execute(full.plan_id, out)
    return out


def test_rounded_bound_holds_on_bf16_outputs_where_the_float32_bound_does_not(bf16_family):
    cat, root = bf16_family
    broken = []  # cases where the old, unrounded bound is below the measured error
    for method, (weights, params) in CASES.items():
        full = _full_output(cat, root, method)
        for budget in ("90%", "50%", "10%"):
            p = cat.plan(PlanRequest("base", None, method, budget, weights, params))
            out = root / f"{method}-{budget[:-1]}"
            cat.execute(p.plan_id, out)
            measured = _distance(out, full)
            assert p.bound_rounded is not None and p.bound_note is None
            assert measured <= p.bound_rounded, (method, budget, measured, p.bound_rounded)
            assert p.bound_blockwise <= p.bound_rounded  # rounding only adds
            if measured > p.bound_blockwise:
                broken.append((method, budget, measured, p.bound_blockwise))
    assert broken, "the rounding term should matter on bf16 outputs in at least one case"


def test_rounded_bound_also_bounds_fp32_output(bf16_family):
    """`--dtype fp32` output rounds less than bf16: the stored bound holds for it too."""
    cat, root = bf16_family
    weights, params = CASES["linear"]
    full = root / "full-linear-fp32"
    if not full.exists():
        cat.execute(cat.plan(PlanRequest("base", None, "linear", "all", weights, params)).plan_id, full, dtype="fp32")
    p = cat.plan(PlanRequest("base", None, "linear", "50%", weights, params))
    out = root / "linear-50-fp32"
    cat.execute(p.plan_id, out, dtype="fp32")
    assert _distance(out, full) <= p.bound_rounded


def test_rounded_bound_holds_on_fp16_outputs(tmp_path):
    """fp16 rounds finer than bf16 (u = 2^-11) but has subnormals below 2^-14: the bound still holds."""
    fam = synth.make_family(tmp_path / "fam", experts=3, size="tiny", dtype="fp16", seed=7)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base", block_size="100000B")
    cat.execute(cat.plan(PlanRequest("base", None, "linear", "all")).plan_id, tmp_path / "full")
    for budget in ("50%", "10%"):
        p = cat.plan(PlanRequest("base", None, "linear", budget))
        cat.execute(p.plan_id, tmp_path / budget[:-1])
        assert _distance(tmp_path / budget[:-1], tmp_path / "full") <= p.bound_rounded


def test_rounded_bound_shown_by_the_cli(bf16_family):
    cat, _ = bf16_family
    res = CliRunner().invoke(
        app, ["plan", "--base", "base", "--all", "-m", "linear", "--budget", "50%", "--catalog", str(cat.path)]
    )
    text = " ".join(res.output.split())  # rich wraps long lines
    assert res.exit_code == 0, res.output
    assert "error bound ‖θ_B − θ_F‖ of the written output (in the base's dtype) ≤" in text
    assert "float32 merge before rounding ≤" in text


def test_old_catalog_without_base_norms_reports_float32_bound_only(tmp_path):
    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=4)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base", block_size="32KiB")
    with cat.duckdb_connection(write=True) as con:  # as a catalog registered before schema 005 left it
        con.execute("UPDATE blocks SET base_norm = NULL, base_nonfinite = NULL")
    p = cat.plan(PlanRequest("base", None, "task_arithmetic", "50%"))
    assert p.bound_rounded is None and p.bound_blockwise > 0
    assert "base norms are unknown" in p.bound_note and "float32 merge" in p.bound_note
    shown = CliRunner().invoke(app, ["show-plan", str(p.plan_id), "--catalog", str(cat.path)])
    text = " ".join(shown.output.split())  # rich wraps long lines
    assert shown.exit_code == 0 and "written output (in the base's dtype) not computed (" in text
    assert "base norms are unknown" in text


def test_base_norms_recorded_exactly(tmp_path):
    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", dtype="bf16", seed=6)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base", block_size="32KiB")
    base = load_model(fam / "base")
    rows = cat.sql(
        "SELECT ft.name, ft.mergeable, bl.row_start, bl.row_end, bl.base_norm, bl.base_nonfinite FROM blocks bl "
        "JOIN family_tensors ft USING (base_id, tensor_idx)"
    ).to_pylist()
    assert rows
    for r in rows:
        if not r["mergeable"]:
            assert r["base_norm"] is None and r["base_nonfinite"] is None
            continue
        t = base[r["name"]].astype(np.float64)
        t = t.reshape(t.shape[0] if t.ndim > 1 else 1, -1)[r["row_start"] : r["row_end"]]
        assert r["base_norm"] == pytest.approx(float(np.sqrt((t**2).sum())), rel=1e-12)
        assert r["base_nonfinite"] == 0


# ---------------------------------------------------------------------------------------------
# Item 20: NaN/Inf in the base is the base's fault.


def _poisoned_base_family(tmp_path: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=8)
    f = fam / "base" / "model.safetensors"
    t = load_file(str(f))
    w = t["lm_head.weight"].clone()
    w[1, 2] = float("nan")
    w[3, 4] = float("inf")
    t["lm_head.weight"] = w.to(torch.bfloat16)
    save_file(t, str(f))
    return fam


def test_nonfinite_base_blamed_on_the_base(tmp_path):
    fam = _poisoned_base_family(tmp_path)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    rows = cat.sql("SELECT CAST(sum(base_nonfinite) AS BIGINT) AS n FROM blocks").to_pylist()
    assert rows == [{"n": 2}]
    for allow in (False, True):  # leaving blocks out would still copy the base's NaN/Inf
        with pytest.raises(PlanError, match=r"^base 'base' has 2 NaN/Inf values in tensor 'lm_head.weight'; fix the"):
            cat.plan(PlanRequest("base", None, "linear", allow_nonfinite=allow))
    assert cat.plans() == []
    res = CliRunner().invoke(app, ["plan", "--base", "base", "--all", "-m", "linear", "--catalog", str(cat.path)])
    text = " ".join(res.output.split())
    assert res.exit_code == 1 and "base 'base' has 2 NaN/Inf" in text and "expert_00" not in text


def test_nonfinite_base_in_old_catalog_points_at_the_base(tmp_path):
    fam = _poisoned_base_family(tmp_path)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([fam], base_model="base")
    with cat.duckdb_connection(write=True) as con:  # registered before schema 005: no base counts
        con.execute("UPDATE blocks SET base_norm = NULL, base_nonfinite = NULL")
    with pytest.raises(PlanError, match="every expert has NaN/Inf values in the same block.*most likely base 'base'"):
        cat.plan(PlanRequest("base", None, "linear"))


# ---------------------------------------------------------------------------------------------
# Item 15: out-of-range numbers refused up front, one line, exit 1.


@pytest.fixture(scope="module")
def small_catalog(tmp_path_factory):
    root = tmp_path_factory.mktemp("limits")
    fam = synth.make_family(root / "fam", experts=2, size="tiny", seed=12)
    cat = Catalog(root / "c.duckdb")
    cat.register([fam], base_model="base", block_size="64KiB")
    return cat, fam, root


def _cli_refuses(args: list[str], match: str) -> None:
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 1, (args, res.output)
    assert isinstance(res.exception, SystemExit), res.exception  # no traceback
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error:"), res.output
    assert match in " ".join(res.output.split()), res.output


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--budget", "9223372036854775807B"], "4 EiB) limit"),
        (["--budget", "10000000TB"], "4 EiB) limit"),
        (["--budget", "9" * 5000 + "B"], "(5001 characters) is over"),
        (["--budget", "1.5B"], "not a whole number of bytes"),
        (["--budget", "1Mb"], "is in bits (lowercase b); write bytes with a capital B, e.g. 1MB"),
        (["--lambda", "1e308"], "lambda must be between -1e+06 and 1e+06"),
        (["--lambda", "inf"], "lambda must be finite"),
        (["--weights", "1e308,1"], "weight 1 of 2 is 1e+308"),
        (["--weights", "1,-0.9999999"], "the weights nearly cancel under --normalize"),
        (["--seed", "99999999999999999999"], "seed must be a whole number from 0 to 2^63 - 1"),
        (["--seed", "-1"], "seed must be a whole number from 0 to 2^63 - 1"),
    ],
)
def test_out_of_range_plan_options_refused(small_catalog, extra, match):
    cat, _, _ = small_catalog
    method = "task_arithmetic" if "--lambda" in extra else "linear"
    _cli_refuses(["plan", "--base", "base", "--all", "-m", method, "--catalog", str(cat.path), *extra], match)
    assert cat.plans() == []


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--threads", "0"], "threads must be a whole number from 1 to 1024, got 0"),
        (["--threads", "100000"], "from 1 to 1024"),
        (["--block-size", "99999999999999999999TB"], "4 EiB) limit"),
        (["--block-size", "2TiB"], "must be between 1B and 1TiB"),
        (["--block-size", "0"], "must be between 1B and 1TiB"),
        (["--block-size", "0.5B"], "not a whole number of bytes"),
    ],
)
def test_out_of_range_register_options_refused(small_catalog, tmp_path, extra, match):
    _, fam, _ = small_catalog
    cat = tmp_path / "c.duckdb"
    _cli_refuses(["register", str(fam), "--base-model", "base", "-q", "--catalog", str(cat), *extra], match)
    assert not cat.exists() or Catalog(cat).checkpoints() == []


def test_library_refuses_the_same(small_catalog, tmp_path):
    cat, fam, _ = small_catalog
    with pytest.raises(PlanError, match="seed must be"):
        cat.plan(PlanRequest("base", None, "linear", seed=2**63))
    with pytest.raises(PlanError, match="weight 2 of 2"):
        cat.plan(PlanRequest("base", None, "linear", weights=(1.0, float("inf"))))
    with pytest.raises(MergeDBError, match="threads must be"):
        Catalog(tmp_path / "t.duckdb").register([fam], base_model="base", threads=0)
    with pytest.raises(MergeDBError, match="4 EiB"):
        Catalog(tmp_path / "b.duckdb").register([fam], base_model="base", block_size="99999999999999999999TB")
    assert cat.plans() == []


@pytest.mark.parametrize(
    "text,expected",
    [("1.5GiB", 3 * 2**29), ("0.1KiB", 102), ("2kb", 2000), ("4mb", 4 * 10**6), ("4MiB", 4 * 2**20), ("7", 7)],
)
def test_sizes_exact_and_fractions_of_a_byte_rounded_down(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["1.5B", "1.5", "1Mb", "1Gib", "1Kb", str(MAX_BYTES + 1), "5000000TiB"])
def test_sizes_refused(text):
    with pytest.raises(MergeDBError):
        parse_size(text)


def test_budget_at_the_limit_means_everything():
    assert parse_budget(f"{MAX_BYTES}B", 1000) == MAX_BYTES  # above the full read: read everything
    with pytest.raises(PlanError, match="limit"):
        parse_budget(f"{MAX_BYTES + 1}B", 1000)


def test_huge_budget_plans_everything(small_catalog):
    cat, _, _ = small_catalog
    p = cat.plan(PlanRequest("base", None, "linear", f"{MAX_BYTES}B"))
    everything = cat.plan(PlanRequest("base", None, "linear", "all"))
    assert p.budget_bytes == MAX_BYTES and p.selected_bytes == everything.selected_bytes > 0
