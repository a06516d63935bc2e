"""mergekit parity (issue 12): the same YAML configs through mergekit 0.1.5 and mergedb at full budget.

    python -m benchmarks.parity [--size small] [--dtypes fp32,bf16] [--only NAME ...]

For each synthetic Llama-layout family (one per dtype) and each config in CONFIGS (written in the
style of mergekit's examples: gradients, filter lists, scalar weights, dtype/out_dtype), it runs
`mergekit-yaml` from its own virtual environment (benchmarks/cache/mergekit-venv) and mergedb at
`--budget all` (`run_mergedb`), then compares the two outputs tensor by tensor in float64:

- rel: ‖mergedb − mergekit‖ / ‖mergekit‖, the maximum over tensors (the acceptance metric);
- rel_update: ‖mergedb − mergekit‖ / ‖mergekit − base‖ over all tensors (how much of the update differs);
- diff_frac: the share of elements that differ at all, and max_ulp, the largest difference in
  ulps of the output dtype (at the largest magnitude of the two outputs and the base: a result
  near 0 can come from cancelling large terms, whose rounding is what differs).

Expectations: "exact" configs (linear, task arithmetic and model stock computed in float32, SLERP)
must be within 1e-6 relative when written as float32, and at most one rounding step (1 ulp) apart
when rounded to bfloat16/float16 (both tools sum in float32, in different orders, so an element
near a rounding boundary may round the other way); "documented" ones differ as the README says (TIES keeps every
element tied at the threshold: on bf16 deltas many tie — `tie_frac` counts those positions from
the inputs, and `diff_outside_ties` the elements elsewhere that differ by more than rounding
(1 ulp of the output dtype or 8 float32 ulps), which should be none; DARE/DELLA draw
other random masks; mergekit's `dtype: bfloat16` does its arithmetic in bfloat16, mergedb in float32).

The mergedb side is one function, `run_mergedb(config_path, catalog, out)`, which calls
`mergedb plan --config`. Until that option exists, `plan_flags_fallback` translates the configs
today's flags can express exactly (scalar parameters; linear, task_arithmetic, ties, model_stock);
the others are reported as "pending" with the reason. Results: benchmarks/results/parity.json,
and `report_lines` renders the "mergekit parity (issue 12)" section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import string
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .common import CACHE, save

CLI = [sys.executable, "-m", "mergedb.cli"]
# like run.py's mergekit series: the venv under the benchmarks' cache (MERGEDB_BENCH_DIR moves it)
MERGEKIT_YAML = Path(os.environ.get("MERGEKIT_YAML", CACHE / "mergekit-venv" / "bin" / "mergekit-yaml"))
MAKE_VENV = (
    "python3 -m venv benchmarks/cache/mergekit-venv && "
    "benchmarks/cache/mergekit-venv/bin/pip install torch==2.13.0 mergekit==0.1.5"
)
EXACT_REL = 1e-6
EXPERTS = ("expert_00", "expert_01", "expert_02")
_OUT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


CONFIG_DIR = Path(__file__).parent / "parity_configs"


@dataclass(frozen=True)
class ParityConfig:
    """One mergekit config of parity_configs/; $BASE, $E0, $E1, $E2 and $LAYERS stand for the family's."""

    name: str
    expect: str  # "exact" (within EXACT_REL) or "documented" (differs as the README documents)
    why: str  # what predicts the difference (or why there is none): the file's `# why:` line
    yaml: str

    def render(self, family: Path, layers: int) -> str:
        names = {"BASE": family / "base", **{f"E{i}": family / e for i, e in enumerate(EXPERTS)}}
        return string.Template(self.yaml).substitute(LAYERS=layers, **{k: str(v) for k, v in names.items()})


def load_configs() -> list[ParityConfig]:
    """Every parity_configs/NN-name.yml, in order; its first two lines are `# expect:` and `# why:`."""
    out = []
    for f in sorted(CONFIG_DIR.glob("*.yml")):
        head = dict(line[2:].split(": ", 1) for line in f.read_text().splitlines()[:2])
        out.append(ParityConfig(f.stem.split("-", 1)[1], head["expect"], head["why"], f.read_text()))
    return out


CONFIGS = load_configs()
# what tests/test_mergekit_parity.py and `benchmarks.run --quick` run
QUICK = ("task_arithmetic", "task_arithmetic-fp32", "ties", "linear-gradient", "slerp-gradient")


# -- running the two tools ------------------------------------------------------------------------


class NotExpressible(Exception):
    """A config that today's `mergedb plan` flags cannot express exactly (needs `--config`)."""


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    r = subprocess.run([*CLI, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"mergedb {' '.join(args)} failed: {(r.stdout + r.stderr)[-1500:]}")
    return r


@functools.lru_cache(maxsize=1)
def has_config_option() -> bool:
    """Whether this mergedb's `plan` takes `--config` (issue 12, being built)."""
    return "--config" in _cli(["plan", "--help"]).stdout


def run_mergedb(config_path: Path, catalog: Path, out: Path) -> str:
    """Plan the config at full budget (named after `out`) and execute it into `out`; returns how it ran."""
    name = out.name
    if has_config_option():
        _cli(["plan", "--config", str(config_path), "--budget", "all", "--name", name, "-c", str(catalog)])
        _cli(["execute", name, "--out", str(out), "-c", str(catalog), "-q"])
        return "--config"
    plan_args, dtype = plan_flags_fallback(config_path)  # raises NotExpressible
    _cli(["plan", *plan_args, "--budget", "all", "--name", name, "-c", str(catalog)])
    _cli(["execute", name, "--out", str(out), "-c", str(catalog), "-q", *(["--dtype", dtype] if dtype else [])])
    return "flags fallback"


def plan_flags_fallback(config_path: Path) -> tuple[list[str], str | None]:
    """TEMPORARY until `mergedb plan --config` is on main: a config as today's plan flags.

    Only what the flags express with mergekit's exact semantics: scalar parameters, no slices,
    linear (normalize on, the base not among the models), task_arithmetic (no normalize, no
    rescale), ties (one density for all, no rescale), model_stock. Models are named by folder
    (what `mergedb register` names them). Returns (plan arguments, output dtype or None).
    """
    import yaml

    cfg = yaml.safe_load(Path(config_path).read_text())
    method = cfg["merge_method"]
    if method not in ("linear", "task_arithmetic", "ties", "model_stock"):
        raise NotExpressible(f"merge_method {method} needs --config")
    if "slices" in cfg or "models" not in cfg:
        raise NotExpressible("slices need --config")
    glob = cfg.get("parameters") or {}
    base = cfg.get("base_model")
    models = [m for m in cfg["models"] if m["model"] != base]
    per = [m.get("parameters") or {} for m in models]
    for value in [*glob.values(), *(v for p in per for v in p.values())]:
        if isinstance(value, (list, dict)):
            raise NotExpressible("gradient or filter parameters need --config")
    experts = ",".join(Path(m["model"]).name for m in models)
    flags = ["--base", Path(base).name if base else "base", "--experts", experts, "--method", method]
    if method != "model_stock":
        if any("weight" not in p for p in per):
            raise NotExpressible(f"{method} needs a weight for every model (mergekit requires one too)")
        flags += ["--weights", ",".join(str(float(p["weight"])) for p in per)]
    normalize = glob.get("normalize", method in ("linear", "ties"))  # mergekit 0.1.5's defaults
    if glob.get("rescale", False) or (method == "task_arithmetic" and normalize):
        raise NotExpressible("normalize/rescale other than mergekit's defaults need --config")
    if method == "linear" and (not normalize or base is not None):
        raise NotExpressible("linear without normalize, or with a base_model, needs --config")
    if "lambda" in glob:
        flags += ["--lambda", str(float(glob["lambda"]))]
    if method == "ties":
        densities = {float(p.get("density", 1.0)) for p in per}  # mergekit's default density is 1
        if len(densities) != 1:
            raise NotExpressible("different densities per model need --config")
        flags += ["--density", str(densities.pop()), "--normalize" if normalize else "--no-normalize"]
    out_dtype = cfg.get("out_dtype") or cfg.get("dtype")
    return flags, _OUT_DTYPE.get(out_dtype) if out_dtype else None


def run_mergekit(config_path: Path, out: Path) -> float:
    """mergekit-yaml in its own venv; returns its wall seconds."""
    t0 = time.perf_counter()
    r = subprocess.run(
        [str(MERGEKIT_YAML), str(config_path), str(out), "--lazy-unpickle", "--random-seed", "0", "--quiet"],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        raise RuntimeError(f"mergekit-yaml {config_path.name} failed: {r.stderr[-1500:]}")
    return time.perf_counter() - t0


# -- comparing outputs ----------------------------------------------------------------------------

_SIGNIFICAND_BITS = {"torch.float32": 24, "torch.bfloat16": 8, "torch.float16": 11}
_MIN_EXPONENT = {24: -126, 8: -126, 11: -14}  # of the smallest normal number: below it the spacing is fixed


def load_float(folder: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """name -> float64 array and name -> stored torch dtype, for every float tensor of a model folder."""
    from safetensors.torch import load_file

    arrays, dtypes = {}, {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            if t.is_floating_point():
                arrays[name] = t.double().numpy()
                dtypes[name] = str(t.dtype)
    return arrays, dtypes


def _ulp(x: np.ndarray, bits: int) -> np.ndarray:
    """Spacing of a float with `bits` significand bits at |x|: 2^(max(floor(log2|x|), e_min) + 1 − bits)."""
    _, e = np.frexp(x)  # |x| = m·2^e, m in [0.5, 1): floor(log2|x|) = e − 1
    e = np.where(x == 0, _MIN_EXPONENT[bits], e - 1)
    return np.ldexp(1.0, np.maximum(e, _MIN_EXPONENT[bits]) + 1 - bits)


def tie_positions(base: np.ndarray, experts: list[np.ndarray], densities: list[float]) -> np.ndarray:
    """Where TIES' two readings of "keep the top k" can disagree: some expert's |Δ| equals its k-th
    largest and more than k elements reach it (mergedb keeps them all, mergekit exactly k)."""
    tied = np.zeros(base.shape, bool)
    for x, d in zip(experts, densities):
        mag = np.abs((x.astype(np.float32) - base.astype(np.float32)).reshape(-1))
        k = max(1, int(d * mag.size))
        thr = np.partition(mag, mag.size - k)[mag.size - k]
        if d < 1 and thr > 0 and np.count_nonzero(mag >= thr) > k:
            tied |= (mag == thr).reshape(base.shape)
    return tied


def compare(mk_dir: Path, mdb_dir: Path, base_dir: Path, ties: tuple[list[Path], list[float]] | None = None) -> dict:
    """The metrics of the module docstring, over the float tensors mergekit wrote."""
    mk, mk_dt = load_float(mk_dir)
    mdb, _ = load_float(mdb_dir)
    base, _ = load_float(base_dir)
    missing = sorted(set(mk) - set(mdb))
    if missing:
        raise RuntimeError(f"mergedb's output lacks {len(missing)} tensors mergekit wrote, e.g. {missing[0]}")
    experts = [load_float(p)[0] for p in ties[0]] if ties else []
    worst, worst_name, d2, u2, n, n_diff, max_ulp, n_tied, unexplained = 0.0, "", 0.0, 0.0, 0, 0, 0.0, 0, 0
    for name, a in mk.items():
        b, b0 = mdb[name], base[name]
        d = np.linalg.norm(b - a)
        rel = d / max(np.linalg.norm(a), 1e-30)
        if rel > worst:
            worst, worst_name = rel, name
        d2, u2 = d2 + d**2, u2 + np.linalg.norm(a - b0) ** 2
        # rounding is relative to the inputs too: a result near 0 can come from cancelling large terms
        mag = np.maximum(np.maximum(np.abs(a), np.abs(b)), np.abs(b0))
        err = np.abs(b - a)
        ulp_out = _ulp(mag, _SIGNIFICAND_BITS[mk_dt[name]])
        beyond = err > np.maximum(ulp_out, 8 * _ulp(mag, 24))
        n += a.size
        n_diff += int(np.count_nonzero(err))
        max_ulp = max(max_ulp, float((err / ulp_out).max()))
        if ties:
            tied = tie_positions(b0, [e[name] for e in experts], ties[1])
            n_tied += int(np.count_nonzero(tied))
            unexplained += int(np.count_nonzero(beyond & ~tied))
    out = {
        "rel": float(worst),
        "worst_tensor": worst_name,
        "rel_update": float(np.sqrt(d2 / u2)) if u2 > 0 else (np.inf if d2 > 0 else 0.0),
        "diff_frac": n_diff / n,
        "max_ulp": max_ulp,
        "tensors": len(mk),
        "only_mergedb": sorted(set(mdb) - set(mk)),
        "out_dtypes": sorted(set(mk_dt.values())),
    }
    if ties:
        out |= {"tie_frac": n_tied / n, "diff_outside_ties": unexplained}
    return out


def _scalar_densities(cfg: dict) -> tuple[list[str], list[float]] | None:
    """(expert folders, densities) of a TIES config whose densities are scalars, else None."""
    models = [m for m in cfg.get("models") or [] if m["model"] != cfg.get("base_model")]
    dens = [(m.get("parameters") or {}).get("density", 1.0) for m in models]
    if cfg["merge_method"] != "ties" or not models or any(isinstance(d, (list, dict)) for d in dens):
        return None
    return [m["model"] for m in models], [float(d) for d in dens]


# -- the suite ------------------------------------------------------------------------------------


def prepare_family(root: Path, size: str, dtype: str) -> tuple[Path, Path]:
    """A synthetic family (cached) and a fresh catalog with it registered through the CLI."""
    from mergedb import synth

    fam = root / f"family-{size}-{dtype}"
    if not (fam / EXPERTS[-1] / "config.json").exists():
        shutil.rmtree(fam, ignore_errors=True)
        synth.make_family(fam, experts=len(EXPERTS), size=size, dtype=dtype, seed=12)
    catalog = root / f"catalog-{size}-{dtype}.duckdb"
    catalog.unlink(missing_ok=True)
    _cli(["register", str(fam), "--base-model", "base", "-c", str(catalog), "-q"])
    return fam, catalog


def run_suite(root: Path, size: str, dtypes: list[str], names: list[str] | None = None, validate_pending=True) -> list:
    """One row per (family dtype, config); see the module docstring for the columns."""
    import yaml

    from mergedb import synth

    configs = [c for c in CONFIGS if names is None or c.name in names]
    rows = []
    for dtype in dtypes:
        fam, catalog = prepare_family(root, size, dtype)
        for c in configs:
            work = root / "runs" / dtype / c.name
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir(parents=True)
            cfg_path = work / "merge.yml"
            cfg_path.write_text(c.render(fam, synth.SIZES[size].layers))
            row = {"config": c.name, "family": f"{size}-{dtype}", "expect": c.expect, "why": c.why}
            t0 = time.perf_counter()
            try:
                row["mergedb"] = run_mergedb(cfg_path, catalog, work / f"mergedb-{c.name}")
            except NotExpressible as e:
                row["mergedb"] = f"pending: {e}"
            row["mergedb_seconds"] = time.perf_counter() - t0
            if row["mergedb"].startswith("pending") and not validate_pending:
                rows.append(row)
                continue
            row["mergekit_seconds"] = run_mergekit(cfg_path, work / "mergekit")
            if not row["mergedb"].startswith("pending"):
                dens = _scalar_densities(yaml.safe_load(cfg_path.read_text()))
                ties = ([Path(p) for p in dens[0]], dens[1]) if dens else None
                row |= compare(work / "mergekit", work / f"mergedb-{c.name}", fam / "base", ties)
                row["passed"] = row["rel"] <= EXACT_REL if c.expect == "exact" else None
                row["rounding_only"] = row["max_ulp"] <= 1  # every difference is one rounding step
            rows.append(row)
    return rows


def report_lines(doc: dict | None) -> list[str]:
    """The "mergekit parity (issue 12)" section of RESULTS.md, from parity.json."""
    if not doc or "skipped" in doc:
        return ["## mergekit parity (issue 12)", "", f"Skipped: {doc['skipped']}.", ""] if doc else []
    lines = [
        "## mergekit parity (issue 12)",
        "",
        f"`python -m benchmarks.parity`: mergekit {doc['mergekit_version']} (`mergekit-yaml --lazy-unpickle`) "
        f"against mergedb at `--budget all` on synthetic Llama-layout families ({doc['size']}, 3 experts). "
        f"rel: max over tensors of ‖mergedb − mergekit‖/‖mergekit‖ (exact: ≤ {EXACT_REL:g}); "
        "upd: ‖mergedb − mergekit‖/‖mergekit − base‖ over all tensors; diff: share of elements that differ; "
        "ulp: largest difference in ulps of the output dtype; ties: share of positions where an expert's |Δ| "
        "ties at its TIES threshold (in parentheses: elements elsewhere that differ beyond rounding).",
        "",
        "| config | family | expect | mergedb via | rel | upd | diff | ulp | ties | rel ≤ 1e-6 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        if "rel" not in r:
            lines.append(f"| {r['config']} | {r['family']} | {r['expect']} | {r['mergedb']} | | | | | | |")
            continue
        ties = f"{r['tie_frac']:.2e} ({r['diff_outside_ties']})" if "tie_frac" in r else ""
        ok = {True: "yes", False: "**no**", None: "–"}[r["passed"]]
        lines.append(
            f"| {r['config']} | {r['family']} | {r['expect']} | {r['mergedb']} | {r['rel']:.2e} | "
            f"{r['rel_update']:.2e} | {r['diff_frac']:.2e} | {r['max_ulp']:.3g} | {ties} | {ok} |"
        )
    lines += ["", *_summary(doc["rows"]), ""]
    lines += ["Predicted differences: " + "; ".join(f"{c.name}: {c.why}" for c in CONFIGS) + ".", ""]
    return lines


def _summary(rows: list[dict]) -> list[str]:
    """What the rows say against the acceptance (issue 12), one bullet each."""
    ran = [r for r in rows if "rel" in r]
    exact32 = [r for r in ran if r["expect"] == "exact" and r["out_dtypes"] == ["torch.float32"]]
    exact_rounded = [r for r in ran if r["expect"] == "exact" and r["out_dtypes"] != ["torch.float32"]]
    ties = [r for r in ran if "tie_frac" in r]
    out = []
    if exact32:
        worst = max(exact32, key=lambda r: r["rel"])
        out.append(
            f"- Exact configs written as float32 ({len(exact32)}): largest rel {worst['rel']:.2e} "
            f"({worst['config']}, {worst['family']}); within {EXACT_REL:g}: "
            f"{'yes' if worst['rel'] <= EXACT_REL else 'no'}."
        )
    if exact_rounded:
        worst = max(exact_rounded, key=lambda r: r["rel"])
        one = all(r["rounding_only"] for r in exact_rounded)
        out.append(
            f"- Exact configs rounded to bfloat16/float16 ({len(exact_rounded)}): largest rel {worst['rel']:.2e} "
            f"({worst['config']}, {worst['family']}); every difference one rounding step (≤ 1 ulp): "
            f"{'yes' if one else 'no'}. Both sum in float32, in another order (mergedb folds c_k = λ·w_k "
            "into each Δ_k; mergekit scales Σ w_k Δ_k by λ, and linear sums w_k θ_k / Σw), so an element near "
            "a rounding boundary can round the other way; one flipped bfloat16 element is already ~1e-5 of a "
            "small tensor's norm. 1e-6 on a rounded output needs mergekit's float32 order exactly."
        )
    if ties:
        out.append(
            f"- TIES ({len(ties)}): elements that differ beyond rounding outside the positions where an expert's "
            f"|Δ| ties at its threshold: {sum(r['diff_outside_ties'] for r in ties)} (the README's difference "
            "predicts 0: mergedb keeps every tied element, mergekit exactly k)."
        )
    pending = [r for r in rows if r["mergedb"].startswith("pending")]
    if pending:
        out.append(
            f"- Pending ({len(pending)}): configs today's `mergedb plan` flags cannot express; they run through "
            "`mergedb plan --config` once it is on main (mergekit ran each of them here)."
        )
    return out


def mergekit_version() -> str:
    r = subprocess.run(
        [str(MERGEKIT_YAML.parent / "python"), "-c", "import importlib.metadata as m; print(m.version('mergekit'))"],
        capture_output=True,
        text=True,
    )
    return r.stdout.strip() or "unknown"


def suite_doc(root: Path, size: str, dtypes: list[str], names: list[str] | None, validate_pending: bool = True) -> dict:
    """parity.json's document: the rows of run_suite and what they were measured with."""
    if not MERGEKIT_YAML.exists():
        return {"skipped": f"no {MERGEKIT_YAML}: make it with {MAKE_VENV}", "rows": []}
    root.mkdir(parents=True, exist_ok=True)
    rows = run_suite(root, size, dtypes, names, validate_pending)
    return {"size": size, "mergekit_version": mergekit_version(), "exact_rel": EXACT_REL, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", help="synth size of the families (tiny | small | bench)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="family dtypes, comma-separated")
    ap.add_argument("--only", nargs="*", help="config names (default: all)")
    ap.add_argument("--workdir", type=Path, default=CACHE / "parity")
    a = ap.parse_args()
    doc = suite_doc(a.workdir, a.size, a.dtypes.split(","), a.only)
    if "skipped" in doc:
        print("parity skipped:", doc["skipped"])
        return
    path = save("parity", doc)
    print("\n".join(report_lines(doc)))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
