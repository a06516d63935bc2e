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

Expectations (each config file's `# expect:` line; `judge` turns them into a row's check):
- exact (linear, task arithmetic and model stock computed in float32, SLERP): within 1e-6 relative
  when written as float32, and at most one rounding step (1 ulp) apart when rounded to
  bfloat16/float16 (both tools compute in float32, in different orders, so an element near a
  rounding boundary may round the other way);
- documented: differs as the README says. TIES keeps every element tied at the threshold: on bf16
  deltas many tie — `tie_frac` counts those positions from the inputs, and `diff_outside_ties` the
  elements elsewhere that differ by more than rounding (1 ulp of the output dtype or 8 float32
  ulps), which must be none (densities per tensor as mergekit evaluates them: `ties_densities`);
  mergekit's `dtype: bfloat16` does its arithmetic in bfloat16, mergedb in float32 (reported only);
- sampled (DARE, DELLA): the tools draw different random masks (mergekit: the global torch RNG,
  `--random-seed 0`; mergedb: a keyed Threefry stream), so the outputs are two samples and only
  reported, with what does not depend on the draws: `update_ratio` = ‖mergedb − base‖ /
  ‖mergekit − base‖ and the shares of elements each tool changed from the base.

The mergedb side is `run_mergedb`: `mergedb plan --config CFG --budget all --name N`, then
`mergedb execute N --dtype D` with the config's out_dtype, else its dtype (a plan stores no dtype).
A config mergedb refuses, or a crash, is recorded in its row as `error`. Results:
benchmarks/results/parity.json, and parity_report.py renders the "mergekit parity (issue 12)"
section of RESULTS.md from it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import string
import subprocess
import sys
import time
from collections.abc import Callable
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
    expect: str  # "exact", "documented" or "sampled": see the module docstring
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
QUICK = (
    "task_arithmetic",
    "task_arithmetic-fp32",
    "ties",
    "ties-gradient",
    "linear-gradient",
    "slerp-gradient",
    "slerp",
    "dare_ties",
)


# -- running the two tools ------------------------------------------------------------------------


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    r = subprocess.run([*CLI, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise MergeDBFailed(f"mergedb {' '.join(args)} failed (exit {r.returncode}): {(r.stdout + r.stderr)[-1500:]}")
    return r


class MergeDBFailed(RuntimeError):
    """A mergedb command exited non-zero: a refused config or a crash, reported in the config's row."""


def out_dtype_flag(cfg: dict) -> list[str]:
    """`--dtype D` for `mergedb execute`: the config's out_dtype, else its dtype (a plan stores no dtype)."""
    dtype = cfg.get("out_dtype") or cfg.get("dtype")
    return ["--dtype", _OUT_DTYPE[dtype]] if dtype else []


def run_mergedb(config_path: Path, catalog: Path, out: Path) -> None:
    """`mergedb plan --config` at full budget (the plan named after `out`), then `mergedb execute` into `out`."""
    import yaml

    cfg = yaml.safe_load(Path(config_path).read_text())
    name = out.name
    _cli(["plan", "--config", str(config_path), "--budget", "all", "--name", name, "-c", str(catalog)])
    _cli(["execute", name, "--out", str(out), "-c", str(catalog), "-q", *out_dtype_flag(cfg)])


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


def _round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """x rounded to a torch dtype ("torch.bfloat16", ...) and back to float64."""
    import torch

    return torch.from_numpy(x).to(getattr(torch, dtype.removeprefix("torch."))).double().numpy()


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


def compare(
    mk_dir: Path,
    mdb_dir: Path,
    base_dir: Path,
    ties: tuple[list[Path], Callable[[str], list[float]]] | None = None,
    sampled: bool = False,
) -> dict:
    """The metrics of the module docstring, over the float tensors mergekit wrote; `sampled` adds the
    statistics that do not depend on which random draws each tool made (DARE, DELLA)."""
    mk, mk_dt = load_float(mk_dir)
    mdb, _ = load_float(mdb_dir)
    base, _ = load_float(base_dir)
    missing = sorted(set(mk) - set(mdb))
    if missing:
        raise RuntimeError(f"mergedb's output lacks {len(missing)} tensors mergekit wrote, e.g. {missing[0]}")
    experts = [load_float(p)[0] for p in ties[0]] if ties else []
    worst, worst_name, d2, u2, n, n_diff, max_ulp, n_tied, unexplained = 0.0, "", 0.0, 0.0, 0, 0, 0.0, 0, 0
    v2, kept_mk, kept_mdb = 0.0, 0, 0  # ‖mergedb − base‖², elements each tool changed
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
        v2 += np.linalg.norm(b - b0) ** 2
        if sampled:  # changed: differs from the base as written in the output dtype (not its rounding)
            b0_out = _round_to(b0, mk_dt[name])
            kept_mk, kept_mdb = (
                kept_mk + int(np.count_nonzero(a != b0_out)),
                kept_mdb + int(np.count_nonzero(b != b0_out)),
            )
        max_ulp = max(max_ulp, float((err / ulp_out).max()))
        if ties:
            tied = tie_positions(b0, [e[name] for e in experts], ties[1](name))
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
    if sampled:  # two valid samples agree on these in expectation, whatever the seeds
        out |= {
            "update_ratio": float(np.sqrt(v2 / u2)) if u2 > 0 else np.inf,
            "changed_mergekit": kept_mk / n,
            "changed_mergedb": kept_mdb / n,
        }
    return out


def mergekit_setting(value, tensor: str, t: float) -> float | None:
    """A numeric parameter as mergekit 0.1.5's `evaluate_setting` reads it: a scalar; a gradient list,
    piecewise linear in t; or {filter, value} entries (the first whose filter is absent, "*" or a
    substring of the tensor name)."""
    if isinstance(value, (int, float)):
        return float(value)
    if all(isinstance(v, (int, float)) for v in value):
        scaled = t * (len(value) - 1)
        i0 = int(scaled)
        i1, frac = min(len(value) - 1, i0 + 1), scaled - i0
        return (1 - frac) * value[i0] + frac * value[i1]
    for cond in value:
        if cond.get("filter") in (None, "*") or cond["filter"] in tensor:
            return mergekit_setting(cond["value"], tensor, t)
    return None


def mergekit_t(tensor: str, layers: int) -> float:
    """mergekit's gradient position: layer i of n at i/(n−1) (1 when n = 1); other tensors at 0."""
    if not tensor.startswith("model.layers."):
        return 0.0
    return int(tensor.split(".")[2]) / (layers - 1) if layers > 1 else 1.0


def slerp_float64(v0: np.ndarray, v1: np.ndarray, t: float, dot_threshold=0.9995, eps=1e-8) -> np.ndarray:
    """mergekit 0.1.5's SLERP of two whole tensors (a linear blend when |cos| > dot_threshold) in float64."""
    n0, n1 = np.linalg.norm(v0), np.linalg.norm(v1)
    dot = np.clip(np.sum((v0 / (n0 if n0 > eps else 1)) * (v1 / (n1 if n1 > eps else 1))), -1, 1)
    if abs(dot) > dot_threshold:
        return (1 - t) * v0 + t * v1
    theta = np.arccos(dot)
    return np.sin((1 - t) * theta) / np.sin(theta) * v0 + np.sin(t * theta) / np.sin(theta) * v1


def slerp_reference_rel(cfg: dict, layers: int, mk_dir: Path, mdb_dir: Path) -> dict | None:
    """For a slerp config: each tool's max over tensors of ‖tool − ref‖/‖ref‖, ref = `slerp_float64`
    of the inputs with t as mergekit evaluates it, rounded to the output dtype (which tool a miss of
    1e-6 comes from)."""
    if cfg["merge_method"] != "slerp":
        return None
    sources = cfg.get("models") or cfg["slices"][0]["sources"]
    other = next(Path(m["model"]) for m in sources if m["model"] != cfg["base_model"])
    base, expert = load_float(Path(cfg["base_model"]))[0], load_float(other)[0]
    (mk, mk_dt), mdb = load_float(mk_dir), load_float(mdb_dir)[0]
    worst = {"mergekit": 0.0, "mergedb": 0.0}
    for name, a in mk.items():
        ref = slerp_float64(
            base[name], expert[name], mergekit_setting(cfg["parameters"]["t"], name, mergekit_t(name, layers))
        )
        ref = _round_to(ref, mk_dt[name])
        norm = max(np.linalg.norm(ref), 1e-30)
        for tool, out in (("mergekit", a), ("mergedb", mdb[name])):
            worst[tool] = max(worst[tool], float(np.linalg.norm(out - ref) / norm))
    return {"rel_mergekit_f64": worst["mergekit"], "rel_mergedb_f64": worst["mergedb"]}


def ties_densities(cfg: dict, layers: int) -> tuple[list[Path], Callable[[str], list[float]]] | None:
    """(expert folders, tensor -> each expert's density) of a `ties` config, else None; a model's own
    density wins over the merge-wide one, and mergekit's default is 1."""
    models = [m for m in cfg.get("models") or [] if m["model"] != cfg.get("base_model")]
    if cfg["merge_method"] != "ties" or not models:
        return None
    glob = (cfg.get("parameters") or {}).get("density", 1.0)
    settings = [(m.get("parameters") or {}).get("density", glob) for m in models]

    def densities(tensor: str) -> list[float]:
        t = mergekit_t(tensor, layers)
        return [mergekit_setting(d, tensor, t) for d in settings]

    return [Path(m["model"]) for m in models], densities


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


def run_suite(root: Path, size: str, dtypes: list[str], names: list[str] | None = None) -> list:
    """One row per (family dtype, config); see the module docstring for the columns. A mergedb command
    that fails (a refused config, a crash) leaves `error` in its row instead of the metrics."""
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
                run_mergedb(cfg_path, catalog, work / f"mergedb-{c.name}")
            except MergeDBFailed as e:
                row["error"] = str(e)
            row["mergedb_seconds"] = time.perf_counter() - t0
            row["mergekit_seconds"] = run_mergekit(cfg_path, work / "mergekit")  # mergekit takes the config
            if "error" not in row:
                cfg, layers = yaml.safe_load(cfg_path.read_text()), synth.SIZES[size].layers
                mk_dir, mdb_dir = work / "mergekit", work / f"mergedb-{c.name}"
                row |= compare(mk_dir, mdb_dir, fam / "base", ties_densities(cfg, layers), c.expect == "sampled")
                row |= slerp_reference_rel(cfg, layers, mk_dir, mdb_dir) or {}
                row["check"], row["passed"] = judge(row)
            rows.append(row)
    return rows


def judge(row: dict) -> tuple[str, bool | None]:
    """(the criterion this row is held to, whether it holds; None where the row is only reported)."""
    if row["expect"] == "exact" and row["out_dtypes"] == ["torch.float32"]:
        return f"rel ≤ {EXACT_REL:g}", row["rel"] <= EXACT_REL
    if row["expect"] == "exact":  # rounded to bfloat16/float16: one rounding step, see _summary
        return "≤ 1 ulp", row["max_ulp"] <= 1
    if "tie_frac" in row:
        return "0 outside ties", row["diff_outside_ties"] == 0
    if row["expect"] == "sampled":
        return "reported only (other random draws)", None
    return "reported only", None


def mergekit_version() -> str:
    r = subprocess.run(
        [str(MERGEKIT_YAML.parent / "python"), "-c", "import importlib.metadata as m; print(m.version('mergekit'))"],
        capture_output=True,
        text=True,
    )
    return r.stdout.strip() or "unknown"


def suite_doc(root: Path, size: str, dtypes: list[str], names: list[str] | None) -> dict:
    """parity.json's document: the rows of run_suite and what they were measured with."""
    if not MERGEKIT_YAML.exists():
        return {"skipped": f"no {MERGEKIT_YAML}: make it with {MAKE_VENV}", "rows": []}
    root.mkdir(parents=True, exist_ok=True)
    rows = run_suite(root, size, dtypes, names)
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
    from .parity_report import report_lines

    print("\n".join(report_lines(doc)))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
