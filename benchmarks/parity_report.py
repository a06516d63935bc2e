"""The "mergekit parity (issue 12)" section of RESULTS.md, rendered from parity.json (benchmarks/parity.py)."""

from __future__ import annotations

from .parity import CONFIGS, EXACT_REL


def report_lines(doc: dict | None) -> list[str]:
    """The "mergekit parity (issue 12)" section of RESULTS.md, from parity.json."""
    if not doc or "skipped" in doc:
        return ["## mergekit parity (issue 12)", "", f"Skipped: {doc['skipped']}.", ""] if doc else []
    lines = [
        "## mergekit parity (issue 12)",
        "",
        f"`python -m benchmarks.parity`: mergekit {doc['mergekit_version']} (`mergekit-yaml --lazy-unpickle "
        f"--random-seed 0`) against mergedb (`mergedb plan --config CFG --budget all`, then `mergedb execute "
        f"--dtype` the config's out_dtype, else dtype) on synthetic Llama-layout families ({doc['size']}, "
        "3 experts). rel: max over tensors of ‖mergedb − mergekit‖/‖mergekit‖; "
        "upd: ‖mergedb − mergekit‖/‖mergekit − base‖ over all tensors; diff: share of elements that differ; "
        "ulp: largest difference in ulps of the output dtype; ties: share of positions where an expert's |Δ| "
        "ties at its TIES threshold (in parentheses: elements elsewhere that differ beyond rounding); "
        "sampled (DARE, DELLA): ‖mergedb − base‖/‖mergekit − base‖, and the shares of elements mergekit / "
        "mergedb changed from the base as written in the output dtype; f64 (SLERP): mergekit's / mergedb's max "
        "over tensors of ‖tool − ref‖/‖ref‖, ref = mergekit's SLERP formula in float64 rounded to the output "
        "dtype. check: what the row is held to.",
        "",
        "| config | family | expect | rel | upd | diff | ulp | ties | sampled | f64 | check | passed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        if "error" in r:
            err = r["error"].replace("|", "\\|").replace("\n", " ")[:300]
            failed = f"mergedb failed: {err}"
            lines.append(f"| {r['config']} | {r['family']} | {r['expect']} | | | | | | | | {failed} | **no** |")
            continue
        ties = f"{r['tie_frac']:.2e} ({r['diff_outside_ties']})" if "tie_frac" in r else ""
        sampled = (
            f"{r['update_ratio']:.3f}, {r['changed_mergekit']:.3f} / {r['changed_mergedb']:.3f}"
            if "update_ratio" in r
            else ""
        )
        f64 = f"{r['rel_mergekit_f64']:.2e} / {r['rel_mergedb_f64']:.2e}" if "rel_mergedb_f64" in r else ""
        ok = {True: "yes", False: "**no**", None: "–"}[r["passed"]]
        lines.append(
            f"| {r['config']} | {r['family']} | {r['expect']} | {r['rel']:.2e} | {r['rel_update']:.2e} | "
            f"{r['diff_frac']:.2e} | {r['max_ulp']:.3g} | {ties} | {sampled} | {f64} | {r['check']} | {ok} |"
        )
    lines += ["", *_summary(doc["rows"]), ""]
    lines += ["Predicted differences: " + "; ".join(f"{c.name}: {c.why}" for c in CONFIGS) + ".", ""]
    return lines


def _summary(rows: list[dict]) -> list[str]:
    """What the rows say against the acceptance (issue 12), one bullet each."""
    ran = [r for r in rows if "error" not in r]
    exact32 = [r for r in ran if r["expect"] == "exact" and r["out_dtypes"] == ["torch.float32"]]
    exact_rounded = [r for r in ran if r["expect"] == "exact" and r["out_dtypes"] != ["torch.float32"]]
    ties = [r for r in ran if "tie_frac" in r]
    sampled = [r for r in ran if "update_ratio" in r]
    failed = [r for r in rows if "error" in r]
    slerp = [r for r in ran if "rel_mergedb_f64" in r]
    out = []
    if exact32:
        worst = max(exact32, key=lambda r: r["rel"])
        out.append(
            f"- Exact configs written as float32 ({len(exact32)}): largest rel {worst['rel']:.2e} "
            f"({worst['config']}, {worst['family']}); within {EXACT_REL:g}: "
            f"{'yes' if worst['rel'] <= EXACT_REL else 'no'}"
            + "".join(f"; {r['config']} ({r['family']}) {r['rel']:.2e}" for r in exact32 if r["rel"] > EXACT_REL)
            + "."
        )
    if exact_rounded:
        worst = max(exact_rounded, key=lambda r: r["rel"])
        one = all(r["max_ulp"] <= 1 for r in exact_rounded)
        out.append(
            f"- Exact configs rounded to bfloat16/float16 ({len(exact_rounded)}): largest rel {worst['rel']:.2e} "
            f"({worst['config']}, {worst['family']}); every difference one rounding step (≤ 1 ulp): "
            f"{'yes' if one else 'no'}. Both compute in float32, in another order (mergedb folds c_k = λ·w_k "
            "into each Δ_k; mergekit scales Σ w_k Δ_k by λ, and linear sums w_k θ_k / Σw), so an element near "
            "a rounding boundary can round the other way; one flipped bfloat16 element is already ~1e-5 of a "
            "small tensor's norm. 1e-6 on a rounded output needs mergekit's float32 order exactly."
        )
    if ties:
        out.append(
            f"- TIES ({len(ties)}): elements that differ beyond rounding outside the "
            f"positions where an expert's |Δ| ties at its threshold: {sum(r['diff_outside_ties'] for r in ties)} "
            "(the README's difference predicts 0: mergedb keeps every tied element, mergekit exactly k)."
        )
    if sampled:
        lo = min(r["update_ratio"] for r in sampled)
        hi = max(r["update_ratio"] for r in sampled)
        out.append(
            f"- DARE/DELLA ({len(sampled)}): reported only. The two tools draw different random masks "
            "(mergekit: the global torch RNG, seeded by --random-seed; mergedb: its keyed Threefry stream, "
            "seeded by the plan), so their outputs are two samples of the same random merge and rel, upd, "
            "diff and ulp measure the sampling, not an error. What does not depend on the draws: "
            f"‖mergedb − base‖/‖mergekit − base‖ is {lo:.3f}–{hi:.3f}, and the shares of elements each "
            "changed are in the sampled column."
        )
    if slerp:
        mk = max(slerp, key=lambda r: r["rel_mergekit_f64"])
        mdb = max(slerp, key=lambda r: r["rel_mergedb_f64"])
        out.append(
            f"- SLERP ({len(slerp)}) against mergekit's formula in float64 (rounded to the output dtype): mergekit "
            f"up to {mk['rel_mergekit_f64']:.2e} ({mk['config']}, {mk['family']}), mergedb up to "
            f"{mdb['rel_mergedb_f64']:.2e} ({mdb['config']}, {mdb['family']}). mergekit computes the cosine, "
            "arccos and sines in float32; near cos = 1 (deltas small against the base) arccos magnifies the "
            "cosine's float32 rounding (and a cosine near mergekit's 0.9995 cut-off can fall on the other "
            "side of it: SLERP where the exact cosine says linear), mergedb takes them in float64 from the "
            "catalog's statistics. A float32 output of mergedb is within 1e-6 of the reference: "
            + ("yes" if all(r["rel_mergedb_f64"] <= EXACT_REL for r in slerp if r in exact32) else "no")
            + "."
        )
    if failed:
        out.append(
            f"- Failed ({len(failed)}): mergedb refused or crashed on "
            + ", ".join(f"{r['config']} ({r['family']})" for r in failed)
            + "; the error is in the row."
        )
    return out
