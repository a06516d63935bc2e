"""A small version of benchmarks/parity.py: mergedb at full budget against mergekit 0.1.5 itself.

Runs only where mergekit has its own virtual environment (benchmarks/cache/mergekit-venv, or
MERGEKIT_YAML pointing at a mergekit-yaml); skipped otherwise, with the reason. The reference
is the other tool: nothing here is computed by mergedb's code.
"""

from __future__ import annotations

import pytest

from benchmarks import parity

needs_mergekit = pytest.mark.skipif(
    not parity.MERGEKIT_YAML.exists(),
    reason=f"no mergekit to compare with: {parity.MERGEKIT_YAML} is missing (make it with `{parity.MAKE_VENV}`, "
    "or set MERGEKIT_YAML)",
)


def test_configs_are_in_mergekit_example_styles():
    names = [c.name for c in parity.CONFIGS]
    assert len(names) >= 10 and len(set(names)) == len(names)
    text = "\n".join(c.yaml for c in parity.CONFIGS)
    for method in ("linear", "task_arithmetic", "ties", "dare_ties", "slerp", "della", "model_stock"):
        assert f"merge_method: {method}\n" in text
    assert "value: [0, 0.5, 0.3, 0.7, 1]" in text and "- filter: self_attn" in text and "out_dtype:" in text
    assert set(parity.QUICK) <= set(names)


@needs_mergekit
def test_small_parity_run(tmp_path):
    rows = parity.run_suite(tmp_path, "tiny", ["fp32"], list(parity.QUICK))
    assert sorted(r["config"] for r in rows) == sorted(parity.QUICK)
    for r in rows:  # every config runs through `mergedb plan --config` and is compared
        assert "error" not in r, r["error"]
        assert r["tensors"] > 0 and r["only_mergedb"] == [], r  # the same float tensors on both sides
        if "rel_mergedb_f64" in r and r["out_dtypes"] == ["torch.float32"]:
            # SLERP written as float32: mergedb within 1e-6 of mergekit's formula in float64, and any
            # gap to mergekit no larger than mergekit's own distance from that formula (it computes
            # the cosine, arccos and sines in float32; near cos = 1 arccos magnifies that rounding)
            assert r["rel_mergedb_f64"] <= parity.EXACT_REL, r
            assert r["rel"] <= r["rel_mergekit_f64"] + parity.EXACT_REL, r
        elif r["expect"] == "exact":  # float32 out: within 1e-6; rounded out: at most one rounding step apart
            assert r["rel"] <= parity.EXACT_REL if r["out_dtypes"] == ["torch.float32"] else r["max_ulp"] <= 1, r
        if "tie_frac" in r:  # TIES: every difference beyond rounding sits where a threshold ties
            assert r["diff_outside_ties"] == 0, r
        if r["expect"] == "sampled":  # other draws: only what does not depend on them is comparable
            assert r["passed"] is None and 0.8 < r["update_ratio"] < 1.25, r
    assert {r["config"] for r in rows if "tie_frac" in r} == {"ties", "ties-gradient"}
