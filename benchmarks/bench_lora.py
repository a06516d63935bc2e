"""Eight rank-16 LoRA adapters on the bench base: mergedb against mergekit's route and PEFT's.

The adapters (benchmarks/cache/lora-bench-8x16, made once, seeded) are PEFT adapter folders on
the bench family's base (benchmarks/cache/family-bench-20/base, Llama layout, bf16): every
attention and MLP projection of every layer, r = 16, lora_alpha = 32, float32 factors, A of
standard deviation 1/√in and B of 0.02 (trained-adapter magnitudes; peft's own init would leave
B = 0). One linear merge, weights 1 (normalised: c = 1/8), is run four ways, side by side, each
from a cold page cache in a process of its own (wall time, CPU, bytes read from storage via
/proc read_bytes or the child's rusage, peak RSS):

- mergedb: register the base and the adapters into a new catalog, plan, execute into a full
  model, and execute --as-lora (exact, and --rank 16);
- mergekit 0.1.5 (benchmarks/cache/mergekit-venv): `model: BASE+ADAPTER` for each adapter, which
  materialises base + adapter as a full model per adapter in --lora-merge-cache (peft's
  merge_and_unload) before merging them;
- PEFT 0.21 `add_weighted_adapter` with combination_type "linear" and "cat" (weights 1/8), in
  float32: how far each is from the full-delta merge Σ c·s·B@A (float64), per tensor.

Outputs are compared: mergedb's model and mergekit's against the full-delta merge in float64
(both bf16, so within rounding), mergedb's exact adapter against the full delta.

Run: python -m benchmarks.bench_lora [--k 8] [--rank 16] [--quick]
(--quick: a tiny synthetic Llama base and 3 adapters of rank 4, made for the run.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mergedb.tensorfile import SafetensorsWriter, read_header

from .common import CACHE, evict, save

CLI = [sys.executable, "-m", "mergedb.cli"]
MERGEKIT_YAML = Path(os.environ.get("MERGEKIT_YAML", CACHE / "mergekit-venv" / "bin" / "mergekit-yaml"))
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PREFIX = "base_model.model."


# -- the adapters ---------------------------------------------------------------------------------


def make_adapters(base: Path, root: Path, k: int, rank: int, seed: int = 0) -> list[Path]:
    """k PEFT adapter folders under `root` (kept when complete): factors written directly in peft's
    layout (lora_A (r, in), lora_B (out, r), float32)."""
    paths = [root / f"adapter_{i:02d}" for i in range(k)]
    if all((p / "adapter_model.safetensors").exists() for p in paths):
        return paths
    shutil.rmtree(root, ignore_errors=True)
    header = read_header(base / "model.safetensors")
    mods = [(t.name.removesuffix(".weight"), t.shape) for t in header.tensors if t.name.split(".")[-2] in TARGETS]
    rng = np.random.default_rng(seed)
    for p in paths:
        p.mkdir(parents=True)
        entries, arrays = [], []
        for mod, (out, inn) in mods:
            a = (rng.standard_normal((rank, inn)) / np.sqrt(inn)).astype(np.float32)  # (r, in)
            b = (0.02 * rng.standard_normal((out, rank))).astype(np.float32)  # (out, r)
            for kind, x in (("lora_A", a), ("lora_B", b)):
                entries.append((f"{PREFIX}{mod}.{kind}.weight", "F32", x.shape))
                arrays.append(x)
        with SafetensorsWriter(p / "adapter_model.safetensors", entries, {"format": "pt"}) as w:
            for (name, _, _), x in zip(entries, arrays):
                w.write(name, x)
        cfg = {
            "peft_type": "LORA",
            "base_model_name_or_path": str(base),
            "r": rank,
            "lora_alpha": 2 * rank,
            "target_modules": list(TARGETS),
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": False,
            "task_type": "CAUSAL_LM",
        }
        (p / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return paths


# -- measuring child processes --------------------------------------------------------------------


def _measured(cmd: list[str]) -> dict:
    """Run `cmd` to completion: its wall time, and the CPU, peak RSS (ru_maxrss) and storage reads
    and writes (ru_inblock / ru_oublock, 512-byte units) of that process alone (reaped with os.wait4),
    and its output."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = p.stdout.read().decode(errors="replace") if p.stdout else ""
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({p.returncode}): {out[-2000:]}")
    return {
        "wall": wall,
        "cpu_seconds": ru.ru_utime + ru.ru_stime,
        "peak_rss_bytes": ru.ru_maxrss * 1024,
        "read_bytes": ru.ru_inblock * 512,
        "written_bytes": ru.ru_oublock * 512,
        "stdout": out,
    }


def _with_json(run: dict) -> dict:
    """`run` without its output, merged with the JSON object on the output's last line."""
    out = run.pop("stdout")
    return {**run, **json.loads(out.strip().splitlines()[-1])}


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -- the arms -------------------------------------------------------------------------------------

_REGISTER = """
import json, sys, time
from mergedb.catalog import Catalog
from mergedb.executor import peak_rss, physical_read_bytes
t0, r0 = time.perf_counter(), physical_read_bytes()
cat = Catalog(sys.argv[1])
if sys.argv[2] == "base":
    res = cat.register([sys.argv[3]], base=True, name="base")
else:
    res = cat.register(sys.argv[3:], base_model="base")
print(json.dumps({"seconds": time.perf_counter() - t0, "logical_bytes": res.bytes_read,
                  "physical_bytes": physical_read_bytes() - r0, "vm_hwm_bytes": peak_rss()}))
"""


def mergedb_arm(base: Path, adapters: list[Path], work: Path, rank: int) -> dict:
    db = work / "lora.duckdb"
    doc: dict = {}
    evict(list(base.rglob("*.safetensors")))
    r = _measured([sys.executable, "-c", _REGISTER, str(db), "base", str(base)])
    doc["register_base"] = _with_json(r)
    files = [p / "adapter_model.safetensors" for p in adapters]
    evict(files)
    r = _measured([sys.executable, "-c", _REGISTER, str(db), "experts", *map(str, adapters)])
    doc["register_adapters"] = _with_json(r)
    names = ",".join(p.name for p in adapters)
    r = _measured(CLI + ["plan", "--base", "base", "--experts", names, "-m", "linear", "--name", "lora", "-c", str(db)])
    r.pop("stdout")
    doc["plan"] = r  # a process of its own: wall, CPU, storage reads, peak RSS (it reads no weights)
    doc["plan_wall"] = r["wall"]
    for arm, extra in (
        ("execute_model", ["--out", str(work / "model")]),
        ("execute_lora_exact", ["--as-lora", str(work / "lora-exact")]),
        (f"execute_lora_rank{rank}", ["--as-lora", str(work / f"lora-r{rank}"), "--rank", str(rank)]),
    ):
        evict([*files, *base.rglob("*.safetensors")])
        r = _measured(CLI + ["execute", "lora", *extra, "-c", str(db), "-q"])
        r.pop("stdout")
        out = Path(extra[1])
        m = json.loads((out / "mergedb_manifest.json").read_text())
        run = m["run"]
        doc[arm] = {
            **r,
            "seconds": run["seconds"],
            "expert_bytes": run["expert_bytes_logical"],
            "physical_bytes": run["physical_read_bytes"],
            "base_bytes": run["base_bytes"],
            "bytes_written": run["bytes_written"],
            "vm_hwm_bytes": run["peak_rss_bytes"],
        }
        if "lora" in m:
            errs = [x["rel_error"] or 0.0 for x in m["lora"]["modules"]]
            doc[arm].update(modules=len(errs), max_rel_error=max(errs), mean_rel_error=float(np.mean(errs)))
    return doc


def mergekit_arm(base: Path, adapters: list[Path], work: Path) -> dict:
    """mergekit-yaml on `base+adapter` models: each adapter is first merged into a full copy of the base."""
    cfg = work / "mergekit.yml"
    lines = ["merge_method: linear", "dtype: float32", "out_dtype: bfloat16", "models:"]
    for p in adapters:
        lines += [f"  - model: {base}+{p}", "    parameters:", "      weight: 1.0"]
    cfg.write_text("\n".join(lines) + "\n")
    cache = work / "mergekit-lora-cache"
    evict([*base.rglob("*.safetensors"), *(p / "adapter_model.safetensors" for p in adapters)])
    r = _measured(
        [
            str(MERGEKIT_YAML),
            str(cfg),
            str(work / "mergekit-out"),
            "--lora-merge-cache",
            str(cache),
            "--lazy-unpickle",
            "--quiet",
        ]
    )
    r.pop("stdout")
    return {**r, "materialised_bytes": _du(cache), "materialised_models": len(list(cache.iterdir()))}


_PEFT = r"""
import json, sys, time
import numpy as np, torch, peft, transformers
from mergedb.executor import peak_rss
base, out_exact, names = sys.argv[1], sys.argv[2], sys.argv[3:]
model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
t0 = time.perf_counter()
pm = peft.PeftModel.from_pretrained(model, names[0], adapter_name="a0")
for i, p in enumerate(names[1:], 1):
    pm.load_adapter(p, adapter_name=f"a{i}")
load_s = time.perf_counter() - t0
k = len(names)
ids = [f"a{i}" for i in range(k)]
times = {}
for kind in ("linear", "cat"):
    t0 = time.perf_counter()
    pm.add_weighted_adapter(ids, [1.0 / k] * k, f"m_{kind}", combination_type=kind)
    times[kind] = time.perf_counter() - t0
from safetensors.numpy import load_file
ours = load_file(out_exact + "/adapter_model.safetensors")
rel = {"linear": [], "cat": [], "mergedb_exact": []}
for name, mod in pm.base_model.model.named_modules():
    if not hasattr(mod, "lora_A") or "a0" not in mod.lora_A:
        continue
    full = sum(
        (1.0 / k) * mod.scaling[a] * mod.lora_B[a].weight.double() @ mod.lora_A[a].weight.double() for a in ids
    )
    nf = float(torch.linalg.norm(full))
    for kind in ("linear", "cat"):
        d = mod.get_delta_weight(f"m_{kind}").double()
        rel[kind].append(float(torch.linalg.norm(d - full)) / nf)
    a = torch.from_numpy(ours[f"base_model.model.{name}.lora_A.weight"]).double()
    b = torch.from_numpy(ours[f"base_model.model.{name}.lora_B.weight"]).double()
    rel["mergedb_exact"].append(float(torch.linalg.norm(b @ a - full)) / nf)
print(json.dumps({"load_seconds": load_s, "seconds": times, "tensors": len(rel["cat"]),
    "rel": {kk: {"max": max(v), "mean": sum(v) / len(v)} for kk, v in rel.items()}, "vm_hwm_bytes": peak_rss()}))
"""


def peft_arm(base: Path, adapters: list[Path], exact: Path) -> dict:
    evict([*base.rglob("*.safetensors"), *(p / "adapter_model.safetensors" for p in adapters)])
    r = _measured([sys.executable, "-c", _PEFT, str(base), str(exact), *map(str, adapters)])
    return _with_json(r)


_COMPARE = r"""
import json, sys
import torch
base, model, mk, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
from safetensors.torch import load_file as tload
b0 = {k: v.double() for k, v in tload(base + "/model.safetensors").items()}
full = {k: v.clone() for k, v in b0.items()}
k = len(names)
for p in names:
    cfg = json.load(open(p + "/adapter_config.json"))
    s = cfg["lora_alpha"] / cfg["r"]
    t = tload(p + "/adapter_model.safetensors")
    for key in t:
        if key.endswith("lora_A.weight"):
            mod = key[len("base_model.model."):-len(".lora_A.weight")]
            full[mod + ".weight"] += (1.0 / k) * s * t[key.replace("lora_A", "lora_B")].double() @ t[key].double()
def load_dir(d):
    out = {}
    import glob
    for f in sorted(glob.glob(d + "/*.safetensors")):
        out.update({kk: v.double() for kk, v in tload(f).items()})
    return out
res = {}
for arm, d in (("mergedb", model), ("mergekit", mk)):
    got = load_dir(d)
    rels = [float(torch.linalg.norm(got[n] - full[n]) / torch.linalg.norm(full[n] - b0[n])) for n in full
            if not torch.equal(full[n], b0[n])]
    res[arm] = {"max_rel_to_update": max(rels), "mean_rel_to_update": sum(rels) / len(rels), "tensors": len(rels)}
print(json.dumps(res))
"""


def compare_outputs(base: Path, model: Path, mk: Path, adapters: list[Path]) -> dict:
    """‖out − θ_F‖ / ‖θ_F − θ0‖ per adapted tensor, θ_F = θ0 + Σ c·s·B@A in float64 (both outputs are bf16)."""
    cmd = [sys.executable, "-c", _COMPARE, str(base), str(model), str(mk), *map(str, adapters)]
    r = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(r.stdout.strip().splitlines()[-1])


def run(k: int, rank: int, quick: bool, work: Path) -> dict:
    if quick:
        from mergedb import synth

        base = synth.make_family(work / "fam", experts=1, size="tiny") / "base"
        adapters = make_adapters(base, work / "adapters", k, rank)
    else:
        base = CACHE / "family-bench-20" / "base"
        if not (base / "model.safetensors").exists():
            raise SystemExit(f"no {base}: run `python -m benchmarks.run` first")
        adapters = make_adapters(base, CACHE / f"lora-bench-{k}x{rank}", k, rank)
    doc: dict = {
        "k": k,
        "rank": rank,
        "base": str(base),
        "base_bytes": _du(base),
        "adapter_bytes": sum(_du(p) for p in adapters),
        "load_before": os.getloadavg(),
    }
    # warm the libraries' files (torch, transformers, peft, numba's cache) so the cold-cache arms
    # measure reading the model and adapters, not imports
    subprocess.run([sys.executable, "-c", "import torch, transformers, peft, mergedb.cli"], check=True)
    subprocess.run([str(MERGEKIT_YAML.parent / "python"), "-c", "import mergekit.merge, peft"], check=True)
    doc["mergedb"] = mergedb_arm(base, adapters, work, rank)
    doc["mergekit"] = mergekit_arm(base, adapters, work)
    doc["peft"] = peft_arm(base, adapters, work / "lora-exact")
    doc["outputs"] = compare_outputs(base, work / "model", work / "mergekit-out", adapters)
    doc["load_after"] = os.getloadavg()
    return doc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="a tiny base and 3 adapters of rank 4, made for the run")
    a = ap.parse_args()
    k, rank = (3, 4) if a.quick else (a.k, a.rank)
    with tempfile.TemporaryDirectory(prefix="mergedb-bench-lora-") as work:
        doc = run(k, rank, a.quick, Path(work))
    print(json.dumps(doc, indent=1, default=str))
    print(save("lora" + ("-quick" if a.quick else ""), doc))


if __name__ == "__main__":
    main()
