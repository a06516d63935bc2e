"""A real fine-tuned family for fidelity benchmarks (issue 16): a small Llama LM and 8 task experts.

Recipe (every number below is in `Recipe`, and the recipe's hash names the cache):
- Vocabulary: integers, no tokenizer. 0 PAD, 1 BOS, 2 EOS, 3 SEP, 4–13 the digits, 14–39 the letters
  a–z, 40–47 one token per task, 48–95 the words of a small probabilistic grammar.
- Model: `transformers.LlamaForCausalLM` from a `LlamaConfig` written here (size "bench": hidden 128,
  4 layers, 4 heads, MLP 384, untied LM head, 0.88M parameters; "tiny" for tests).
- Pre-training: next-token loss on all tokens of a mixture of grammar sentences (det adj* noun verb
  det noun [prep det noun]), random digit and letter strings, and repeats "x SEP x" (in-context
  copying), AdamW, linear warm-up. It never sees a task token, so the base scores ~0 on the tasks.
- Experts: for each task, all weights fine-tuned from the base with loss on the answer tokens only,
  on examples "BOS <task> a b SEP answer EOS" (a, b digits; right-padded). Tasks: a, b, a+1 mod 10,
  b−1 mod 10, max, min, a = b (answer the letter y / n), a+b mod 10. Harder tasks (copy, reverse, sort,
  add, successor of each digit, key lookup, count, length on strings of 3–8 symbols) were tried first
  and reached 1–53% exact match after 150 steps of a model this size, too weak a family to measure
  merges on; the 2-digit tasks are what the build's time (≤ 15 min on 2 cores) allows.
- Fine-tuning lr 5e-4 (300 steps, batch 32): lr 3e-3 gave ‖Δ_k‖ of 40–75% of ‖θ₀‖ and 8-way merges at
  chance for every λ; lr 1e-4 left experts weak (65% on "second"). Measured build: 391 s wall, 287
  CPU-s on the shared machine (load 6–16). Merges of this family lose the tasks even at full budget
  (benchmarks/RESULTS.md, "Fidelity on a real fine-tuned family"): the tasks share inputs and output
  position, so their task vectors interfere.
- Evaluation: a fixed, seeded set per task (`EVAL_SEED`, a generator stream of its own; with 100
  possible inputs a task's inputs also occur in training, so the score says whether a merge keeps the
  mapping the expert learned, as a task benchmark of a real fine-tune does, not generalization). Accuracy is
  exact match of the whole answer (EOS included) under teacher forcing: argmax at every answer
  position of one forward pass, no generation loop (`accuracy_per_example`).
- Storage: Hugging Face folders (config.json + model.safetensors) in bf16, the dtype real checkpoints
  ship in; `build` records each expert's accuracy in fp32 and after bf16 rounding, so a fine-tune that
  bf16 erases would show. Training runs in fp32.
- Determinism: every batch is drawn from numpy generators seeded by (seed, phase, step); torch is seeded
  per phase; the thread count is part of the recipe (float reductions depend on it). Default 1 thread:
  on the shared 2-core machine 2 threads were measured 2–14× slower per step than 1 (OpenMP spinning
  against other processes), 128-hidden model: 0.23 CPU-s a step (batch 64 × 20 tokens) at 1 thread.

`python -m benchmarks.realfamily OUT [--size bench]` builds OUT/base and OUT/expert_<task> and
OUT/recipe.json (build wall and CPU seconds, accuracies); a rebuild is skipped when the recipe's hash
matches the cache's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers

PAD, BOS, EOS, SEP = 0, 1, 2, 3
DIGIT0, LETTER0, TASK0, WORD0 = 4, 14, 40, 48
VOCAB = 96
TASKS = ("first", "second", "succ", "pred", "max", "min", "equal", "sum")
MAX_LEN = 20
EVAL_SEED = 10_000

# (hidden, layers, heads, mlp)
SIZES = {"bench": (128, 4, 4, 384), "tiny": (32, 1, 2, 64)}


@dataclasses.dataclass(frozen=True)
class Recipe:
    size: str = "bench"
    seed: int = 0
    threads: int = 1
    batch: int = 32
    pretrain_steps: int = 200
    pretrain_lr: float = 3e-3
    expert_steps: int = 300
    expert_lr: float = 5e-4
    eval_examples: int = 256
    dtype: str = "bf16"

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(dataclasses.asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def config(size: str):
    from transformers import LlamaConfig

    hidden, layers, heads, mlp = SIZES[size]
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=MAX_LEN,
        tie_word_embeddings=False,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        attn_implementation="eager",
    )


# ---- data -----------------------------------------------------------------------------------------


def _digits(xs) -> list[int]:
    return [DIGIT0 + int(d) for d in xs]


def _number(n: int) -> list[int]:
    return _digits(str(n))


def task_example(task: str, rng: np.random.Generator) -> tuple[list[int], list[int]]:
    """(input tokens, answer tokens) of one example of `task`: two digits a b in, one token out."""
    a, b = (int(v) for v in rng.integers(0, 10, 2))
    ans = {
        "first": a,
        "second": b,
        "succ": (a + 1) % 10,
        "pred": (b - 1) % 10,
        "max": max(a, b),
        "min": min(a, b),
        "sum": (a + b) % 10,
    }
    if task == "equal":
        return _digits([a, b]), [LETTER0 + (24 if a == b else 13)]  # the letters y / n
    if task not in ans:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
    return _digits([a, b]), _digits([ans[task]])


def task_batch(task: str, n: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids (n, MAX_LEN) int64, answer mask (n, MAX_LEN) bool: the answer's tokens and its EOS)."""
    ids = np.full((n, MAX_LEN), PAD, np.int64)
    mask = np.zeros((n, MAX_LEN), bool)
    t = TASK0 + TASKS.index(task)
    for i in range(n):
        inp, ans = task_example(task, rng)
        seq = [BOS, t, *inp, SEP, *ans, EOS]
        ids[i, : len(seq)] = seq
        mask[i, len(seq) - len(ans) - 1 : len(seq)] = True
    return torch.from_numpy(ids), torch.from_numpy(mask)


def eval_set(task: str, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return task_batch(task, n, np.random.default_rng([seed, EVAL_SEED, TASKS.index(task)]))


_DET, _ADJ, _NOUN, _VERB, _PREP = (
    range(WORD0 + a, WORD0 + b) for a, b in ((0, 4), (4, 14), (14, 30), (30, 44), (44, 48))
)


def pretrain_batch(n: int, rng: np.random.Generator) -> torch.Tensor:
    """(n, MAX_LEN) int64: grammar sentences (40%), digit strings (15%), letter strings (15%) and
    repeats "x SEP x" of a digit or letter string (30%: in-context copying, a skill real LMs have)."""
    ids = np.full((n, MAX_LEN), PAD, np.int64)
    for i in range(n):
        kind = rng.random()
        if kind < 0.4:
            seq = [BOS]
            seq += [int(rng.choice(_DET))] + [int(rng.choice(_ADJ)) for _ in range(int(rng.geometric(0.6)) - 1)]
            seq += [int(rng.choice(_NOUN)), int(rng.choice(_VERB)), int(rng.choice(_DET)), int(rng.choice(_NOUN))]
            if rng.random() < 0.4:
                seq += [int(rng.choice(_PREP)), int(rng.choice(_DET)), int(rng.choice(_NOUN))]
            seq = seq[: MAX_LEN - 1] + [EOS]
        elif kind < 0.7:
            first = DIGIT0 if kind < 0.55 else LETTER0
            seq = [BOS, *(first + int(v) for v in rng.integers(0, 10, int(rng.integers(3, 12)))), EOS]
        else:
            first = DIGIT0 if rng.random() < 0.5 else LETTER0
            xs = [first + int(v) for v in rng.integers(0, 10, int(rng.integers(2, 8)))]
            seq = [BOS, *xs, SEP, *xs, EOS]
        ids[i, : len(seq)] = seq
    return torch.from_numpy(ids)


# ---- evaluation -------------------------------------------------------------------------------------


@torch.no_grad()
def accuracy_per_example(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(n,) bool: every answer token is the argmax of the logits one position before it."""
    logits = model(input_ids=ids, attention_mask=(ids != PAD).long()).logits  # (n, L, V)
    pred = logits[:, :-1].argmax(-1)  # predicts ids[:, 1:]
    ok = (pred == ids[:, 1:]) | ~mask[:, 1:]
    return ok.all(dim=1)


def accuracy(model, task: str, n: int, seed: int = 0) -> float:
    ids, mask = eval_set(task, n, seed)
    return float(accuracy_per_example(model, ids, mask).float().mean())


def all_accuracies(model, n: int, seed: int = 0) -> dict[str, float]:
    model.eval()
    return {t: accuracy(model, t, n, seed) for t in TASKS}


# ---- training --------------------------------------------------------------------------------------


def _train(model, steps: int, lr: float, batches, seed: int, log=None) -> None:
    torch.manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warm = max(1, steps // 10)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (step + 1) / warm)
        ids, labels = batches(step)
        loss = model(input_ids=ids, attention_mask=(ids != PAD).long(), labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if log and (step + 1) % 50 == 0:
            log(f"  step {step + 1}: loss {float(loss.detach()):.3f}")
    model.eval()


def _save(model, out: Path, dtype: str) -> None:
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(dt).save_pretrained(tmp, safe_serialization=True)
    model.to(torch.float32)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def _rounded_accuracies(model, recipe: Recipe) -> dict[str, float]:
    """Accuracies of the model after a round trip through the stored dtype."""
    import copy

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[recipe.dtype]
    m = copy.deepcopy(model).to(dt).to(torch.float32)
    return all_accuracies(m, recipe.eval_examples, recipe.seed)


def build(out: str | Path, recipe: Recipe = Recipe(), log=None) -> dict:
    """Build (or reuse) the family under `out`; returns the recipe record (also out/recipe.json)."""
    from transformers import LlamaForCausalLM

    out = Path(out)
    record_path = out / "recipe.json"
    if record_path.exists():
        record = json.loads(record_path.read_text())
        if record.get("digest") == recipe.digest() and all((out / d).is_dir() for d in record["folders"]):
            return record
    torch.set_num_threads(recipe.threads)
    transformers.utils.logging.disable_progress_bar()
    t0, c0 = time.time(), time.process_time()
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(recipe.seed)
    base = LlamaForCausalLM(config(recipe.size))

    def pre_batches(step):
        ids = pretrain_batch(recipe.batch, np.random.default_rng([recipe.seed, 1, step]))
        return ids, ids.masked_fill(ids == PAD, -100)

    _train(base, recipe.pretrain_steps, recipe.pretrain_lr, pre_batches, recipe.seed, log)
    record: dict = {
        "digest": recipe.digest(),
        "recipe": dataclasses.asdict(recipe),
        "parameters": sum(p.numel() for p in base.parameters()),
        "base": {"accuracy": all_accuracies(base, recipe.eval_examples, recipe.seed)},
        "experts": {},
        "folders": ["base"] + [f"expert_{t}" for t in TASKS],
    }
    record["pretrain_seconds"] = time.time() - t0
    if log:
        log(f"base: {record['base']} ({record['pretrain_seconds']:.0f} s)")
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    _save(base, out / "base", recipe.dtype)
    for ti, task in enumerate(TASKS):
        te = time.time()
        model = LlamaForCausalLM(config(recipe.size))
        model.load_state_dict(base_state)

        def batches(step, task=task, ti=ti):
            ids, mask = task_batch(task, recipe.batch, np.random.default_rng([recipe.seed, 2, ti, step]))
            return ids, ids.masked_fill(~mask, -100)

        _train(model, recipe.expert_steps, recipe.expert_lr, batches, recipe.seed + 1 + ti, log)
        own = accuracy(model, task, recipe.eval_examples, recipe.seed)
        rounded = _rounded_accuracies(model, recipe)
        record["experts"][task] = {"accuracy_fp32": own, "accuracy": rounded[task], "all_tasks": rounded}
        _save(model, out / f"expert_{task}", recipe.dtype)
        if log:
            log(f"{task}: own {own:.3f} (stored {rounded[task]:.3f}) {time.time() - te:.0f} s")
    record["build_wall_s"] = time.time() - t0
    record["build_cpu_s"] = time.process_time() - c0
    tmp = record_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.rename(record_path)
    return record


def load(folder: str | Path):
    """A float32 model from a folder this module (or a merge of its family) wrote."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


if __name__ == "__main__":
    args = sys.argv[1:]
    size = args[args.index("--size") + 1] if "--size" in args else "bench"
    rec = build(args[0], Recipe(size=size), log=lambda s: print(s, flush=True))
    print(json.dumps({k: rec[k] for k in ("parameters", "build_wall_s", "build_cpu_s")}))
