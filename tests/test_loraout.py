"""`execute --as-lora`: the adapter mergedb writes, loaded by peft, against merges formed in torch.

References: each adapter's ΔW_k = s·B@A formed in torch from its files (checked against peft's
merge_and_unload() minus the base), the merge base + Σ c_k ΔW_k with c_k from the textbook
formulas (linear: w/Σw, task arithmetic: λ·w), and the rank cut's error from torch.linalg.svd of
the whole merged ΔW.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

import mergedb
from mergedb import executor, loraout
from mergedb.check import check_output
from mergedb.cli import app
from mergedb.errors import ChangedFileError, MergeDBError, PlanError
from mergedb.planner import PlanRequest
from tests import lora_fixtures as lf

IDS = torch.tensor([[3, 17, 42, 5, 88, 11, 60, 2, 9, 71]])


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    """A tiny fp32 Llama base and three adapters: rank 4 on every projection; rank 2 rsLoRA with a
    rank-6 q_proj on three projections; rank 3 on the embedding and o_proj."""
    root = tmp_path_factory.mktemp("loraout")
    base = lf.make_base(root / "base")
    ads = [
        lf.make_adapter(base, root / "a", seed=1),
        lf.make_adapter(
            base,
            root / "b",
            seed=2,
            r=2,
            lora_alpha=3,
            use_rslora=True,
            rank_pattern={"q_proj": 6},
            target_modules=["q_proj", "v_proj", "down_proj"],
        ),
        lf.make_adapter(base, root / "c", seed=3, r=3, lora_alpha=5, target_modules=["embed_tokens", "o_proj"]),
    ]
    b0 = lf.base_state(base)
    deltas = [_file_deltas(ad) for ad in ads]
    for ad, d in zip(ads, deltas):  # the textbook deltas are what peft's own merge adds
        merged = lf.merged_state(base, ad)
        assert {k for k in b0 if not torch.equal(merged[k], b0[k])} == set(d)
        for k, x in d.items():
            assert float(torch.linalg.norm(merged[k].double() - b0[k].double() - x)) <= 1e-6 * float(
                torch.linalg.norm(x)
            )
    return root, base, ads, b0, deltas


def _file_deltas(path: Path) -> dict[str, torch.Tensor]:
    """ΔW = s·B@A per base tensor (transposed for an embedding) from the adapter's files, float64:
    s = lora_alpha/r, or lora_alpha/√r with use_rslora, r the factor's own rank."""
    cfg = json.loads((path / "adapter_config.json").read_text())
    t = load_file(str(path / "adapter_model.safetensors"))
    out = {}
    for key in t:
        m = re.fullmatch(r"base_model\.model\.(.+)\.lora_(embedding_)?A(\.weight)?", key)
        if m is None:
            continue
        a, b = t[key].double(), t[key.replace("lora_A", "lora_B").replace("embedding_A", "embedding_B")].double()
        r = a.shape[0]
        s = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
        d = s * (b @ a)  # (out, in); an embedding's is (dim, vocab)
        out[m.group(1) + ".weight"] = d.T if m.group(2) else d
    return out


def _catalog(fam, tmp_path, block_size="4MiB"):
    root, base, ads, _, _ = fam
    cat = mergedb.connect(tmp_path / "c.duckdb")
    cat.register([base], base=True, name="base", block_size=block_size)
    cat.register(ads, base_model="base")
    return cat


def _merged_delta(fam, coefs, rows=None) -> dict[str, torch.Tensor]:
    """Σ c_k ΔW_k per tensor (float64); `rows[(k, tensor)]` keeps only those rows of ΔW_k."""
    _, _, _, b0, deltas = fam
    out: dict[str, torch.Tensor] = {}
    for k, (c, d) in enumerate(zip(coefs, deltas)):
        for name, x in d.items():
            if rows is not None:
                keep = torch.zeros(x.shape[0], 1, dtype=torch.float64)
                for r0, r1 in rows.get((k, name), []):
                    keep[r0:r1] = 1
                x = x * keep
            out[name] = out.get(name, torch.zeros_like(x)) + c * x
    return out


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.double()


def _full_logits(fam, delta) -> torch.Tensor:
    _, base, _, b0, _ = fam
    model = lf.load_base(base)
    state = {k: (v.double() + delta[k]).float() if k in delta else v for k, v in b0.items()}
    model.load_state_dict(state)
    return _logits(model)


def _peft_logits(fam, out: Path) -> torch.Tensor:
    import peft

    return _logits(peft.PeftModel.from_pretrained(lf.load_base(fam[1]), out))


def _peft_delta(fam, out: Path) -> dict[str, torch.Tensor]:
    """What peft adds to the base when it merges our adapter (merge_and_unload − base)."""
    import peft

    _, base, _, b0, _ = fam
    merged = peft.PeftModel.from_pretrained(lf.load_base(base), out).merge_and_unload().state_dict()
    return {k: merged[k].double() - b0[k].double() for k in b0 if not torch.equal(merged[k], b0[k])}


@pytest.mark.parametrize(
    "method, weights, params, coefs",
    [
        ("linear", (1.0, 0.5, 2.0), {}, [1 / 3.5, 0.5 / 3.5, 2 / 3.5]),
        ("task_arithmetic", (1.0, -0.5, 2.0), {"lambda": 0.7}, [0.7, -0.35, 1.4]),
    ],
)
def test_exact_output_gives_the_full_merge_logits(fam, tmp_path, method, weights, params, coefs):
    cat = _catalog(fam, tmp_path)
    plan = cat.plan(PlanRequest("base", ("a", "b", "c"), method, "all", weights=weights, params=params))
    res = cat.execute(plan.plan_id, tmp_path / "out", as_lora=True)
    delta = _merged_delta(fam, coefs)
    want = _full_logits(fam, delta)
    got = _peft_logits(fam, tmp_path / "out")
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    # per tensor, what peft merges equals Σ c ΔW (float32 factors: ~1e-7 relative)
    pd = _peft_delta(fam, tmp_path / "out")
    assert set(pd) == set(delta)
    for name, d in delta.items():
        assert float(torch.linalg.norm(pd[name] - d)) <= 1e-6 * float(torch.linalg.norm(d)), name
    cfg = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    q0 = "model.layers.0.self_attn.q_proj"
    ranks = {m["module"]: m["rank"] for m in res.manifest["lora"]["modules"]}
    assert ranks[q0] == 4 + 6 and ranks["model.layers.0.mlp.up_proj"] == 4 and ranks["model.embed_tokens"] == 3
    assert ranks["model.layers.0.self_attn.o_proj"] == 4 + 3 and cfg["r"] == cfg["lora_alpha"] == 4
    with safe_open(str(tmp_path / "out" / "adapter_model.safetensors"), "pt") as f:
        assert f.get_tensor(f"base_model.model.{q0}.lora_A.weight").shape == (10, lf.HIDDEN)
        assert f.get_tensor("base_model.model.model.embed_tokens.lora_embedding_A").shape == (3, lf.VOCAB)
    # every factor byte of the three adapters is read once, nothing of the base
    size = 0
    for ad in fam[2]:
        with safe_open(str(ad / "adapter_model.safetensors"), "pt") as f:
            size += sum(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] * 4 for k in f.keys())
    assert res.expert_bytes == size and res.base_bytes == 0
    assert res.manifest["lora"]["exact"] and res.manifest["lora"]["max_rel_error"] == 0
    assert check_output(tmp_path / "out") == []
    cfg_path = tmp_path / "out" / "adapter_config.json"  # its scaling: doubled, every delta doubles
    edited = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**edited, "lora_alpha": 2 * edited["lora_alpha"]}))
    assert any("adapter_config.json: missing, or not the config" in p for p in check_output(tmp_path / "out"))


@pytest.mark.parametrize("rank", [1, 3, 5])
def test_rank_cut_error_is_the_svd_truncation_error(fam, tmp_path, rank):
    cat = _catalog(fam, tmp_path)
    plan = cat.plan(PlanRequest("base", ("a", "b", "c"), "linear", "all"))
    res = cat.execute(plan.plan_id, tmp_path / "out", as_lora=True, rank=rank)
    delta = _merged_delta(fam, [1 / 3] * 3)
    pd = _peft_delta(fam, tmp_path / "out")
    errs = {m["tensor"]: m for m in res.manifest["lora"]["modules"]}
    assert set(errs) == set(delta)
    for name, d in delta.items():
        u, s, vh = torch.linalg.svd(d, full_matrices=False)
        k = min(rank, errs[name]["rank"])
        best = (u[:, :k] * s[:k]) @ vh[:k]
        want = float(torch.linalg.norm(d - best) / torch.linalg.norm(d))
        assert errs[name]["rel_error"] == pytest.approx(want, abs=2e-6), name
        assert float(torch.linalg.norm(pd[name] - best)) <= 2e-6 * float(torch.linalg.norm(d)), name
    assert max(m["rank"] for m in errs.values()) == rank
    assert res.manifest["lora"]["max_rel_error"] == max(m["rel_error"] for m in errs.values()) > 0


def _mask_rows(cat, plan_id) -> list[dict]:
    """The plan's selected blocks: position, tensor, row range, and the tensor's number of blocks."""
    xp = cat.execution_plan(plan_id)
    cols = [xp.mask.column(c).to_pylist() for c in ("position", "tensor_idx", "block_idx")]
    return [
        {
            "position": p,
            "tensor": xp.tensors[t].name,
            "row_start": xp.tensors[t].rows[b][0],
            "row_end": xp.tensors[t].rows[b][1],
            "blocks": len(xp.tensors[t].rows),
        }
        for p, t, b in zip(*cols)
    ]


def test_budgeted_plan_zeroes_the_omitted_rows(fam, tmp_path):
    cat = _catalog(fam, tmp_path, block_size="2KiB")  # fp32 rows of 256 bytes: 8 rows a block
    for budget in ("20%", "10%", "30%", "15%", "25%"):  # one that cuts through some (expert, tensor)
        plan = cat.plan(PlanRequest("base", ("a", "b", "c"), "task_arithmetic", budget, params={"lambda": 1.0}))
        sel = _mask_rows(cat, plan.plan_id)
        nblocks = {(r["position"], r["tensor"]): r["blocks"] for r in sel}
        rows: dict = {}
        for r in sel:
            rows.setdefault((r["position"], r["tensor"]), []).append((r["row_start"], r["row_end"]))
        partial = [k for k, v in rows.items() if len(v) < nblocks[k]]
        if partial:
            break
    assert partial, "no budget cut through an adapter tensor"
    res = cat.execute(plan.plan_id, tmp_path / "out", as_lora=True)
    assert pq.read_table(tmp_path / "out" / "mask.parquet").num_rows == len(sel)
    delta = _merged_delta(fam, [1.0] * 3, rows)
    full = _merged_delta(fam, [1.0] * 3)
    pd = _peft_delta(fam, tmp_path / "out")
    assert set(pd) <= set(full) and any(float(torch.linalg.norm(delta[n] - full[n])) > 0 for n in full)
    for name, d in delta.items():
        if float(d.abs().max()) == 0:
            assert name not in pd
            continue
        assert float(torch.linalg.norm(pd[name] - d)) <= 1e-6 * float(torch.linalg.norm(d)), name
    assert res.expert_bytes <= plan.budget_bytes


def test_replay_and_force_over_an_adapter_output(fam, tmp_path):
    cat = _catalog(fam, tmp_path)
    plan = cat.plan(PlanRequest("base", ("a", "c"), "linear", "all"))
    first = cat.execute(plan.plan_id, tmp_path / "out", as_lora=True, rank=2)
    with pytest.raises(MergeDBError, match="LoRA adapter output"):
        executor.replay(tmp_path / "out" / "mergedb_manifest.json", tmp_path / "again")
    again = loraout.replay(tmp_path / "out" / "mergedb_manifest.json", tmp_path / "again")
    assert again.manifest["tensor_hashes"] == first.manifest["tensor_hashes"]
    assert (tmp_path / "again" / "adapter_model.safetensors").read_bytes() == (
        tmp_path / "out" / "adapter_model.safetensors"
    ).read_bytes()
    cat.execute(plan.plan_id, tmp_path / "out", as_lora=True, force=True)  # exact now: replaces the rank-2 one
    assert json.loads((tmp_path / "out" / "mergedb_manifest.json").read_text())["lora"]["exact"]
    assert check_output(tmp_path / "out") == []


def test_an_adapter_output_in_a_folder_of_adapters_is_not_registered_with_them(fam, tmp_path):
    """An --as-lora output written beside the adapters is a merge, not one more adapter: a folder
    registration refuses it (stray.refuse_output); by its own path it registers."""
    root, base, ads, _, _ = fam
    cat = _catalog(fam, tmp_path)
    plan = cat.plan(PlanRequest("base", ("a", "c"), "linear", "all"))
    folder = tmp_path / "adapters"
    for ad in ads:
        shutil.copytree(ad, folder / ad.name)
    cat.execute(plan.plan_id, folder / "merged", as_lora=True)
    with pytest.raises(MergeDBError, match=r"merged: a mergedb output"):
        cat.register([folder], base_model="base")
    assert [c.name for c in cat.checkpoints()] == ["base", "a", "b", "c"]


def test_refusals_name_the_problem_and_write_nothing(fam, tmp_path):
    root, base, ads, b0, _ = fam
    cat = _catalog(fam, tmp_path)
    ties = cat.plan(PlanRequest("base", ("a", "b"), "ties", "all", params={"density": 0.5}))
    with pytest.raises(PlanError, match="linear and task_arithmetic") as e:
        cat.execute(ties.plan_id, tmp_path / "out", as_lora=True)
    assert "\n" not in str(e.value)
    dense = lf.save_dense(lf.merged_state(base, ads[0]), base, tmp_path / "dense")
    cat.register([dense], base_model="base")
    mixed = cat.plan(PlanRequest("base", ("a", "dense"), "linear", "all"))
    with pytest.raises(PlanError, match="dense .* is a full checkpoint, not a LoRA adapter"):
        cat.execute(mixed.plan_id, tmp_path / "out", as_lora=True)
    mts = lf.make_adapter(base, tmp_path / "mts", seed=5, target_modules=["q_proj"], modules_to_save=["lm_head"])
    cat.register([mts], base_model="base")
    saved = cat.plan(PlanRequest("base", ("a", "mts"), "linear", "all"))
    with pytest.raises(PlanError, match="modules_to_save"):
        cat.execute(saved.plan_id, tmp_path / "out", as_lora=True)
    nothing = cat.plan(PlanRequest("base", ("a", "b"), "linear", "0"))
    with pytest.raises(PlanError, match="selects no adapter block"):
        cat.execute(nothing.plan_id, tmp_path / "out", as_lora=True)
    ok = cat.plan(PlanRequest("base", ("a",), "linear", "all"))
    for bad in (0, -1):
        with pytest.raises(PlanError, match="--rank"):
            cat.execute(ok.plan_id, tmp_path / "out", as_lora=True, rank=bad)
    with pytest.raises(PlanError, match="LoRA output only"):
        cat.execute(ok.plan_id, tmp_path / "out", rank=2)
    for opts, words in (({"verify": True}, "verify .--verify. applies to a model"), ({"threads": 2}, "threads")):
        with pytest.raises(PlanError, match=words):  # refused, not silently ignored
            cat.execute(ok.plan_id, tmp_path / "out", as_lora=True, **opts)
    # an adapter changed since registration, merged into a model or an adapter (one check since the review)
    z = lf.make_adapter(base, tmp_path / "z", seed=7, target_modules=["q_proj"])
    cat.register([z], base_model="base")
    changed = cat.plan(PlanRequest("base", ("z",), "linear", "all"))
    f = z / "adapter_model.safetensors"
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
    for as_lora in (False, True):
        with pytest.raises(ChangedFileError, match=r"z \(.*\) changed since it was registered .*--refresh"):
            cat.execute(changed.plan_id, tmp_path / "out", as_lora=as_lora)
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_cli_as_lora(fam, tmp_path):
    cat = _catalog(fam, tmp_path)
    cat.plan(PlanRequest("base", ("a", "b"), "linear", "all", name="two"))
    db = str(tmp_path / "c.duckdb")
    r = CliRunner().invoke(app, ["execute", "two", "--as-lora", str(tmp_path / "ad"), "--rank", "3", "-c", db])
    assert r.exit_code == 0, r.output
    assert "wrote adapter" in r.output and "largest relative error" in r.output
    assert (tmp_path / "ad" / "adapter_config.json").is_file()
    for args, words in (
        (["--out", str(tmp_path / "m"), "--as-lora", str(tmp_path / "x")], "one of them"),
        (["--out", str(tmp_path / "m"), "--rank", "2"], "--rank applies to a LoRA output only"),
        ([], "one of them"),
        (["--as-lora", str(tmp_path / "x"), "--verify"], "verify (--verify) applies to a model output"),
        (["--as-lora", str(tmp_path / "x"), "--threads", "-3"], "threads (--threads) applies to a model output"),
        (["--as-lora", str(tmp_path / "x"), "--max-shard-size", "1GB"], "--max-shard-size applies to a model"),
    ):
        r = CliRunner().invoke(app, ["execute", "two", *args, "-c", db])
        assert r.exit_code == 1 and words in " ".join(r.output.split()), r.output
    assert not (tmp_path / "x").exists()


def test_output_folder_refusals_name_the_as_lora_option(fam, tmp_path):
    """An --as-lora output's folder refusals name --as-lora, the option the user gave (they said --out,
    an option of model outputs); a model output's and a replay's still name --out."""
    root, base, ads, b0, _ = fam
    cat = _catalog(fam, tmp_path)
    plan = cat.plan(PlanRequest("base", ("a", "b"), "linear", "all"))
    (tmp_path / "file").write_text("x")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("x")
    for out, words in (
        (tmp_path / "file", "--as-lora .*file is a file, not a folder; choose another --as-lora$"),
        (tmp_path / "busy", "busy exists and is not empty; choose another --as-lora or pass --force"),
        (Path(ads[0]), "--as-lora .* overlaps .*, a registered checkpoint; .* choose an --as-lora outside it$"),
    ):
        with pytest.raises(MergeDBError, match=words) as e:
            cat.execute(plan.plan_id, out, as_lora=True)
        assert "--out" not in str(e.value)
    with pytest.raises(MergeDBError, match="--out .*file is a file, not a folder; choose another --out$"):
        cat.execute(plan.plan_id, tmp_path / "file")
    cat.execute(plan.plan_id, tmp_path / "ad", as_lora=True)
    with pytest.raises(MergeDBError, match="choose another --out or pass --force"):
        loraout.replay(tmp_path / "ad" / "mergedb_manifest.json", tmp_path / "busy")


def test_a_dense_plan_is_refused_before_reading(tmp_path):
    from mergedb import synth

    synth.make_family(tmp_path / "fam", experts=2, size="tiny")
    cat = mergedb.connect(tmp_path / "c.duckdb")
    cat.register([tmp_path / "fam"], base_model="base")
    plan = cat.plan(PlanRequest("base", None, "linear", "all"))
    with pytest.raises(MergeDBError, match="expert_00 .* is a full checkpoint"):
        cat.execute(plan.plan_id, tmp_path / "out", as_lora=True)
    assert not (tmp_path / "out").exists()


def test_readme_lora_example_runs(tmp_path, monkeypatch):
    import re

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    code = re.search(r"## LoRA adapters\n.*?```python\n(.*?)```", text, re.S).group(1)
    base = lf.make_base(tmp_path / "base")
    for i, name in enumerate(("math", "code")):
        lf.make_adapter(base, tmp_path / "adapters" / name, seed=10 + i)
    mergedb.connect(tmp_path / "mergedb.duckdb").register([base], base=True, name="base")
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    cfg = json.loads((tmp_path / "mix-adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == cfg["lora_alpha"] == 8
    assert json.loads((tmp_path / "mix-r2" / "adapter_config.json").read_text())["r"] == 2


def test_bf16_factors(fam, tmp_path):
    """--dtype bf16: each factor element rounded once to bfloat16 (relative error ≤ 2⁻⁹ per element),
    so the product is within a few 2⁻⁹ of the merge."""
    cat = _catalog(fam, tmp_path)
    plan = cat.plan(PlanRequest("base", ("a", "c"), "linear", "all"))
    cat.execute(plan.plan_id, tmp_path / "out", as_lora=True, dtype="bf16")
    with safe_open(str(tmp_path / "out" / "adapter_model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    delta = _merged_delta(fam, [0.5, 0.0, 0.5])
    pd = _peft_delta(fam, tmp_path / "out")
    worst = max(float(torch.linalg.norm(pd[n] - d) / torch.linalg.norm(d)) for n, d in delta.items())
    assert 2**-12 < worst < 2**-6


def _read_bytes() -> int:
    """Bytes this process fetched from storage (/proc/self/io read_bytes: page-cache hits do not count)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def test_as_lora_reads_the_factors_from_storage_and_nothing_of_the_base(fam, tmp_path):
    """Physically, from a cold page cache: `--as-lora` fetches the adapters' factor bytes (plus page
    rounding and their headers) and not one page of the base, whose file is larger than all of them."""
    root, base, ads, _, _ = fam
    cat = _catalog(fam, tmp_path)
    plan = cat.plan(PlanRequest("base", ("a", "b", "c"), "task_arithmetic", "all"))
    base_size = sum(p.stat().st_size for p in Path(base).glob("*.safetensors"))
    factor_files = [Path(ad) / "adapter_model.safetensors" for ad in ads]
    factor_size = sum(p.stat().st_size for p in factor_files)
    assert base_size > factor_size + 64 * 1024  # else reading the base could hide inside the slack below
    for attempt in range(3):
        _evict([*Path(base).glob("*.safetensors"), *factor_files])
        before = _read_bytes()
        res = cat.execute(plan.plan_id, tmp_path / f"out{attempt}", as_lora=True)
        fetched = _read_bytes() - before
        if fetched <= factor_size + 64 * 1024:
            break
    if fetched == 0 and before == 0:
        pytest.skip("this filesystem does not report /proc/self/io read_bytes")
    assert res.base_bytes == 0 and res.expert_bytes <= factor_size
    assert res.expert_bytes <= fetched <= factor_size + 64 * 1024 < base_size + res.expert_bytes, fetched


def _evict(paths: list[Path]) -> None:
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
