"""The "LoRA adapters (issue 13)" section of RESULTS.md, from results/lora.json (benchmarks/bench_lora.py)."""

from __future__ import annotations


def report_lines(doc: dict | None) -> list[str]:
    """The "LoRA adapters (issue 13)" section from results/lora.json."""
    if not doc:
        return []
    md, mk, pf, outs = doc["mergedb"], doc["mergekit"], doc["peft"], doc["outputs"]
    gb, mib = 1e9, 2**20
    rk = f"execute_lora_rank{doc['rank']}"

    def row(name: str, r: dict, logical: str) -> str:
        return (
            f"| {name} | {r['wall']:.1f} | {r['cpu_seconds']:.1f} | {logical} | {r['read_bytes'] / gb:.3f} GB | "
            f"{r['written_bytes'] / gb:.3f} GB | {r['peak_rss_bytes'] / mib:.0f} MiB |"
        )

    load = ", ".join(f"{x:.1f}" for x in doc["load_before"])
    steps = [md["register_adapters"], md["execute_model"]]
    mdb_wall = sum(r["wall"] for r in steps) + md["plan_wall"]
    mdb_cpu = sum(r["cpu_seconds"] for r in steps)
    mdb_rss = max(r["peak_rss_bytes"] for r in steps)
    return [
        "## LoRA adapters (issue 13)",
        "",
        f"`python -m benchmarks.bench_lora --k {doc['k']} --rank {doc['rank']}`: {doc['k']} rank-{doc['rank']} "
        f"adapters ({doc['adapter_bytes'] / gb:.3f} GB of float32 factors) on the bench base "
        f"({doc['base_bytes'] / gb:.3f} GB, bf16), one linear merge (weights 1, normalised), each step in a "
        "process of its own from a cold page cache (the model and adapter files evicted; libraries not), side "
        f"by side in one run. Load average before the run: {load} (2 cores, shared with other jobs). Wall and "
        "CPU are the whole process's (imports included); 'read' and 'written' are the process's storage "
        "traffic (rusage); 'expert bytes' what mergedb asked for from the adapter files (registration also "
        "re-reads the base's adapted blocks per adapter, mostly from the page cache).",
        "",
        "| step | wall s | CPU s | expert bytes | read | written | peak RSS |",
        "|---|---|---|---|---|---|---|",
        row("mergedb register base", md["register_base"], f"{md['register_base']['logical_bytes'] / gb:.3f} GB"),
        row(
            f"mergedb register {doc['k']} adapters",
            md["register_adapters"],
            f"{md['register_adapters']['logical_bytes'] / gb:.3f} GB",
        ),
        row("mergedb plan", md["plan"], "0"),
        row("mergedb execute (model)", md["execute_model"], f"{md['execute_model']['expert_bytes'] / gb:.3f} GB"),
        row(
            "mergedb execute --as-lora (exact)",
            md["execute_lora_exact"],
            f"{md['execute_lora_exact']['expert_bytes'] / gb:.3f} GB",
        ),
        row(f"mergedb execute --as-lora --rank {doc['rank']}", md[rk], f"{md[rk]['expert_bytes'] / gb:.3f} GB"),
        row(
            f"mergekit-yaml, `base+adapter` ×{doc['k']}",
            mk,
            f"{mk['materialised_models']} full copies ({mk['materialised_bytes'] / gb:.2f} GB)",
        ),
        row("PEFT load + add_weighted_adapter", pf, "all factors"),
        "",
        f"- Adapters to a merged model: mergedb (register the adapters, plan, execute) {mdb_wall:.0f} s wall, "
        f"{mdb_cpu:.0f} s CPU, peak RSS {mdb_rss / mib:.0f} MiB; mergekit {mk['wall']:.0f} s wall, "
        f"{mk['cpu_seconds']:.0f} s CPU, peak RSS {mk['peak_rss_bytes'] / mib:.0f} MiB, writing "
        f"{mk['written_bytes'] / gb:.2f} GB ({mk['materialised_models']} materialised models) for a "
        f"{doc['base_bytes'] / gb:.2f} GB output. To an adapter (`--as-lora`, exact): "
        f"{md['execute_lora_exact']['wall']:.1f} s, reading {md['execute_lora_exact']['expert_bytes'] / gb:.3f} GB "
        "of factors and nothing of the base.",
        f"- The full model: mergedb's is {outs['mergedb']['max_rel_to_update']:.2e} (max over tensors of "
        "‖out − θ_F‖/‖θ_F − θ₀‖, θ_F the full-delta merge in float64) from the exact merge, mergekit's "
        f"{outs['mergekit']['max_rel_to_update']:.2e} (both written in bf16; mergekit also rounds each "
        "materialised base+adapter copy to bf16 before merging).",
        f"- `--as-lora` exact: rank {doc['k'] * doc['rank']} per module, ‖B′A′ − ΔW‖/‖ΔW‖ ≤ "
        f"{pf['rel']['mergedb_exact']['max']:.1e} over {pf['tensors']} tensors; `--rank {doc['rank']}`: relative "
        f"Frobenius error max {md[rk]['max_rel_error']:.3f}, mean {md[rk]['mean_rel_error']:.3f} (a sum of "
        f"{doc['k']} independent random adapters has no dominant directions: the cut keeps "
        f"{doc['rank']}/{doc['k'] * doc['rank']} of the rank).",
        f"- PEFT `add_weighted_adapter`, weights 1/{doc['k']}: `cat` is {pf['rel']['cat']['max']:.1e} from the "
        f"full-delta merge (max; it is the same concatenation); `linear` is **{pf['rel']['linear']['max']:.3f}** "
        f"(max) / {pf['rel']['linear']['mean']:.3f} (mean) from it: it merges the factors, "
        '(Σ√(c·s)·B)(Σ√(c·s)·A), which adds every cross term B_j·A_k (README, "LoRA adapters"). '
        f"Times: linear {pf['seconds']['linear']:.2f} s, cat {pf['seconds']['cat']:.2f} s after "
        f"{pf['load_seconds']:.1f} s loading the adapters onto the float32 base.",
        "",
    ]
