"""LoRA adapters registered and merged as experts, against peft's merge_and_unload() full models.

Two catalogs over one tiny Llama base: in `lora`, the adapters themselves; in `dense`, peft's
merge_and_unload() of each adapter saved as a full-weight model under the same name (so DARE's
and DELLA's draws, keyed by expert name, are the same). Every merge of the adapters must equal the
merge of those full models; linear and task arithmetic are also checked against the textbook
formula in numpy. Costs are checked against the factors' sizes computed here from the files.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from mergedb import executor
from mergedb.catalog import Catalog
from mergedb.cli import app
from mergedb.errors import PlanError
from mergedb.planner import PlanRequest
from mergedb.sweep import sweep as sweep_to_folders
from tests import lora_fixtures as lf

BLOCK = 4096  # bytes: the 64-column fp32 projections split into blocks of 16 rows
ADAPTERS = {  # name -> LoraConfig keywords
    "ad1": {"r": 4, "lora_alpha": 8},
    "ad2": {
        "r": 8,
        "lora_alpha": 4,
        "use_rslora": True,
        "target_modules": ["q_proj", "v_proj", "down_proj", "embed_tokens"],
        "modules_to_save": ["lm_head"],
    },
    "ad3": {"r": 2, "lora_alpha": 2, "target_modules": ["q_proj", "v_proj"]},  # touches 4 of 21 tensors
}


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-merge")
    base = lf.make_base(root / "base")
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        lf.make_adapter(base, root / "adapters" / name, seed=10 + i, **kw)
        lf.save_dense(lf.merged_state(base, root / "adapters" / name), base, root / "dense" / name)
    gen = torch.Generator().manual_seed(99)  # a plain dense fine-tune to mix with the adapters
    other = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in lf.base_state(base).items()}
    lf.save_dense(other, base, root / "other" / "other")
    lora, dense = Catalog(root / "lora.duckdb"), Catalog(root / "dense.duckdb")
    for cat in (lora, dense):
        cat.register([base], base=True, block_size=BLOCK)
        cat.register([root / "other"], base_model="base")
    lora.register([root / "adapters"], base_model="base")  # a folder of adapters
    dense.register([root / "dense"], base_model="base")
    return root, lora, dense


def _merge(cat: Catalog, req: PlanRequest, **kw) -> tuple[dict[str, np.ndarray], object]:
    plan = cat.plan(req)
    return executor.merge_to_dict(cat.execution_plan(plan.plan_id), **kw), plan


def _rel(a: dict, b: dict, base: dict) -> float:
    """max over tensors of ‖a − b‖ / ‖b − θ₀‖ (the deviation per unit of update)."""
    worst = 0.0
    for k, ref in b.items():
        ref = np.asarray(ref, np.float64)
        upd = np.linalg.norm(ref - base[k])
        if upd:
            worst = max(worst, float(np.linalg.norm(np.asarray(a[k], np.float64) - ref) / upd))
    return worst


@pytest.fixture(scope="module")
def base_sd(fam):
    return {k: v.double().numpy() for k, v in lf.base_state(fam[0] / "base").items()}


def test_registration_records_factor_costs_and_exact_statistics(fam, base_sd):
    root, lora, dense = fam
    rows = lora.sql(
        "SELECT c.name, ft.name AS tensor, eb.block_idx, bl.row_start, bl.row_end, eb.identical, eb.delta_norm, "
        "eb.max_abs, eb.nnz, eb.base_dot, eb.read_bytes, et.fixed_bytes FROM expert_blocks eb "
        "JOIN checkpoints c USING (checkpoint_id) JOIN family_tensors ft ON ft.base_id = c.base_id "
        "AND ft.tensor_idx = eb.tensor_idx JOIN blocks bl ON bl.base_id = c.base_id AND bl.tensor_idx = eb.tensor_idx "
        "AND bl.block_idx = eb.block_idx JOIN expert_tensors et ON et.checkpoint_id = eb.checkpoint_id "
        "AND et.tensor_idx = eb.tensor_idx WHERE c.adapter ORDER BY 1, 2, 3"
    ).to_pylist()
    assert {r["name"] for r in rows} == set(ADAPTERS)
    for name in ADAPTERS:
        ref = {k: v.double().numpy() for k, v in load_file(str(root / "dense" / name / "model.safetensors")).items()}
        factors = load_file(str(root / "adapters" / name / "adapter_model.safetensors"))
        for r in (r for r in rows if r["name"] == name):
            t, r0, r1 = r["tensor"], r["row_start"], r["row_end"]
            d = ref[t][r0:r1] - base_sd[t][r0:r1]  # merge_and_unload − base, these rows
            module = "base_model.model." + t.removesuffix(".weight")
            a, b = factors.get(module + ".lora_A.weight"), factors.get(module + ".lora_B.weight")
            if a is None:
                a, b = factors.get(module + ".lora_embedding_A"), factors.get(module + ".lora_embedding_B")
            if not d.any():  # untouched: free, costs nothing
                assert r["identical"] and r["read_bytes"] == 0 and r["fixed_bytes"] == 0, (name, t)
                continue
            assert not r["identical"]
            np.testing.assert_allclose(r["delta_norm"], np.linalg.norm(d), rtol=1e-6)
            np.testing.assert_allclose(r["max_abs"], np.abs(d).max(), rtol=1e-6)
            np.testing.assert_allclose(r["base_dot"], (base_sd[t][r0:r1] * d).sum(), rtol=1e-5, atol=1e-9)
            assert r["nnz"] == np.count_nonzero(d)
            if a is None:  # modules_to_save: the replacement rows
                assert t == "lm_head.weight" and r["read_bytes"] == (r1 - r0) * lf.HIDDEN * 4 and r["fixed_bytes"] == 0
            elif "embed" in t:  # transposed: columns r0..r1 of A (rank × rows), B whole
                assert r["read_bytes"] == a.shape[0] * (r1 - r0) * 4 and r["fixed_bytes"] == b.numel() * 4
            else:  # rows r0..r1 of B, A whole
                assert r["read_bytes"] == (r1 - r0) * b.shape[1] * 4 and r["fixed_bytes"] == a.numel() * 4
    # the same statistics as the full merge_and_unload model registered as a dense expert
    per_expert = "SELECT c.name, sum(delta_norm) AS s FROM expert_blocks JOIN checkpoints c USING (checkpoint_id) "
    adapter_norms = lora.sql(per_expert + "WHERE c.adapter GROUP BY 1 ORDER BY 1").to_pylist()
    dense_norms = dense.sql(per_expert + "WHERE c.name LIKE 'ad%' GROUP BY 1 ORDER BY 1").to_pylist()
    for x, y in zip(adapter_norms, dense_norms):
        assert x["name"] == y["name"] and x["s"] == pytest.approx(y["s"], rel=1e-6)


@pytest.mark.parametrize(
    "method, params",
    [
        ("linear", {}),
        ("task_arithmetic", {"lambda": 0.8}),
        ("ties", {"density": 0.4}),
        ("dare_ties", {"density": 0.5}),
        ("della", {"density": 0.6, "epsilon": 0.1}),
        ("model_stock", {}),
    ],
)
@pytest.mark.parametrize("experts", [("ad1", "ad2", "ad3"), ("ad1", "other", "ad2")])
def test_merge_of_adapters_equals_merge_of_merged_models(fam, base_sd, method, params, experts):
    _, lora, dense = fam
    weights = None if method == "model_stock" else (1.0, 0.5, 0.75)  # model_stock takes none
    req = PlanRequest("base", experts, method, "all", weights=weights, params=params, seed=3)
    got, plan = _merge(lora, req)
    ref, _ = _merge(dense, req)
    # DELLA's keep probability steps with |Δ|'s magnitude bin (2^-6 wide): an element within an ulp of
    # a bin edge (peft's float32 B @ A against mergedb's float64-summed one) may change bins and p_i
    # model_stock's t = k·cos/(1 + (k−1)·cos) turns a relative error ε of cos into ε/cos in t, and
    # random adapters are nearly orthogonal (cos ~ 1e-2): float32 rounding of Δ shows up 100-fold
    tol = 1e-4 if method in ("della", "model_stock") else 1e-6
    assert _rel(got, ref, base_sd) <= tol, method
    assert plan.selected_bytes <= plan.budget_bytes


@pytest.mark.parametrize("budget", ["all", "40%"])
def test_a_zero_weight_adapter_is_not_read(fam, base_sd, budget):
    """Weight 0 on an adapter: none of its blocks or factors are candidates (no budget spent on
    them, fixed-cost carriers and their dependents dropped together), and the merge is the one of
    the dense models with the same weights."""
    _, lora, dense = fam
    req = PlanRequest("base", ("ad1", "ad2", "ad3"), "task_arithmetic", budget, weights=(1.0, 0.0, 0.75))
    got, plan = _merge(lora, req)
    _, two = _merge(lora, PlanRequest("base", ("ad1", "ad3"), "task_arithmetic", budget, weights=(1.0, 0.75)))
    stored = lora.sql("SELECT position, selected_bytes FROM plan_experts WHERE plan_id = ?", [plan.plan_id])
    assert dict(zip(*stored.to_pydict().values()))[1] == 0 and plan.selected_bytes <= plan.budget_bytes
    if budget == "all":
        assert plan.selected_bytes == plan.full_bytes == two.selected_bytes
        ref, _ = _merge(dense, req)
        assert _rel(got, ref, base_sd) <= 1e-6


@pytest.mark.parametrize("method", ["linear", "task_arithmetic"])
def test_additive_merge_of_adapters_is_the_textbook_formula(fam, base_sd, method):
    root, lora, _ = fam
    w = (1.0, -0.5, 0.75)
    got, _ = _merge(lora, PlanRequest("base", ("ad1", "ad2", "ad3"), method, "all", weights=w))
    full = [
        {k: v.double().numpy() for k, v in lf.merged_state(root / "base", root / "adapters" / n).items()}
        for n in ADAPTERS
    ]
    scale = 1 / sum(w) if method == "linear" else 1.0
    ref = {k: b + scale * sum(wk * (m[k] - b) for wk, m in zip(w, full)) for k, b in base_sd.items()}
    assert _rel(got, ref, base_sd) <= 1e-6


def test_slerp_between_the_base_and_an_adapter(fam, base_sd):
    _, lora, dense = fam
    req = PlanRequest("base", ("ad2",), "slerp", "all", params={"t": 0.3})
    got, _ = _merge(lora, req)
    ref, _ = _merge(dense, req)
    assert _rel(got, ref, base_sd) <= 1e-6


def _selected_cost(cat: Catalog, plan_id: int) -> int:
    """Bytes the plan must read, from the catalog's rows: every selected block's read_bytes (its
    dense bytes for a dense expert) plus each adapter tensor's fixed bytes once if any of its
    blocks is selected."""
    rows = cat.sql(
        "SELECT pm.checkpoint_id, pm.tensor_idx, coalesce(eb.read_bytes, bl.nbytes) AS rb, et.fixed_bytes "
        "FROM plan_mask pm JOIN expert_blocks eb USING (checkpoint_id, tensor_idx, block_idx) "
        "JOIN checkpoints c ON c.checkpoint_id = pm.checkpoint_id "
        "JOIN blocks bl ON bl.base_id = c.base_id AND bl.tensor_idx = pm.tensor_idx AND bl.block_idx = pm.block_idx "
        f"JOIN expert_tensors et USING (checkpoint_id, tensor_idx) WHERE pm.plan_id = {int(plan_id)} AND pm.selected"
    ).to_pylist()
    fixed = {(r["checkpoint_id"], r["tensor_idx"]): r["fixed_bytes"] or 0 for r in rows}
    return sum(r["rb"] for r in rows) + sum(fixed.values())


def _evict(paths: list[Path]) -> None:
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


@pytest.mark.parametrize("budget", ["25%", "10%", "all"])
@pytest.mark.parametrize("method", ["task_arithmetic", "ties"])
def test_budget_is_a_hard_bound_with_adapter_costs(fam, tmp_path, budget, method):
    root, lora, _ = fam
    params = {"density": 0.5} if method == "ties" else {}
    plan = lora.plan(PlanRequest("base", ("ad1", "ad2", "other", "ad3"), method, budget, params=params))
    assert plan.selected_bytes <= plan.budget_bytes
    assert plan.selected_bytes == _selected_cost(lora, plan.plan_id)  # A counted once per (expert, tensor)
    physical = []
    for attempt in range(3):  # the page cache is shared: a base page evicted meanwhile counts as read
        for f in (root / "base").glob("*.safetensors"):
            f.read_bytes()  # base warm: physical reads are then the experts' alone
        _evict([*(root / "adapters").rglob("*.safetensors"), *(root / "other").rglob("*.safetensors")])
        res = executor.execute(lora.execution_plan(plan.plan_id), tmp_path / f"out{attempt}")
        assert res.expert_bytes == plan.selected_bytes
        physical.append(res.physical_bytes)
        if res.physical_bytes <= 1.05 * res.expert_bytes + 128 * 1024:
            break
    if physical[-1]:  # this filesystem reports read_bytes
        assert min(physical) <= 1.05 * plan.selected_bytes + 128 * 1024, physical


def test_adapter_only_plan_reads_only_the_adapters_factors(fam, tmp_path):
    """'Untouched' defined: the base is copied to the output (read once, counted apart as base
    bytes); of the experts, a plan over adapters reads nothing of any tensor the adapters do not
    adapt, and of the adapted ones only their factor bytes: at most the adapter files' tensor bytes."""
    root, lora, _ = fam
    plan = lora.plan(PlanRequest("base", ("ad3",), "task_arithmetic", "all"))
    factors = load_file(str(root / "adapters" / "ad3" / "adapter_model.safetensors"))
    assert plan.selected_bytes == sum(t.numel() * 4 for t in factors.values())  # every factor byte, once
    touched = (
        lora.sql(
            "SELECT DISTINCT ft.name FROM plan_mask pm JOIN plans p USING (plan_id) JOIN family_tensors ft "
            "ON ft.base_id = p.base_id AND ft.tensor_idx = pm.tensor_idx "
            f"WHERE pm.plan_id = {plan.plan_id} AND pm.selected"
        )
        .column("name")
        .to_pylist()
    )
    assert sorted(touched) == sorted(
        f"model.layers.{i}.self_attn.{p}.weight" for i in range(2) for p in ("q_proj", "v_proj")
    )
    res = executor.execute(lora.execution_plan(plan.plan_id), tmp_path / "out")
    assert res.expert_bytes == plan.selected_bytes
    assert res.base_bytes == sum(t.numel() * 4 for t in load_file(str(root / "base" / "model.safetensors")).values())


def test_output_bytes_do_not_depend_on_threads_or_unit_order(fam, tmp_path):
    _, lora, _ = fam
    plan = lora.plan(PlanRequest("base", ("ad1", "other", "ad2"), "ties", "50%", params={"density": 0.5}))
    xp = lora.execution_plan(plan.plan_id)
    a = executor.execute(xp, tmp_path / "a", threads=1)
    b = executor.execute(xp, tmp_path / "b", threads=3, unit_order_seed=5, verify=True)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert a.manifest["content_hash"] == b.manifest["content_hash"]


def test_bf16_family_against_merged_models(tmp_path):
    """bf16: peft's merge_and_unload() rounds θ₀ + Δ to bf16 in each model before the merge; mergedb
    folds each adapter's float32 Δ and rounds once, at the output. Against the float64 sum of peft's
    float32 deltas (task arithmetic, fp32 output) mergedb's merge of the adapters is exact to float32
    (measured 6.5e-8 per unit of update), while the merge of the merge_and_unload() bf16 models is
    2.1e-3 off; so the two merges differ by about 2e-3 (TIES: about 7e-2, the bf16 rounding moving
    trims and elected signs)."""
    base = lf.make_base(tmp_path / "base", dtype=torch.bfloat16)
    for name, seed in (("a", 1), ("b", 2)):
        lf.make_adapter(base, tmp_path / "adapters" / name, seed=seed, dtype=torch.bfloat16)
        merged = lf.merged_state(base, tmp_path / "adapters" / name, dtype=torch.bfloat16)
        lf.save_dense(merged, base, tmp_path / "dense" / name)
    bsd = {k: v.double().numpy() for k, v in lf.base_state(base, torch.bfloat16).items()}
    exact = dict(bsd)  # θ₀ + Σ Δ_k in float64, Δ_k from peft's float32 merge on the upcast base
    for name in ("a", "b"):
        for k, v in lf.merged_state(base, tmp_path / "adapters" / name, dtype=torch.float32).items():
            exact[k] = exact[k] + (v.double().numpy() - bsd[k])
    out = []
    for kind in ("adapters", "dense"):
        cat = Catalog(tmp_path / f"{kind}.duckdb")
        cat.register([base], base=True, block_size=BLOCK)
        cat.register([tmp_path / kind], base_model="base")
        out.append(_merge(cat, PlanRequest("base", ("a", "b"), "task_arithmetic", "all"), dtype="fp32")[0])
    assert _rel(out[0], exact, bsd) <= 1e-6
    assert 1e-4 < _rel(out[1], exact, bsd) < 1e-2  # the bf16-rounded models: a few bf16 ulps of θ off
    assert _rel(out[0], out[1], bsd) < 1e-2


def test_every_budget_counts_fixed_factors_once(fam):
    """Budget soundness and exactness across budgets: the plan's bytes never pass the budget and equal
    the bytes its blocks and their (expert, tensor)s' fixed factors cost, counted independently."""
    _, lora, _ = fam
    partial = 0
    for pct in (1, 3, 7, 15, 33, 50, 66, 90):
        for method, params in (("task_arithmetic", {}), ("ties", {"density": 0.3})):
            plan = lora.plan(PlanRequest("base", ("ad1", "ad2", "ad3", "other"), method, f"{pct}%", params=params))
            assert plan.selected_bytes <= plan.budget_bytes
            assert plan.selected_bytes == _selected_cost(lora, plan.plan_id), (pct, method)
            partial += (
                lora.sql(  # adapter tensors read in part: their fixed factor paid by one block
                    "SELECT count(*) AS n FROM (SELECT pm.checkpoint_id, pm.tensor_idx FROM plan_mask pm "
                    "JOIN checkpoints c USING (checkpoint_id) "
                    f"WHERE pm.plan_id = {plan.plan_id} AND c.adapter AND NOT pm.free GROUP BY ALL "
                    "HAVING bool_or(pm.selected) AND NOT bool_and(pm.selected))"
                )
                .column("n")
                .to_pylist()[0]
            )
    assert partial > 0  # the budgets above cut inside adapter tensors, not only between them
    plan = lora.plan(PlanRequest("base", ("ad1", "ad2"), "linear", "all", strategy="random", seed=4))
    assert plan.selected_bytes == _selected_cost(lora, plan.plan_id)


def _walk(cat: Catalog, experts: tuple[str, ...], budget: int, sqrt_size: bool = True) -> tuple[set, int]:
    """The textbook greedy with carriers, from the catalog's raw rows: score = |c_k|·‖Δ_kb‖ / √cost
    (the default value model, norm-sqrt; / cost without `sqrt_size`: --value norm) (task
    arithmetic, weights 1: c_k = 1), cost = read_bytes (dense: the block's bytes); per adapter
    (expert, tensor) with fixed bytes, its carrier is the non-free block of best score (lowest block
    on ties), costs read + fixed and scores value / that, the others score at most its score ×
    (1 − 2⁻⁴⁰); walk (score desc, position, tensor, block), take a block if it fits and its carrier
    is taken. Returns the selected (position, tensor, block) and their bytes."""
    rows = cat.sql(
        "SELECT c.name, eb.tensor_idx AS t, eb.block_idx AS b, eb.identical AS free, eb.delta_norm AS v, "
        "coalesce(eb.read_bytes, bl.nbytes) AS cost, coalesce(et.fixed_bytes, 0) AS fixed FROM expert_blocks eb "
        "JOIN checkpoints c USING (checkpoint_id) JOIN blocks bl ON bl.base_id = c.base_id "
        "AND bl.tensor_idx = eb.tensor_idx AND bl.block_idx = eb.block_idx "
        "JOIN expert_tensors et ON et.checkpoint_id = eb.checkpoint_id AND et.tensor_idx = eb.tensor_idx"
    ).to_pylist()
    per = math.sqrt if sqrt_size else float
    cands = {}
    for r in rows:
        if r["name"] in experts:
            k = (experts.index(r["name"]), r["t"], r["b"])
            cands[k] = dict(r, score=r["v"] / per(max(r["cost"], 1)), carrier=None)
    groups: dict = {}
    for k, c in cands.items():
        if c["fixed"] > 0 and not c["free"]:
            groups.setdefault(k[:2], []).append(k)
    for keys in groups.values():
        top = min(keys, key=lambda k: (-cands[k]["score"], k[2]))
        cands[top]["cost"] += cands[top]["fixed"]
        cands[top]["score"] = cands[top]["v"] / per(cands[top]["cost"])
        for k in keys:
            if k != top:
                cands[k]["score"] = min(cands[k]["score"], cands[top]["score"] * (1 - 2**-40))
                cands[k]["carrier"] = top
    taken, left = set(), budget
    for k in sorted(cands, key=lambda k: (-cands[k]["score"], k)):
        c = cands[k]
        if not c["free"] and c["cost"] <= left and (c["carrier"] is None or c["carrier"] in taken):
            taken.add(k)
            left -= c["cost"]
    return taken, budget - left


@pytest.mark.parametrize("value", [None, "norm"])
def test_plan_is_the_textbook_greedy_with_carriers(fam, value):
    """At many budgets the plan selects exactly what the walk above selects, and the plan_mask view's
    nbytes of the selected rows sum to the plan's bytes (the fixed factor on one row each); for the
    default value model (norm-sqrt) and for --value norm."""
    _, lora, _ = fam
    experts = ("ad1", "other", "ad2", "ad3")
    for pct in (0.5, 2, 5, 12, 25, 40, 60, 80, 95, 100):
        plan = lora.plan(PlanRequest("base", experts, "task_arithmetic", f"{pct}%", value_model=value))
        got = lora.sql(
            "SELECT pe.position, m.tensor_idx, m.block_idx, m.nbytes FROM plan_mask m JOIN plan_experts pe "
            f"ON pe.plan_id = m.plan_id AND pe.checkpoint_id = m.checkpoint_id WHERE m.plan_id = {plan.plan_id} "
            "AND m.selected"
        ).to_pylist()
        want, want_bytes = _walk(lora, experts, plan.budget_bytes, sqrt_size=value is None)
        assert {(r["position"], r["tensor_idx"], r["block_idx"]) for r in got} == want, pct
        assert plan.selected_bytes == want_bytes == sum(r["nbytes"] for r in got), pct


def test_cli_registers_one_adapter_and_refuses_dora_in_one_line(fam, tmp_path):
    root, _, _ = fam
    runner = CliRunner()
    cat = tmp_path / "c.duckdb"
    ok = runner.invoke(app, ["register", str(root / "base"), "--base", "--catalog", str(cat), "-q"])
    assert ok.exit_code == 0, ok.output
    ok = runner.invoke(app, ["register", str(root / "adapters" / "ad3"), "--base-model", "base", "--catalog", str(cat)])
    assert ok.exit_code == 0 and "registered 1 (ad3)" in ok.output, ok.output
    bad = tmp_path / "dora"
    lf.make_adapter(root / "base", bad, seed=4, use_dora=True, target_modules=["q_proj"])
    res = runner.invoke(app, ["register", str(bad), "--base-model", "base", "--catalog", str(cat)])
    assert res.exit_code != 0 and "DoRA" in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert Catalog(cat).sql("SELECT count(*) AS n FROM checkpoints").column("n").to_pylist() == [2]  # unchanged


def test_mixed_folder_name_option_and_integrity_check(fam, tmp_path):
    """A folder holding a dense expert and an adapter registers both; --name renames one adapter;
    `check` sees an adapter's changed config."""
    import shutil

    from mergedb.check import check_catalog

    root, _, _ = fam
    mixed = tmp_path / "mixed"
    shutil.copytree(root / "other" / "other", mixed / "other")
    shutil.copytree(root / "adapters" / "ad3", mixed / "ad3")
    shutil.copytree(root / "adapters" / "ad1", tmp_path / "ad1")
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([root / "base"], base=True, block_size=BLOCK)
    assert cat.register([mixed], base_model="base").registered == ("other", "ad3")
    assert cat.register([tmp_path / "ad1"], base_model="base", name="renamed").registered == ("renamed",)
    kinds = cat.sql("SELECT name, adapter FROM checkpoints ORDER BY checkpoint_id").to_pylist()
    assert [(r["name"], bool(r["adapter"])) for r in kinds] == [
        ("base", False),
        ("other", False),
        ("ad3", True),
        ("renamed", True),
    ]
    assert check_catalog(cat) == []
    cfg = tmp_path / "ad1" / "adapter_config.json"
    cfg.write_text(cfg.read_text().replace('"lora_alpha": 8', '"lora_alpha": 9'))
    problems = check_catalog(cat)
    assert len(problems) == 1 and "renamed" in str(problems[0]) and "changed since registration" in str(problems[0])


@pytest.mark.parametrize("method, params", [("ties", {"density": 0.5}), ("model_stock", {}), ("dare_ties", {})])
def test_fused_path_equals_per_step_path_with_adapters(fam, tmp_path, monkeypatch, method, params):
    """The wide fused path (loramerge.fused_block / stock_inputs) against the per-step oracle, bit for bit."""
    from mergedb import kernels

    _, lora, _ = fam
    plan = lora.plan(PlanRequest("base", ("ad1", "other", "ad2"), method, "60%", params=params, seed=2))
    xp = lora.execution_plan(plan.plan_id)
    fused = executor.execute(xp, tmp_path / "fused", threads=2)
    monkeypatch.setattr(kernels, "MODE", {})  # every method on the per-step path
    slow = executor.execute(xp, tmp_path / "slow", threads=2)
    assert (tmp_path / "fused" / "model.safetensors").read_bytes() == (
        tmp_path / "slow" / "model.safetensors"
    ).read_bytes()
    assert fused.expert_bytes == slow.expert_bytes == plan.selected_bytes


def test_registration_never_reads_untouched_tensors(fam, tmp_path):
    """Registering an adapter reads its factors once and the base's blocks of the tensors it
    adapts, nothing of the other tensors (logical count, and physical reads from a cold cache)."""
    root, _, _ = fam
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([root / "base"], base=True, block_size=BLOCK)
    factors = load_file(str(root / "adapters" / "ad3" / "adapter_model.safetensors"))
    base = load_file(str(root / "base" / "model.safetensors"))
    adapted = [f"model.layers.{i}.self_attn.{p}.weight" for i in range(2) for p in ("q_proj", "v_proj")]
    want = sum(t.numel() * 4 for t in factors.values()) + sum(base[n].numel() * 4 for n in adapted)
    _evict([root / "base" / "model.safetensors", root / "adapters" / "ad3" / "adapter_model.safetensors"])
    before = executor.physical_read_bytes()
    res = cat.register([root / "adapters" / "ad3"], base_model="base")
    physical = executor.physical_read_bytes() - before
    assert res.registered == ("ad3",) and res.bytes_read == want
    assert want < sum(t.numel() * 4 for t in base.values()) / 3  # 4 of the base's 21 tensors
    if physical:  # this filesystem reports read_bytes; headers and module files add a little
        assert physical <= 1.05 * want + 256 * 1024, physical


def test_sweep_refuses_adapters_in_one_line(fam, tmp_path, monkeypatch):
    """A sweep cannot count an adapter's factor reads (they bypass the shared reads): refused, no output,
    before anything is planned (a grid of 1,500 points planned for a minute, holding the catalog, first)."""
    from mergedb import grid

    _, lora, _ = fam
    plans_before = len(lora.plans())
    real = grid.plan_and_load
    monkeypatch.setattr(grid, "plan_and_load", lambda *a, **k: pytest.fail("planned before refusing"))
    for experts in (["ad1", "other"], None):
        req = PlanRequest(base="base", experts=experts, method="task_arithmetic", budget="all")
        with pytest.raises(PlanError, match="is a LoRA adapter; sweeps do not take adapters") as e:
            sweep_to_folders(lora, [req], tmp_path / "sweep")
        assert "\n" not in str(e.value)
        assert not (tmp_path / "sweep").exists() or not any((tmp_path / "sweep").iterdir())
        with pytest.raises(PlanError, match="LoRA adapter"):  # in memory too (Catalog.sweep)
            list(lora.sweep([req]))
    assert len(lora.plans()) == plans_before
    # a stored plan (nothing to plan) is refused after it is loaded, as before
    stored = lora.plan(PlanRequest(base="base", experts=["ad1", "other"], method="task_arithmetic", budget="all"))
    monkeypatch.setattr(grid, "plan_and_load", real)
    with pytest.raises(PlanError, match="'ad1' is a LoRA adapter; sweeps do not take adapters"):
        sweep_to_folders(lora, [stored.plan_id], tmp_path / "sweep")


def test_budgeted_adapter_plans_read_within_their_pages(tmp_path):
    """Budget soundness measured physically at a size where it can fail: two rank-64 adapters of
    ~4 MB each on a 512-wide base, 64 KiB blocks (8 KiB of B rows per block). From a cold cache, a
    25% and a 10% plan fetch at most their planned bytes plus one page per planned read (reads are
    not page-aligned) plus the files' headers, far below the adapters' size."""
    base = lf.make_base(tmp_path / "base", hidden=512)
    ads = [lf.make_adapter(base, tmp_path / "ads" / f"r{i}", seed=i, r=64, lora_alpha=64) for i in (1, 2)]
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([base], base=True, block_size="64KiB")
    cat.register([tmp_path / "ads"], base_model="base")
    files = [Path(a) / "adapter_model.safetensors" for a in ads]
    total = sum(f.stat().st_size for f in files)
    headers = sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in files)
    for budget in ("25%", "10%"):
        plan = cat.plan(PlanRequest("base", ("r1", "r2"), "task_arithmetic", budget))
        assert plan.selected_bytes <= plan.budget_bytes
        reads = (
            cat.sql(  # planned reads: each selected block's B rows, and each selected tensor's A once
                "SELECT count(*) + count(DISTINCT (checkpoint_id, tensor_idx)) AS n FROM plan_mask "
                f"WHERE plan_id = {plan.plan_id} AND selected AND nbytes > 0"
            )
            .column("n")[0]
            .as_py()
        )
        allowed = plan.selected_bytes + 4096 * (reads + 2 * len(files)) + headers
        assert allowed < 0.6 * total, (allowed, total)  # else the check below could not fail
        physical = []
        for attempt in range(3):  # a base page evicted by another process meanwhile counts as read
            for f in (tmp_path / "base").glob("*.safetensors"):
                f.read_bytes()
            _evict(files)
            res = executor.execute(cat.execution_plan(plan.plan_id), tmp_path / f"out-{budget[:-1]}-{attempt}")
            assert res.expert_bytes == plan.selected_bytes
            physical.append(res.physical_bytes)
            if res.physical_bytes <= allowed:
                break
        if physical[-1]:  # this filesystem reports read_bytes
            assert plan.selected_bytes * 0.9 <= min(physical) <= allowed, (budget, physical, allowed, total)


def test_a_plan_of_adapters_exports_as_mergekit_writes_adapters_and_reads_back(fam, tmp_path):
    """mergekit applies a LoRA to a model written MODEL+ADAPTER; the export wrote adapter folders as
    plain models, which mergekit cannot load (no weights, no config.json). It writes BASE+ADAPTER now,
    and mergedb reads that back as the registered adapter: the same plan."""
    from mergedb.mkplan import plan_from_config, plan_to_mergekit

    root, lora, _ = fam
    plan = lora.plan(PlanRequest("base", ("ad1", "other", "ad3"), "ties", params={"density": 0.5}))
    text = plan_to_mergekit(lora, plan.plan_id)
    base = str((root / "base").resolve())
    assert f"model: {base}+{(root / 'adapters' / 'ad1').resolve()}" in text
    assert f"model: {(root / 'other' / 'other').resolve()}\n" in text  # a full expert stays a plain model
    again = plan_from_config(lora, text)
    assert again.plan_hash == plan.plan_hash
