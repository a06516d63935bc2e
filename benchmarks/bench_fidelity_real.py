"""Task accuracy of budgeted merges of a real fine-tuned family (issue 16).

Builds (or reuses) benchmarks/realfamily.py's family under benchmarks/cache/realfamily2/<size>/family, registers
it into one catalog per block size (cached), picks each method's parameters by full-budget accuracy on
a small grid, then for every arm (method × block size × strategy × budget) plans, executes the plan
through the library into a Hugging Face folder, loads it with transformers and scores every task.
Also measures ‖θ_B − θ_F‖/‖θ_F − θ_0‖ of the written outputs (F: the same method at 100%) next to
what the plan reports (bound_blockwise, bound_rounded, est_error, each divided by ‖θ_F − θ_0‖), and,
per ranked plan, which experts and tensor kinds it kept.

    nice -n 10 python -m benchmarks.bench_fidelity_real [--quick] [--size quick|wide] [--block 64KiB|auto] [--tag T]
        [--value V] [--rules-block B]
    python -m benchmarks.bench_fidelity_real --size wide --report      # tables of a results file
    python -m benchmarks.bench_fidelity_real --check FAMILY_FOLDER     # in-memory full-budget merges

Size "wide" (layout "spread") uses 4 MiB and 32 KiB blocks (32 KiB: one 64-row group of its vocabulary
tensors); `--block` adds ranked and random arms at another registered block size. `--tag T` writes
fidelity_real[_SIZE]_T.json (started from the untagged file's arms, which it reuses, unless `--fresh`:
then every arm runs again, e.g. on a family rebuilt on another machine, whose weights may differ).

Results: benchmarks/results/fidelity_real.json (cached per arm: a rerun adds only new arms) and
fidelity_real.png. Extra arms (e.g. planner options from the rules branch) are added in `arms()`;
a PlanRequest field the checkout lacks is skipped with a note in the JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import realfamily as rf

ROOT = Path(__file__).resolve().parent
CACHE = ROOT / "cache" / "realfamily2" / "bench"  # main() points these at the --size chosen
FAMILY = CACHE / "family"
RESULTS = ROOT / "results" / "fidelity_real.json"
PLOT = ROOT / "results" / "fidelity_real.png"
BUDGETS = ("100%", "50%", "25%", "10%")
RANDOM_SEEDS = (0, 1, 2)
# every tensor of the bench size is ≤ 1 MiB, so 4 MiB makes each tensor one block; 8 KiB is 16 rows of
# 256 bf16 values: one alphabet of the embedding and the LM head per block (realfamily aligns the
# alphabets to 16 rows), and 32–128 blocks per attention / MLP matrix
# "auto": registration's per-tensor rule (vocabulary tensors in 64 KiB blocks of at most 64 rows, others 4 MiB)
BLOCKS = {"4MiB": 4 * 2**20, "64KiB": 64 * 2**10, "32KiB": 32 * 2**10, "8KiB": 8 * 2**10, "auto": "auto"}
MORE_BLOCKS: tuple[str, ...] = ()  # --block NAME (repeatable): ranked and random arms at another block size
VALUE_ARMS: tuple[str, ...] = ()  # --value V (repeatable): ranked arms with PlanRequest.value_model V
RULES_BLOCKS: tuple[str, ...] = ()  # --rules-block B (repeatable): the rules' arms at B, under today's default value
# the small block of each size: size "wide" (layout "spread", hidden 256) has 64-token alphabets, 32 KiB each
# in the embedding and the LM head, and 64 rows of an attention / MLP matrix per 32 KiB
SMALL = "8KiB"
LAYOUT = rf.DISJOINT
TA_GRID = [{"lambda": v} for v in (0.3, 0.5, 0.7, 1.0)]
TIES_GRID = [{"density": d, "lambda": v} for d in (0.2, 0.5) for v in (0.7, 1.0, 1.5)]


def catalog(block: str):
    import mergedb

    path = CACHE / f"catalog-{block}.duckdb"
    cat = mergedb.connect(path)
    cat.register([FAMILY / "base"], base=True, block_size=BLOCKS[block])
    cat.register([FAMILY / f"expert_{t}" for t in rf.TASKS], base_model="base")
    return cat


def _float_state(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.torch import load_file  # bf16 has no numpy type: read through torch

    return {k: v.to(torch.float64).numpy() for k, v in load_file(folder / "model.safetensors").items()}


def _sq(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return float(sum(np.square(a[k] - b[k]).sum() for k in a))


def _tensor_kind(name: str) -> str:
    for kind in ("embed_tokens", "lm_head", "self_attn", "mlp", "norm"):
        if kind in name:
            return kind
    return "other"


def run_arm(cat, arm: dict, n_eval: int) -> dict:
    """Plan, execute, load and score one arm; returns its record."""
    from mergedb.planner import PlanRequest

    fields = {f.name for f in dataclasses.fields(PlanRequest)}
    # an arm without a value model plans with --value norm, the planner's default when its records
    # were first measured (the default is norm-sqrt since; its arms name it), so cached arms keep their meaning
    extra = {"value_model": "norm"} | {k: v for k, v in arm.get("extra", {}).items() if k in fields}
    missing = sorted(set(arm.get("extra", {})) - fields)
    req = PlanRequest(
        "base",
        None,
        arm["method"],
        arm["budget"],
        params=dict(arm["params"]),
        strategy=arm["strategy"],
        seed=arm["seed"],
        **extra,
    )
    t0 = time.time()
    plan = cat.plan(req)
    out = CACHE / "out" / arm["block"] / plan.plan_hash[:16]
    if not (out / "model.safetensors").exists():
        cat.execute(plan.plan_id, out, force=True)
    acc = rf.all_accuracies(rf.load(out), n_eval, layout=LAYOUT)
    xp = cat.execution_plan(plan.plan_id)
    kinds: dict[str, list[int]] = {}
    names = [t.name for t in xp.tensors]
    sel = xp.mask.select(["position", "tensor_idx"]).to_pylist()
    for r in sel:
        kinds.setdefault(_tensor_kind(names[r["tensor_idx"]]), [0] * len(rf.TASKS))[r["position"]] += 1
    return {
        **arm,
        "missing_fields": missing,
        "plan_hash": plan.plan_hash,
        "out": str(out.relative_to(CACHE)),
        "accuracy": acc,
        "mean": float(np.mean(list(acc.values()))),
        "selected_bytes": plan.selected_bytes,
        "full_bytes": plan.full_bytes,
        "bound_blockwise": plan.bound_blockwise,
        "bound_rounded": plan.bound_rounded,
        "est_error": plan.est_error,
        "coverage": {e.name: e.coverage for e in plan.experts},
        "selected_blocks_by_kind": kinds,
        "seconds": time.time() - t0,
    }


def pick_params(cat, n_eval: int, done: dict) -> dict[str, dict]:
    """Each method's parameters: the best mean accuracy at 100% on its grid (4 MiB blocks)."""
    best = {}
    for method, grid in (("task_arithmetic", TA_GRID), ("ties", TIES_GRID)):
        scores = []
        for params in grid:
            arm = _arm(method, params, "4MiB", "ranked", 0, "100%", tag="grid")
            rec = done.get(_key(arm)) or run_arm(cat, arm, n_eval)
            done[_key(arm)] = rec
            scores.append((rec["mean"], params))
        best[method] = max(scores, key=lambda s: s[0])[1]
    return best


def _arm(method, params, block, strategy, seed, budget, tag="main", extra=None) -> dict:
    return {
        "tag": tag,
        "method": method,
        "params": params,
        "block": block,
        "strategy": strategy,
        "seed": seed,
        "budget": budget,
        "extra": extra or {},
    }


def _key(arm: dict) -> str:
    return json.dumps(
        {k: arm[k] for k in ("method", "params", "block", "strategy", "seed", "budget", "extra")}, sort_keys=True
    )


def arms(best: dict[str, dict], quick: bool) -> list[dict]:
    out = []
    blocks = ("4MiB",) if quick else ("4MiB", SMALL, *MORE_BLOCKS)
    for method, params in best.items():
        for block in blocks:
            for budget in BUDGETS:
                out.append(_arm(method, params, block, "ranked", 0, budget))
                if budget != "100%":
                    out += [_arm(method, params, block, "random", s, budget) for s in RANDOM_SEEDS]
    return out


def deviations(records: list[dict]) -> None:
    """Adds measured ‖θ_B − θ_F‖/‖θ_F − θ_0‖ and the plan's own figures over ‖θ_F − θ_0‖."""
    theta0 = _float_state(FAMILY / "base")
    full: dict[tuple, dict] = {}
    for r in records:
        if r["budget"] == "100%" and r["strategy"] == "ranked":
            full[(r["method"], json.dumps(r["params"], sort_keys=True), r["block"])] = r
    for r in records:
        f = full.get((r["method"], json.dumps(r["params"], sort_keys=True), r["block"]))
        if f is None or "deviation" in r:
            continue
        sf = _float_state(CACHE / f["out"])
        sb = _float_state(CACHE / r["out"])
        denom = math.sqrt(_sq(sf, theta0))
        r["full_norm"] = denom
        r["deviation"] = math.sqrt(_sq(sb, sf)) / denom
        for k in ("bound_blockwise", "bound_rounded", "est_error"):
            r[k + "_rel"] = None if r[k] is None else r[k] / denom


def summarize(records: list[dict]) -> list[dict]:
    """Mean ± spread (min..max over seeds) per (method, block, strategy, extra, budget)."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        if r["tag"] == "grid":
            continue
        key = json.dumps([r["method"], r["block"], r["strategy"], r["extra"], r["budget"]])
        groups.setdefault(key, []).append(r)
    rows = []
    for key, rs in sorted(groups.items()):
        method, block, strategy, extra, budget = json.loads(key)
        means = [x["mean"] for x in rs]
        devs = [x.get("deviation") for x in rs if x.get("deviation") is not None]
        rows.append(
            {
                "method": method,
                "block": block,
                "strategy": strategy,
                "extra": extra,
                "budget": budget,
                "n": len(rs),
                "mean": float(np.mean(means)),
                "min": float(min(means)),
                "max": float(max(means)),
                "per_task": {t: float(np.mean([x["accuracy"][t] for x in rs])) for t in rf.TASKS},
                "deviation": float(np.mean(devs)) if devs else None,
                "bound_blockwise_rel": rs[0].get("bound_blockwise_rel"),
                "est_error_rel": rs[0].get("est_error_rel"),
            }
        )
    return rows


def plot(rows: list[dict], path: Path, family: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = sorted({r["method"] for r in rows})
    fig, axes = plt.subplots(1, len(methods), figsize=(6 * len(methods), 7.5), squeeze=False)
    for ax, method in zip(axes[0], methods):
        lines: dict[str, list[dict]] = {}
        for r in rows:
            if r["method"] == method:
                label = f"{r['strategy']} {r['block']}" + (f" {json.dumps(r['extra'])}" if r["extra"] else "")
                lines.setdefault(label, []).append(r)
        for label, rs in sorted(lines.items()):
            rs = sorted(rs, key=lambda r: float(r["budget"].rstrip("%")))
            x = [float(r["budget"].rstrip("%")) for r in rs]
            y = [100 * r["mean"] for r in rs]
            err = [[100 * (r["mean"] - r["min"]) for r in rs], [100 * (r["max"] - r["mean"]) for r in rs]]
            ax.errorbar(x, y, yerr=err, marker="o" if "ranked" in label else "x", capsize=3, label=label)
        if family:  # the base and the experts on their own tasks, for scale
            base = 100 * float(np.mean(list(family["base"]["accuracy"].values())))
            own = 100 * float(np.mean([e["accuracy"] for e in family["experts"].values()]))
            ax.axhline(base, color="gray", ls=":", label=f"base ({base:.1f}%)")
            ax.axhline(own, color="black", ls="--", label=f"experts on own task ({own:.1f}%)")
        ax.set_xscale("log")
        ax.set_xticks([10, 25, 50, 100], ["10%", "25%", "50%", "100%"])
        ax.set_xlabel("budget (share of expert bytes)")
        ax.set_ylabel("mean task accuracy (%)")
        ax.set_title(method)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)  # below: curves stay visible
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")


def main(argv: list[str]) -> None:
    global CACHE, FAMILY, RESULTS, PLOT, SMALL, LAYOUT, MORE_BLOCKS, VALUE_ARMS, RULES_BLOCKS
    size = argv[argv.index("--size") + 1] if "--size" in argv else "bench"
    CACHE = ROOT / "cache" / "realfamily2" / size
    FAMILY = CACHE / "family"
    MORE_BLOCKS = tuple(argv[i + 1] for i, a in enumerate(argv) if a == "--block")
    VALUE_ARMS = tuple(argv[i + 1] for i, a in enumerate(argv) if a == "--value")
    RULES_BLOCKS = tuple(argv[i + 1] for i, a in enumerate(argv) if a == "--rules-block")
    recipe = rf.RECIPES.get(size, rf.Recipe(size=size))
    LAYOUT = recipe.tokens()
    SMALL = "32KiB" if LAYOUT is rf.SPREAD else "8KiB"
    if size != "bench":
        RESULTS = RESULTS.with_name(f"fidelity_real_{size}.json")
        PLOT = PLOT.with_name(f"fidelity_real_{size}.png")
    if "--tag" in argv:
        tag = argv[argv.index("--tag") + 1]
        untagged, RESULTS = RESULTS, RESULTS.with_name(f"{RESULTS.stem}_{tag}.json")
        PLOT = PLOT.with_name(f"{PLOT.stem}_{tag}.png")
        if not RESULTS.exists() and untagged.exists() and "--report" not in argv and "--fresh" not in argv:
            RESULTS.write_text(untagged.read_text())
    if "--check" in argv:
        check_family(Path(argv[argv.index("--check") + 1]))
        return
    if "--report" in argv:
        data = json.loads(RESULTS.read_text())
        plot(data["summary"], PLOT, data["family"])
        print(family_table(data) + "\n\n" + targets(data) + "\n\n" + report(data) + "\n\n" + explain(data))
        return
    quick = "--quick" in argv
    n_eval = 64 if quick else 256
    torch.set_num_threads(1)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    t0, c0 = time.time(), time.process_time()
    build = rf.build(FAMILY, recipe, log=lambda s: print(s, flush=True))
    prev = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    same = prev.get("family_digest") == build["digest"] and prev.get("n_eval_per_task") == n_eval
    done = {_key(r): r for r in prev.get("records", []) if same and "--fresh" not in argv}
    cats = {}

    def cat_for(block):
        if block not in cats:
            cats[block] = catalog(block)
        return cats[block]

    best = pick_params(cat_for("4MiB"), n_eval, done)
    print("parameters:", best, flush=True)
    from mergedb.planner import PlanRequest

    fields = {f.name for f in dataclasses.fields(PlanRequest)}
    for arm in arms(best, quick) + extra_arms(best):
        if _key(arm) in done and done[_key(arm)]["tag"] == "grid":
            done[_key(arm)]["tag"] = "main"  # the chosen grid point is the main arm's 100% plan
        if _key(arm) not in done and set(arm["extra"]) <= fields:
            done[_key(arm)] = run_arm(cat_for(arm["block"]), arm, n_eval)
            r = done[_key(arm)]
            print(
                f"{arm['method']} {arm['block']} {arm['strategy']}{arm['seed']} {arm['extra']} {arm['budget']}:",
                f"{r['mean']:.3f} ({r['seconds']:.0f} s)",
                flush=True,
            )
            # the arms so far, so that an interrupted run resumes from them (summary and plot come at the end)
            partial = {"family_digest": build["digest"], "n_eval_per_task": n_eval, "records": list(done.values())}
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.with_suffix(".tmp").write_text(json.dumps(partial))
            RESULTS.with_suffix(".tmp").rename(RESULTS)
    records = list(done.values())
    deviations(records)
    rows = summarize(records)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "family_digest": build["digest"],
                "family": {k: build[k] for k in build if k != "folders"},
                "parameters": best,
                "n_eval_per_task": n_eval,
                "summary": rows,
                "records": records,
                "bench_wall_s": time.time() - t0,
                "bench_cpu_s": time.process_time() - c0,
            },
            indent=1,
        )
    )
    plot(rows, PLOT, build)


def report(data: dict) -> str:
    """Markdown tables of a results file: accuracy per arm, then measured deviation against the plan's figures."""
    tasks = list(rf.TASKS)
    lines = [
        "| method | block | strategy | options | budget | mean acc (min..max) | "
        + " | ".join(tasks)
        + " | ‖θ_B−θ_F‖/‖θ_F−θ₀‖ | plan bound / est. (rel.) |",
        "|" + "---|" * (8 + len(tasks)),
    ]
    order = {b: i for i, b in enumerate(BUDGETS)}
    rows = sorted(
        data["summary"],
        key=lambda r: (r["method"], r["block"], json.dumps(r["extra"]), order[r["budget"]], r["strategy"]),
    )
    for r in rows:
        spread = f"{100 * r['mean']:.1f}" + (f" ({100 * r['min']:.1f}..{100 * r['max']:.1f})" if r["n"] > 1 else "")
        dev = "–" if r["deviation"] is None else f"{r['deviation']:.3f}"
        b, e = r.get("bound_blockwise_rel"), r.get("est_error_rel")
        plan = " / ".join("–" if v is None else f"{v:.3f}" for v in (b, e))
        opts = ", ".join(f"{k}={v}" for k, v in r["extra"].items()) or "–"
        per = " | ".join(f"{100 * r['per_task'][t]:.0f}" for t in tasks)
        head = f"| {r['method']} | {r['block']} | {r['strategy']} | {opts} | {r['budget']}"
        lines.append(f"{head} | {spread} | {per} | {dev} | {plan} |")
    return "\n".join(lines)


def targets(data: dict) -> str:
    """Per method × block × options: ranked accuracy drop from full budget (targets: ≤ 1 / 2 / 5 points at
    50 / 25 / 10%) and ranked minus the random seeds' mean (target: ≥ 3 points at 25 and 10%)."""
    rows = {(r["method"], r["block"], json.dumps(r["extra"]), r["strategy"], r["budget"]): r for r in data["summary"]}
    lines = [
        "| method | block | options | full | 50%: drop (≤1) | 25%: drop (≤2) | 10%: drop (≤5) "
        "| 25%: ranked − random (≥3) | 10%: ranked − random (≥3) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method, block, extra, strategy, budget in sorted(rows):
        if strategy != "ranked" or budget != "50%":
            continue
        full = rows.get((method, block, "{}", "ranked", "100%")) or rows.get((method, "4MiB", "{}", "ranked", "100%"))
        cells = []
        for b, limit in (("50%", 1), ("25%", 2), ("10%", 5)):
            r = rows.get((method, block, extra, "ranked", b))
            drop = 100 * (full["mean"] - r["mean"])
            cells.append(f"{drop:+.1f} {'met' if drop <= limit else 'MISSED'}")
        for b in ("25%", "10%"):
            r, rnd = rows.get((method, block, extra, "ranked", b)), rows.get((method, block, "{}", "random", b))
            gap = None if rnd is None else 100 * (r["mean"] - rnd["mean"])
            cells.append("–" if gap is None else f"{gap:+.1f} {'met' if gap >= 3 else 'MISSED'}")
        opts = ", ".join(f"{k}={v}" for k, v in json.loads(extra).items()) or "–"
        lines.append(f"| {method} | {block} | {opts} | {100 * full['mean']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def explain(data: dict) -> str:
    """For each ranked plan without options below 100%: each task's accuracy drop from full budget next to
    its own expert's byte coverage, and the selected (expert, tensor-block) count per tensor kind."""
    recs = [r for r in data["records"] if r["tag"] == "main" and r["strategy"] == "ranked" and not r["extra"]]
    full = {(r["method"], r["block"]): r for r in recs if r["budget"] == "100%"}
    full_4m = {m: r for (m, b), r in full.items() if b == "4MiB"}
    lines = [
        "| method | block | budget | task: drop in points (own expert's coverage) | selected blocks by kind |",
        "|---|---|---|---|---|",
    ]
    for r in sorted(recs, key=lambda r: (r["method"], r["block"], -float(r["budget"].rstrip("%")))):
        f = full.get((r["method"], r["block"])) or full_4m.get(r["method"])
        if r["budget"] == "100%" or f is None:
            continue
        cells = ", ".join(
            f"{t} {100 * (f['accuracy'][t] - r['accuracy'][t]):+.0f} ({100 * r['coverage'].get('expert_' + t, 0):.0f}%)"
            for t in rf.TASKS
        )
        kinds = ", ".join(f"{k} {sum(v)}" for k, v in sorted(r["selected_blocks_by_kind"].items()))
        lines.append(f"| {r['method']} | {r['block']} | {r['budget']} | {cells} | {kinds} |")
    return "\n".join(lines)


def check_family(folder: Path, n_eval: int = 128) -> None:
    """Prints full-budget 8-way merges computed in memory (torch, no catalog), to judge a recipe before the
    benchmark: task arithmetic on the TA grid, TIES (per-tensor magnitude trim, sign election, disjoint
    mean) on the TIES grid, and task arithmetic of parts of the deltas (own rows, special-token rows,
    other embedding/head rows, shared layers) at λ = 1, to see which part breaks a merge."""
    import copy

    layout = rf.SPREAD
    base = rf.load(folder / "base")
    theta0 = {k: v.clone() for k, v in base.state_dict().items()}
    deltas = []
    for t in rf.TASKS:
        st = rf.load(folder / f"expert_{t}").state_dict()
        deltas.append({k: st[k] - theta0[k] for k in theta0})

    def score(state) -> str:
        m = copy.deepcopy(base)
        m.load_state_dict(state)
        acc = rf.all_accuracies(m, n_eval, layout=layout)
        return f"{100 * np.mean(list(acc.values())):.1f} (" + " ".join(f"{100 * v:.0f}" for v in acc.values()) + ")"

    for p in TA_GRID:
        print("task_arithmetic", p, score({k: theta0[k] + p["lambda"] * sum(d[k] for d in deltas) for k in theta0}))
    for p in TIES_GRID:
        state = {}
        for k in theta0:
            flat = torch.stack([d[k] for d in deltas]).reshape(len(deltas), -1)  # (experts, n)
            keep = max(1, int(p["density"] * flat.shape[1]))
            thr = flat.abs().kthvalue(flat.shape[1] - keep + 1, dim=1).values[:, None]
            trimmed = torch.where(flat.abs() >= thr, flat, torch.zeros_like(flat))
            agree = (torch.sign(trimmed) == torch.sign(trimmed.sum(0))) & (trimmed != 0)
            mean = (trimmed * agree).sum(0) / agree.sum(0).clamp(min=1)
            state[k] = theta0[k] + p["lambda"] * mean.reshape(theta0[k].shape)
        print("ties", p, score(state))
    special = torch.zeros(layout.vocab, dtype=torch.bool)
    special[: rf.TASK_ROW0] = True
    for parts in (
        ("own",),
        ("own", "special"),
        ("own", "other"),
        ("own", "layers"),
        ("own", "special", "other", "layers"),
    ):
        state = {k: v.clone() for k, v in theta0.items()}
        for t, d in zip(rf.TASKS, deltas):
            own = torch.zeros(layout.vocab, dtype=torch.bool)
            own[layout.own_rows(t)] = True
            rows = torch.zeros(layout.vocab, dtype=torch.bool)  # the embedding/head rows of the chosen parts
            if "own" in parts:
                rows |= own
            if "special" in parts:
                rows |= special & ~own
            if "other" in parts:
                rows |= ~own & ~special
            for k in theta0:
                vocab = "embed_tokens" in k or "lm_head" in k
                state[k] += d[k] * rows[:, None] if vocab else d[k] * ("layers" in parts)
        print("task_arithmetic λ=1 of", "+".join(parts), score(state))


def family_table(data: dict) -> str:
    """Per expert: its accuracy on its own task (stored dtype), with only its own embedding/head rows
    applied to the base, and where its ‖Δ‖² sits (layout "spread" records these)."""
    experts = data["family"]["experts"]
    if not all("delta_share" in e for e in experts.values()):
        return ""
    lines = [
        "| expert | own task acc | own rows only | ‖Δ‖² in own rows | other embedding/head rows | shared layers |",
        "|---|---|---|---|---|---|",
    ]
    for t, e in experts.items():
        sh = e["delta_share"]
        lines.append(
            f"| {t} | {100 * e['accuracy']:.1f} | {100 * e['own_rows_only_accuracy']:.1f} | "
            f"{100 * sh['own_rows']:.1f}% | {100 * sh['other_rows']:.1f}% | {100 * sh['shared_layers']:.1f}% |"
        )
    return "\n".join(lines)


def extra_arms(best: dict[str, dict]) -> list[dict]:
    """Ranked arms with the access-set rules of the rules branch (PlanRequest.value_model, min_coverage);
    an arm whose field the checkout lacks is not run."""
    options = {
        "task_arithmetic": [{"min_coverage": 0.05}],
        "ties": [
            {"value_model": "consensus"},
            {"min_coverage": 0.05},
            {"value_model": "consensus", "min_coverage": 0.05},
        ],
    }
    if LAYOUT is rf.SPREAD:  # the larger family: the two options one at a time (their sum changed nothing before)
        options["ties"] = options["ties"][:2]
    out = [
        _arm(method, best[method], block, "ranked", 0, budget, extra=extra)
        for method in best
        for extra in options[method]
        for block in ("4MiB", SMALL)
        for budget in BUDGETS[1:]
    ]
    # `--rules-block B`: the same options at block size B, coverage under the default value (norm-sqrt)
    out += [
        _arm(method, best[method], block, "ranked", 0, budget, extra={"value_model": "norm-sqrt"} | extra)
        for method in best
        for extra in options[method]
        for block in RULES_BLOCKS
        for budget in BUDGETS[1:]
    ]
    # `--value V` (e.g. norm-sqrt, issue 16's size-neutral score): ranked arms at every block size run
    return out + [
        _arm(method, best[method], block, "ranked", 0, budget, extra={"value_model": value})
        for value in VALUE_ARMS
        for method in best
        for block in ("4MiB", SMALL, *MORE_BLOCKS)
        for budget in BUDGETS[1:]
    ]


if __name__ == "__main__":
    main(sys.argv[1:])
