"""Regenerate benchmarks/RESULTS.md and the PNG plots from benchmarks/results/*.json."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .common import RESULTS, machine
from .lora_report import report_lines as lora_lines
from .parity_report import report_lines as parity_lines

OUT = RESULTS.parent / "RESULTS.md"


def _load(name: str, quick: bool) -> dict | None:
    p = RESULTS / f"{name}{'-quick' if quick else ''}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _planner(pl: dict | None) -> list[str]:
    """Planner at 1M / 10M / 35M rows (benchmarks/bench_planner.py): one fresh process per plan."""
    if not pl:
        return []
    lines = [
        "## Planner (issues 3, 11, 15)",
        "",
        "Task arithmetic over every expert of a simulated catalog, one fresh process per plan (peak RSS is "
        "the plan's own). The machine may be shared: CPU seconds and the 1-minute load average at the start "
        "are given beside wall seconds.",
        "",
        "| rows | experts | budget | wall s | planner s | CPU s | peak RSS GiB | load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in pl["runs"]:
        lines.append(
            f"| {r['rows']:,} | {r.get('experts', '')} | {r['budget']} | {r['plan_seconds']:.2f} | "
            f"{r['planner_reported_seconds']:.2f} | {r.get('cpu_seconds', float('nan')):.2f} | "
            f"{r['peak_rss_mib'] / 1024:.2f} | {r.get('load_average_1min', float('nan')):.1f} |"
        )
    return lines + [""]


def _plots(scaling: dict | None, fidelity: dict | None, suffix: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    if scaling:
        rows = scaling["rows"]
        for metric, label in (
            ("execute_seconds", "wall time (s)"),
            ("expert_bytes", "expert bytes read"),
            ("physical_bytes", "physical bytes read"),
            ("peak_rss_mib", "peak RSS (MiB)"),
        ):
            fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), sharey=True)
            for ax, method in zip(axes, ("task_arithmetic", "ties", "dare_ties")):
                for series in ("full", "two-experts", "10%", "mergekit"):
                    pts = [
                        (r["k"], r[metric])
                        for r in rows
                        if r["method"] == method and r["series"] == series and metric in r
                    ]
                    if pts:
                        ax.plot(*zip(*sorted(pts)), marker="o", label=series)
                ax.set_title(method)
                ax.set_xlabel("experts K")
            axes[0].set_ylabel(label)
            axes[0].legend()
            name = f"scaling_{metric}{suffix}.png"
            fig.tight_layout()
            fig.savefig(RESULTS / name, dpi=90)
            plt.close(fig)
            made.append(name)
    if fidelity:
        rows = [r for r in fidelity["rows"] if r["method"] in ("task_arithmetic", "ties")]
        sizes = sorted({r["size"] for r in rows})
        fig, axes = plt.subplots(1, len(sizes) * 2, figsize=(6 * len(sizes), 3.6))
        i = 0
        for size in sizes:
            for method in ("task_arithmetic", "ties"):
                ax = axes[i]
                i += 1
                for strategy in ("ranked", "random"):
                    pts = [
                        (float(r["budget"].rstrip("%")), max(r["rel_to_update"], 1e-9))
                        for r in rows
                        if r["size"] == size and r["method"] == method and r["strategy"] == strategy
                    ]
                    if pts:
                        ax.semilogy(*zip(*sorted(pts)), marker="o", label=strategy)
                ax.set_title(f"{method} ({size})")
                ax.set_xlabel("budget (% of full read)")
                ax.set_ylabel("‖θB−θF‖/‖θF−θ0‖")
                ax.legend()
        fig.tight_layout()
        name = f"fidelity{suffix}.png"
        fig.savefig(RESULTS / name, dpi=90)
        plt.close(fig)
        made.append(name)
    return made


def _targets(docs: dict) -> list[str]:
    """Each target of issues 2-5 with the measured value, met or missed, and why."""
    out = ["## Targets", "", "| target | measured | met |", "|---|---|---|"]
    ov = docs.get("register") or (docs.get("overheads") or {}).get("register")  # the newest run first
    if ov:
        runs = [r for r in ov.get("runs", []) if r.get("variant", "current") == "current"]
        rates = [r["sequential_gbps"] for r in runs]
        disk = f"; single stream {min(rates):.2f}–{max(rates):.2f} GB/s" if rates else ""
        base = ov.get("baseline_median_ratio_by_threads")
        side = f"; the --baseline tree side by side: {statistics.median(base.values()):.0%}" if base else ""
        out.append(
            "| register ≥ 60% of cold sequential read (issue 11; 70% in issue 2) | "
            f"{ov['median_ratio']:.0%} (best {ov['best_ratio']:.0%}{disk}{side}) | "
            f"{'yes' if ov['median_ratio'] >= 0.6 else 'no'} |"
        )
        out.append(
            f"| catalog < 1% of checkpoint bytes | {ov['catalog_fraction']:.2%} | "
            f"{'yes' if ov['catalog_fraction'] < 0.01 else 'no'} |"
        )
    pl = docs.get("planner")
    if pl:
        for lo, hi, target_s, target_gib, what in (
            (10_000_000, 30_000_000, 3, None, "plan 10M (expert, block) rows ≤ 3 s"),
            (30_000_000, None, 5, 4, "plan 35M rows (1,000 experts × 70B) ≤ 5 s, ≤ 4 GiB (issue 15)"),
        ):
            runs = [r for r in pl["runs"] if r["rows"] >= lo and (hi is None or r["rows"] < hi)]
            if runs:
                worst = max(r["plan_seconds"] for r in runs)
                gib = max(r["peak_rss_mib"] for r in runs) / 1024
                cpu = max(r.get("cpu_seconds", float("nan")) for r in runs)
                ok = worst <= target_s and (target_gib is None or gib <= target_gib)
                got = f"{worst:.1f} s wall, {cpu:.1f} CPU-s (peak RSS {gib:.2f} GiB)"
                out.append(f"| {what} | {got} | {'yes' if ok else 'no'} |")
    ex = docs.get("execute_targets")
    if ex:
        out.append(
            f"| 10% vs 100% at K={ex.get('k', 8)}: ≥ 5× faster | {ex['speedup_10pct']:.2f}× | "
            f"{'yes' if ex['speedup_10pct'] >= 5 else 'no'} |"
        )
        out.append(
            f"| expert bytes ≤ budget | {ex['10%']['expert_bytes']:,} ≤ {ex['10%']['budget_bytes']:,} | "
            f"{'yes' if ex['10%']['expert_bytes'] <= ex['10%']['budget_bytes'] else 'no'} |"
        )
        out.append(
            f"| peak RSS K=2 → K={ex.get('k', 8)} ≤ +10% | {100 * ex['rss_growth_k2_to_k8']:+.1f}% | "
            f"{'yes' if ex['rss_growth_k2_to_k8'] <= 0.10 else 'no'} |"
        )
    sc = docs.get("scaling")
    if sc:
        rows = sc["rows"]
        kmax = max(r["k"] for r in rows)
        get = {(r["method"], r["k"], r["series"]): r for r in rows}
        ta_full, ta_10 = get.get(("task_arithmetic", kmax, "full")), get.get(("task_arithmetic", kmax, "10%"))
        if ta_full and ta_10:
            speed = ta_full["execute_seconds"] / ta_10["execute_seconds"]
            # the bytes each run reads: its expert bytes and the whole base (expert bytes alone overstated
            # the ratio, 7.75× against 5.49×: benchmark review, 2026-12-03)
            moved = [r["expert_bytes"] + r.get("base_bytes", 0) for r in (ta_full, ta_10)]
            io = moved[0] / max(moved[1], 1)
            out.append(
                f"| 10% at K={kmax}: ≥ 8× faster than full read | {speed:.2f}× (I/O ratio, base + expert bytes, "
                f"{io:.1f}×) | {'yes' if speed >= 8 else 'no'} |"
            )
            out.append(
                f"| wall-time ratio ≥ 0.8 × I/O ratio | {speed / io:.2f} | {'yes' if speed / io >= 0.8 else 'no'} |"
            )
            # no share of the disk rate here: physical.json's rate comes from another run, over other files
            # (it judged this merge 49% where the paired measurement says 163%); see the paired rows below
        # mergekit's series needs its own venv (benchmarks/cache/mergekit-venv) and ~40 min; a scaling run
        # without it keeps the comparison of the last run that had it (mergedb's seconds there are its best
        # of 2 runs, mergekit's one run; its peak RSS is the row's own, re-measured after a fix: the row says so)
        mk_doc, when = sc, ""
        if not any(r["series"] == "mergekit" for r in rows) and docs.get("scaling-mergekit-2026-11-30"):
            mk_doc, when = docs["scaling-mergekit-2026-11-30"], " (run of 2026-11-30, 4 MiB catalog)"
        mk_get = {(r["method"], r["k"], r["series"]): r for r in mk_doc["rows"]}
        for method in ("task_arithmetic", "ties", "dare_ties"):
            k8 = min(8, max(r["k"] for r in mk_doc["rows"]))
            mk, full = mk_get.get((method, k8, "mergekit")), mk_get.get((method, k8, "full"))
            if mk and full and "error" not in mk:
                speed = mk["process_seconds"] / full["process_seconds"]
                out.append(
                    f"| {method} K={k8}: ≥ 1.5× faster than mergekit, lower peak RSS{when} | {speed:.1f}×, "
                    f"{full['peak_rss_mib']:.0f} vs {mk['peak_rss_mib']:.0f} MiB | "
                    f"{'yes' if speed >= 1.5 and full['peak_rss_mib'] < mk['peak_rss_mib'] else 'no'} |"
                )
                dev = mk.get("deviation_from_mergedb")
                if dev:
                    out.append(
                        f"| {method}: mergekit vs mergedb full output (reported) | ‖Δ‖/‖θF−θ0‖ = "
                        f"{dev['rel_to_update']:.2e} | – |"
                    )
    fi = docs.get("fidelity")
    if fi:
        for method in ("task_arithmetic", "ties"):
            rk = [r for r in fi["rows"] if r["method"] == method and r["budget"] == "50%" and r["strategy"] == "ranked"]
            rd = [r for r in fi["rows"] if r["method"] == method and r["budget"] == "50%" and r["strategy"] == "random"]
            if rk and rd:
                r0, d0 = rk[0], rd[0]
                out.append(
                    f"| {method} 50%: ‖θB−θF‖/‖θF−θ0‖ ≤ 0.05 ({r0['size']}) | {r0['rel_to_update']:.2e} | "
                    f"{'yes' if r0['rel_to_update'] <= 0.05 else 'no'} |"
                )
                gain = d0["rel_to_update"] / max(r0["rel_to_update"], 1e-300)
                out.append(
                    f"| {method} 50%: ranking ≥ 5× lower error than a random mask | {gain:.1f}× | "
                    f"{'yes' if gain >= 5 else 'no'} |"
                )
    out += _share_targets(docs.get("share"))
    small_doc = docs.get("planner-small") or {}
    small = small_doc.get("small_summary", {})
    same_run = small_doc.get("executions")  # bench_planner --execute: same run, same catalog
    if same_run:
        ex = ex or {}
        execs = {m: statistics.median(r["execute_seconds"] for r in runs) for m, runs in same_run.items()}
        where = f"{small_doc.get('catalog', '?')}, executions of the same run"
    elif ex:
        execs = {"task_arithmetic": ex["all"]["execute_seconds"], "ties": ex.get("rss_k8", {}).get("execute_seconds")}
        where = "execute_targets.json"
    if same_run or ex:  # judged on the whole Catalog.plan calls a program waits for when it plans many (in a
        # Catalog.hold, the hold's own opening and checkpoint shared out among them), not the planner's own
        # seconds, which leave the connection and COMMIT out (benchmark review, 2026-12-03); a plan alone
        # adds the attach and DETACH's checkpoint, and a process's first plan DuckDB's database and the
        # lazy imports: reported (the thirty-first session's decision, ANALYSIS.md)
        kinds = (
            (
                "repeated plans in one Catalog.hold, whole call, the hold's opening and closing shared out",
                "held_per_plan_seconds_median",
            ),
            ("repeated plans, whole call, each opening the catalog (reported)", "call_seconds_median"),
            ("first plan of a process, whole call (reported: a fixed start)", "first_call_seconds_median"),
            ("repeated plans, the planner alone (reported)", "planning_seconds_median"),
        )
        for label, key in kinds:
            parts, ok = [], bool(small)
            for method, seconds in execs.items():
                med = small.get(f"new/{method}", {}).get(key)
                if med and seconds:
                    share = med / seconds
                    parts.append(f"{method}: median {med * 1e3:.1f} ms = {share:.2%} of its {seconds:.2f} s execution")
                    ok = ok and share <= 0.01
                else:
                    ok = False
            got = "; ".join(parts) or "not measured"
            target = f"planning ≤ 1% of execution (K={ex.get('k', 8)}, full; {label}; {where})"
            out.append(f"| {target} | {got} | {'–' if 'reported' in label else 'yes' if ok else 'no'} |")
    notes = Path(__file__).parent / "ANALYSIS.md"
    out.append("")
    if notes.exists():
        out += [notes.read_text(), ""]
    return out


def _threads(th: dict | None) -> list[str]:
    """Issue 11: 1 vs 2 compute threads per method (identical outputs)."""
    if not th:
        return []
    out = [
        "## Threads (issue 11)",
        "",
        "Same plan, `--threads 1` vs `--threads 2`, K=8, cold cache, whole processes; the outputs are "
        "byte-identical (checked by the benchmark). No share of the disk rate here: the rate above was "
        "measured in another run over other files; the paired shares are in the next section.",
        "",
        "| method | budget | read | 1 thread s | 2 threads s | 2 vs 1 | RSS MiB (1 / 2) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in th["rows"]:
        out.append(
            f"| {r['method']} | {r['budget']} | {r['read_bytes'] / 1e9:.2f} GB | {r['seconds_1']:.2f} | "
            f"{r['seconds_2']:.2f} | {r['speedup_2']:.2f}× | "
            f"{r['peak_rss_mib_1']:.0f} / {r['peak_rss_mib_2']:.0f} |"
        )
    return [*out, ""]


def _share(doc: dict | None) -> list[str]:
    """Issue 11's disk-rate targets from results/share.json (benchmarks/bench_share.py): every execution
    paired with a cold read of the files it reads, medians over the repeats."""
    if not doc:
        return []
    rw = all("write_gbps" in r["median"] for r in doc["rows"])  # runs before the write probe lack it
    out = [
        "## Shares of the disk rate, paired (issue 11)",
        "",
        "`python -m benchmarks.bench_share`: every execution (a fresh `mergedb execute` process, cold cache) "
        "right after a cold single-stream read of the same files (the issue's `dd`-style rate) and a cold "
        "read of them from 4 threads; medians of the pairs. Share = (base + expert bytes) / execute seconds / "
        "rate; ideal = (base + selected expert bytes + output bytes) / rate; fixed = process wall − execute "
        f"seconds. At the end of the run: `{doc.get('uptime_end', '')}`."
        + (
            " Write GB/s: a file of the output's size written and fsynced right after each execution; the "
            "last column prices the output at that rate instead of the read rate (not the target: the "
            "reason a budgeted merge misses it)."
            if rw
            else ""
        ),
        "",
        "| method | K | budget | rate GB/s (1 stream / 4 threads) | execute s | share (1 stream) | share (4 threads) "
        "| execute / ideal (1 stream / 4 threads) | fixed s |"
        + (" write GB/s | execute / ideal, output at the write rate |" if rw else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|---|" if rw else ""),
    ]
    for r in doc["rows"]:
        m = r["median"]
        out.append(
            f"| {r['method']} | {r['k']} | {r['budget']} | {m['rate_gbps']:.2f} / {m['parallel_rate_gbps']:.2f} | "
            f"{m['execute_seconds']:.2f} | {m['share']:.0%} | {m['share_of_parallel']:.0%} | "
            f"{m['over_ideal']:.2f} / {m['over_ideal_parallel']:.2f} | {m['fixed_seconds']:.2f} |"
            + (f" {m['write_gbps']:.2f} | {m['over_ideal_rw']:.2f} |" if rw else "")
        )
    return [*out, ""]


def _share_targets(doc: dict | None) -> list[str]:
    """Issue 11's rows of the targets table (against the issue's single-stream rate; 4 threads beside)."""
    if not doc:
        return []
    out = []
    rows = doc["rows"]
    layout = f", layout {doc.get('block_size', '4MiB')}"  # runs before issue 16's default were at 4 MiB
    growth = []  # peak RSS of full reads, smallest K to largest, per method (default thread count)
    for method, target in doc["targets"]["share"].items():
        every_k = sorted((r for r in rows if r["method"] == method and r["budget"] == "all"), key=lambda r: r["k"])
        if len(every_k) >= 2:
            lo, hi = every_k[0], every_k[-1]
            growth.append((method, lo["k"], hi["k"], hi["median"]["peak_rss_mib"] / lo["median"]["peak_rss_mib"] - 1))
        # the full-read targets are at K = 8 and K = 20; a smaller K is shown, not judged
        full = [r for r in every_k if r["k"] >= 8]
        small_k = [r for r in every_k if r["k"] < 8]
        if full:
            got = ", ".join(
                f"K={r['k']} {r['median']['share']:.0%} ({r['median']['share_of_parallel']:.0%} of 4 threads)"
                for r in full
            )
            if small_k:
                got += "; not a target: " + ", ".join(f"K={r['k']} {r['median']['share']:.0%}" for r in small_k)
            ok = all(r["median"]["share"] >= target for r in full)
            out.append(
                f"| full read, {method}: ≥ {target:.0%} of the sequential rate (issue 11{layout}) | {got} | "
                f"{'yes' if ok else 'no'} |"
            )
    budgeted = [r for r in rows if r["budget"] != "all"]
    if budgeted:
        got = ", ".join(
            f"{r['method']} K={r['k']} {r['median']['over_ideal']:.2f}×"
            + (f" ({r['median']['over_ideal_rw']:.2f}× at the write rate)" if "over_ideal_rw" in r["median"] else "")
            for r in budgeted
        )
        ok = all(r["median"]["over_ideal"] <= doc["targets"]["over_ideal"] for r in budgeted)
        verdict = "yes" if ok else "no"
        budgets = "/".join(sorted({r["budget"] for r in budgeted}))
        out.append(f"| budgeted ({budgets}): execute ≤ 1.2 × ideal (issue 11{layout}) | {got} | {verdict} |")
    if growth:
        got = ", ".join(f"{m} K={a}→{b} {g:+.1%}" for m, a, b, g in growth)
        ok = all(g <= 0.10 for *_, g in growth)
        out.append(f"| peak RSS flat in K: ≤ +10% (issue 11{layout}) | {got} | {'yes' if ok else 'no'} |")
    fixed = [r["median"]["fixed_seconds"] for r in rows]
    ok = max(fixed) <= doc["targets"]["fixed_seconds"]
    span = f"{min(fixed):.2f}–{max(fixed):.2f} s"
    libs = [r["median"]["libraries_start_seconds"] for r in rows if "libraries_start_seconds" in r["median"]]
    if libs:  # the machine's speed in the same run: an interpreter importing the same libraries, nothing else
        span += f" (a bare interpreter importing the same libraries: {min(libs):.2f}–{max(libs):.2f} s)"
    out.append(f"| fixed start cost ≤ 0.5 s (issue 11{layout}) | {span} | {'yes' if ok else 'no'} |")
    return out


def _sweep(doc: dict | None) -> list[str]:
    """The "Sweeps (issue 14)" section from results/sweep.json (one sweep per N and grid)."""
    if not doc or "sweeps" not in doc:
        return []
    out = [
        "## Sweeps (issue 14)",
        "",
        f"`python -m benchmarks.bench_sweep --n {' '.join(str(s['n']) for s in doc['sweeps'][::2])} --k {doc['k']}`: "
        f"N TIES merges of the first {doc['k']} experts of the bench family at full budget, each arm from a cold "
        "page cache in processes of its own, side by side in one run. Grids: `lambda` = N/2 densities × λ ∈ "
        "{0.5, 1} (plans differing only in λ fold each block once), `density` = N densities at λ = 1 (every plan "
        "folds alone; only reads are shared). mergekit: "
        + (
            f"{doc['mergekit'][0]['measured_runs']} measured runs (the first points of the first grid), N × their mean "
            "in every row unless the row says all runs were measured. "
            if doc.get("mergekit")
            else "not run. "
        )
        + "The machine was shared while it ran (`uptime` before each arm below): with 2 cores and a load "
        "above 2 the wall ratios are not the machine's, the CPU seconds are closer to it."
        + (f" {doc['note']}" if doc.get("note") else ""),
        "",
        "| N | grid | arm | wall s | CPU s | expert bytes | read from storage | peak RSS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    mk = {(m["n"], m["grid"]): m for m in doc.get("mergekit", [])}
    notes = []
    for s in doc["sweeps"]:
        one, sw, sep, n, g = s["one"], s["sweep"], s["separate"], s["n"], s["grid"]
        lead = f"| {n} | {g} |"
        out += [
            f"{lead} one `execute` | {one['wall']:.1f} | {one['cpu_seconds']:.1f} | {one['expert_bytes'] / 1e9:.2f} GB"
            f" | {one['physical_bytes'] / 1e9:.2f} GB | {one['peak_rss_bytes'] / 2**20:.0f} MiB |",
            f"{lead} one sweep ({sw['fold_groups']} fold groups{_passes(sw)}) | {sw['wall']:.1f} | "
            f"{sw['cpu_seconds']:.1f} | "
            f"{sw['expert_bytes_read'] / 1e9:.2f} GB read once ({sw['expert_bytes_served'] / 1e9:.1f} GB served) | "
            f"{sw['physical_bytes'] / 1e9:.2f} GB | {sw['peak_rss_bytes'] / 2**30:.2f} GiB |",
            f"{lead} {n} separate `execute`s{_extrapolated(sep)} | {sep['wall']:.1f} | {sep['cpu_seconds']:.1f} | "
            f"{sep['expert_bytes'] / 1e9:.1f} GB | {sep['physical_bytes'] / 1e9:.2f} GB | "
            f"{sep['peak_rss_bytes'] / 2**20:.0f} MiB |",
        ]
        m = mk.get((n, g))
        if m:
            out.append(
                f"{lead} {n} mergekit runs ({m['label']}) | {m['wall']:.0f} | {m['cpu_seconds']:.0f} | "
                f"{m['expert_bytes'] / 1e9:.1f} GB | {m['physical_bytes'] / 1e9:.2f} GB | "
                f"{m['peak_rss_bytes'] / 2**20:.0f} MiB |"
            )
        ratio, cpu = s["sweep_over_one"], sw["cpu_seconds"] / one["cpu_seconds"]
        target = f" (target ≤ 2.5×: {'met' if ratio <= 2.5 else 'missed'} in this run)" if n == 8 else ""
        # ratios only between arms of one run: each entry carries its run's id (bench_sweep writes it; the
        # mergekit rows kept from an earlier run are marked "run": 0, and sweeps of runs before ids have none)
        same_run = m and s.get("run") is not None and s.get("run") == m.get("run")
        vs_mk = f", {m['wall'] / sw['wall']:.1f}× faster than mergekit ({m['label']})" if same_run else ""
        notes.append(
            f"- N = {n}, {g} grid: {n} merges in **{ratio:.2f}×** the wall of one{target} and {cpu:.1f}× its CPU "
            "seconds; "
            f"{s['separate_over_sweep']:.2f}× faster than separate runs{_extrapolated(sep)}{vs_mk}. "
            f"Load: one `{s['load_one']}`; "
            f"sweep `{s['load_sweep']}`."
        )
    return [*out, "", *notes, ""]


def _extrapolated(sep: dict) -> str:
    """' (extrapolated from M runs)' when only M of the N separate runs were measured."""
    return f" (extrapolated from {sep['measured_runs']} runs)" if sep.get("extrapolated") else ""


def _passes(sw: dict) -> str:
    """', N pass(es)' when the run recorded how many passes folded each block."""
    return f", {sw['fold_passes']} pass{'es' if sw['fold_passes'] != 1 else ''}" if "fold_passes" in sw else ""


def _remote(doc: dict | None) -> list[str]:
    """The "Remote checkpoints (issue 15)" section from results/remote.json."""
    if not doc:
        return []
    reg = doc["register_remote"]
    out = [
        "## Remote checkpoints (issue 15)",
        "",
        f"`python -m benchmarks.bench_remote --k {doc['k']}`: task_arithmetic over {doc['k']} experts of the "
        f"{doc['family']} family, read from a local HTTP server with Range support (a process of its own, "
        "logging every response) or from the local files, each run a fresh `mergedb execute` process on a "
        f"cold page cache, the two arms alternating, best of {doc['repeats']}. Remote outputs identical to "
        f"local: {'yes' if doc['outputs_identical'] else '**no**'}. Registering the base and the experts from "
        f"the server took {reg['seconds']:.1f} s and the server sent {reg['served_bytes'] / 1e9:.2f} GB for "
        f"{reg['file_bytes'] / 1e9:.2f} GB of files (the base twice: registered, then compared with the experts). "
        f"{doc['note']} (1-minute load average at the end: {doc['load'][0]:.1f}).",
        "",
        "| budget | arm | wall s | executor s | expert bytes (logical) | fetched (manifest) | sent (server log) "
        "| peak RSS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    budgets = list(dict.fromkeys(r["budget"] for r in doc["rows"]))
    for b in budgets:
        best = {}
        for arm in ("local", "remote"):
            rs = [r for r in doc["rows"] if r["budget"] == b and r["arm"] == arm]
            r = best[arm] = min(rs, key=lambda r: r["wall"])
            fetched = f"{r['remote_bytes_fetched'] / 1e6:.1f} MB" if arm == "remote" else "–"
            sent = f"{r['served_bytes'] / 1e6:.1f} MB" if arm == "remote" else "–"
            out.append(
                f"| {b} | {arm} | {r['wall']:.2f} | {r['seconds']:.2f} | {r['expert_bytes'] / 1e6:.1f} MB | "
                f"{fetched} | {sent} | {r['peak_rss_bytes'] / 2**20:.0f} MiB |"
            )
        lo, re_ = best["local"], best["remote"]
        need = re_["expert_bytes"] + re_["base_bytes"]
        out.append(
            f"| {b} | remote / local | {re_['wall'] / lo['wall']:.2f}× | {re_['seconds'] / lo['seconds']:.2f}× | "
            f"| fetched / (planned + base) = {re_['remote_bytes_fetched'] / need:.3f} | | |"
        )
    return [*out, ""]


def _ray(doc: dict | None) -> list[str]:
    """The "Ray executor (issue 15)" section from results/ray.json."""
    if not doc:
        return []
    med = doc["median_execute_seconds"]
    out = [
        "## Ray executor (issue 15)",
        "",
        f"`python -m benchmarks.bench_ray --k {doc['k']} --method {doc['method']} --budget {doc['budget']}`: one plan "
        f"({doc['selected_bytes'] / 1e9:.2f} GB of expert bytes) written in {doc['best']['local']['shards']} shards of "
        f"≤ {doc['shard_bytes'] / 1e6:.0f} MB by the local executor (all cores) and by one Ray task per shard on a "
        "local Ray of 1 and of 2 CPUs (1 merge thread per task), on a private copy of the bench family's base and "
        "experts; each arm a fresh process from a cold page cache, the arms alternating in every repeat. Outputs "
        f"identical in every arm and repeat: {'yes' if doc['outputs_identical'] else '**no**'}. Load average at the "
        f"end {', '.join(f'{x:.1f}' for x in doc['load_average'])} on {doc['machine']['cpus']} cores: the machine was "
        "shared with other jobs, so single runs swing; compare medians, side by side.",
        "",
        "| repeat | arm | execute s | wall s | Ray start s | read from storage | expert GB/s | peak RSS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        start = f"{r['ray_start_seconds']:.1f}" if "ray_start_seconds" in r else "–"
        out.append(
            f"| {r['repeat']} | {r['arm']} | {r['execute_seconds']:.2f} | {r['wall']:.1f} | {start} | "
            f"{r['physical_bytes'] / 1e9:.2f} GB | {r['expert_bytes'] / 1e9 / r['execute_seconds']:.2f} | "
            f"{r['peak_rss_bytes'] / 2**20:.0f} MiB |"
        )
    return [
        *out,
        "",
        f"- Median execute s: local {med['local']:.2f}, ray-1 {med['ray-1']:.2f}, ray-2 {med['ray-2']:.2f}. "
        f"Two Ray workers over one: **{doc['ray2_over_ray1']:.2f}×**; ray-2 takes **{doc['local_over_ray2']:.2f}×** "
        "the local executor's time. `execute s` excludes starting Ray (the Ray start column), which a cluster "
        "pays once, not per merge.",
        "",
    ]


def _many_tensors(doc: dict | None) -> list[str]:
    """bench_many_tensors: the new code against its baseline, medians of alternated processes."""
    if not doc:
        return []
    sm = doc["summary"]
    sides = [s for s in ("baseline", "new") if f"{s}/register/seconds" in sm]
    lines = [
        "## Families of many small tensors (issue 11)",
        "",
        f"`python -m benchmarks.bench_many_tensors`: a base and {doc['experts']} experts of {doc['tensors']:,} "
        "float32 tensors of 4 × 16, every tensor changed; registration of the experts and full-read merges "
        f"(cold), a process each, {len(doc['runs']['new']['register'])} alternated rounds, medians (baseline: "
        f"`{doc['baseline']}`). The merged bytes are the same on both sides (checked by the benchmark).",
        "",
        "| step | " + " | ".join(f"{s} s" for s in sides) + " | " + " | ".join(f"{s} peak MiB" for s in sides) + " |",
        "|---|" + "---|" * (2 * len(sides)),
    ]
    for step in ("register", "task_arithmetic", "ties"):
        secs = " | ".join(f"{sm[f'{s}/{step}/seconds']:.2f}" for s in sides)
        peaks = " | ".join(f"{sm[f'{s}/{step}/peak_rss'] / 2**20:.0f}" for s in sides)
        lines.append(f"| {step} | {secs} | {peaks} |")
    return lines + [""]


def write_report(quick: bool = False) -> Path:
    suffix = "-quick" if quick else ""
    docs = {
        n: _load(n, quick)
        for n in (
            "physical",
            "execute_targets",
            "threads",
            "scaling",
            "scaling-mergekit-2026-11-30",
            "fidelity",
            "overheads",
            "blocksize",
            "register",
            "planner",
            "parity",
            "sweep",
            "remote",
            "ray",
            "lora",
            "share",
            "planner-small",
            "many-tensors",
        )
    }
    lines = [
        "# Benchmark results",
        "",
        f"This report was generated on: {json.dumps(machine())}; the machine and date of each measurement are "
        "in its own JSON under results/ (`machine`).",
        "",
        "Regenerated by `python -m benchmarks.run" + (" --quick" if quick else "") + "`. Every execution is a fresh "
        "process on a cold page cache; times are the best of the repeats.",
        "",
    ]
    phys = docs["physical"]
    if phys:
        lines += [
            "## Physical limit",
            "",
            f"Cold sequential read of the expert files: {phys['gbps']:.2f} GB/s "
            f"(runs: {', '.join(f'{x:.2f}' for x in phys['gbps_runs'])}): the disk of that run, which "
            "swings several-fold between runs here; shares of the disk rate are measured paired, below.",
            "",
        ]
    ex = docs["execute_targets"]
    if ex:
        a, b = ex["all"], ex["10%"]
        lines += [
            "## Executor targets (issue 4)",
            "",
            "| config | budget | expert bytes | physical | execute s | peak RSS MiB |",
            "|---|---|---|---|---|---|",
        ]
        for key in ("all", "10%"):
            r = ex[key]
            lines.append(
                f"| task_arithmetic K={ex.get('k', 8)} | {key} ({r['budget_bytes']:,} B) | {r['expert_bytes']:,} | "
                f"{r['physical_bytes']:,} | {r['execute_seconds']:.2f} | {r['peak_rss_mib']:.0f} |"
            )
        for key in [k for k in ex if k.startswith("rss_k")]:
            r = ex[key]
            lines.append(
                f"| ties full, {key[4:]} | all | {r['expert_bytes']:,} | {r['physical_bytes']:,} | "
                f"{r['execute_seconds']:.2f} | {r['peak_rss_mib']:.0f} |"
            )
        lines += [
            "",
            f"- 10% vs 100% wall-time speed-up: **{ex['speedup_10pct']:.2f}×** (target ≥ 5×); expert "
            f"bytes {b['expert_bytes']:,} ≤ budget {b['budget_bytes']:,}.",
            f"- Peak RSS K=2 → K={ex.get('k', 8)}: **{100 * ex['rss_growth_k2_to_k8']:+.1f}%** (target ≤ +10%).",
            f"- The planner's own seconds / execution: {a['planning_seconds'] / a['execute_seconds']:.2%} (full), "
            f"{b['planning_seconds'] / b['execute_seconds']:.2%} (10%).",
            "",
        ]
    lines += _threads(docs["threads"])
    lines += _share(docs["share"])
    lines += _many_tensors(docs["many-tensors"])
    sc = docs["scaling"]
    if sc:
        lines += [
            "## Scaling with K (issue 5.1)",
            "",
            "| method | K | series | expert bytes | physical | execute s | peak RSS MiB |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in sc["rows"]:
            if "error" in r:
                lines.append(f"| {r['method']} | {r['k']} | {r['series']} | failed | | | |")
                continue
            rss = "" if r.get("peak_rss_mib") is None else f"{r['peak_rss_mib']:.0f}"
            phys = "" if r.get("physical_bytes") is None else f"{r['physical_bytes']:,}"
            lines.append(
                f"| {r['method']} | {r['k']} | {r['series']} | {r['expert_bytes']:,} | "
                f"{phys} | {r['execute_seconds']:.2f} | {rss} |"
            )
        if sc.get("note"):
            lines += ["", f"Note: {sc['note']}."]
        lines.append("")
    fi = docs["fidelity"]
    if fi:
        lines += [
            "## Fidelity frontier (issue 5.2)",
            "",
            "| size | method | budget | strategy | ‖θB−θF‖/‖θF‖ | "
            "‖θB−θF‖/‖θF−θ0‖ | worst tensor | bound | sketch estimate | measured |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in fi["rows"]:

            def f(v: float | None) -> str:
                return "" if v is None else f"{v:.3g}"

            lines.append(
                f"| {r['size']} | {r['method']} | {r['budget']} | {r['strategy']} | {r['rel_to_model']:.2e} | "
                f"{r['rel_to_update']:.2e} | {r['worst_tensor_rel_to_update']:.2e} | {f(r['bound'])} | "
                f"{f(r['estimate'])} | {r['abs_error']:.3g} |"
            )
        lines.append("")
    bs = docs["blocksize"]
    if bs:
        lines += [
            "## Block size (issue 5.5)",
            "",
            "| block size | budget | full-read GB/s | ‖θB−θF‖/‖θF−θ0‖ |",
            "|---|---|---|---|",
        ]
        for r in bs["rows"]:
            lines.append(
                f"| {r['block_size']} | {r['budget']} | {r['full_read_gbps']:.2f} | {r['rel_to_update']:.2e} |"
            )
        lines.append("")
    lines += _planner(docs["planner"])
    for name, title in (("register", "Registration (issue 2)"),):
        d = docs[name]
        if d:
            lines += [
                f"## {title}",
                "",
                "```json",
                json.dumps({k: v for k, v in d.items() if k != "machine"}, indent=1)[:4000],
                "```",
                "",
            ]
    lines += parity_lines(docs["parity"])  # written by python -m benchmarks.parity (issue 12)
    lines += _sweep(docs["sweep"])  # written by python -m benchmarks.bench_sweep (issue 14)
    lines += _remote(docs["remote"])  # written by python -m benchmarks.bench_remote (issue 15)
    lines += _ray(docs["ray"])  # written by python -m benchmarks.bench_ray (issue 15)
    lines += lora_lines(docs["lora"])  # written by python -m benchmarks.bench_lora (issue 13)
    lines += _targets(docs)
    for png in _plots(sc, fi, suffix):
        lines += [f"![{png}](results/{png})", ""]
    path = OUT if not quick else OUT.with_name("RESULTS-quick.md")
    path.write_text("\n".join(lines) + "\n")
    return path
