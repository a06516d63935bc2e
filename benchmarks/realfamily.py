"""A real fine-tuned family for fidelity benchmarks (issue 16): a small Llama LM and 8 task experts.

Recipe (every number below is in `Recipe`, and the recipe's hash names the cache):
- Vocabulary: integers, no tokenizer, 288 tokens. 0 PAD, 1 BOS, 2 EOS, 3 SEP, 4–19 a generic alphabet
  (20–31 unused, so that every alphabet starts on a multiple of 16 rows), then per task k an input
  alphabet A_k (32 + 32k, 16 tokens) and an output alphabet B_k (the next 16): disjoint vocabularies,
  like language or domain experts that touch different token embeddings.
- Model: `transformers.LlamaForCausalLM` from a `LlamaConfig` written here (size "bench": hidden 256,
  2 layers, 4 heads, MLP 1024, untied LM head, 2.25M parameters; "quick" hidden 128 MLP 384, 0.50M;
  "tiny" for tests).
- Pre-training: next-token loss on all tokens of in-context copies "BOS x SEP x EOS", x 2–6 tokens of
  one alphabet (the generic one half the time, else any of the 16 task alphabets), 1500 steps of
  batch 32, AdamW lr 1e-3: the base learns to copy and scores 0 on the tasks. (Size "quick" was
  measured with 1200 steps at lr 3e-3, `Recipe(size="quick", pretrain_steps=1200, pretrain_lr=3e-3)`:
  copy exact match 89%; at size "bench" lr 3e-3 stalled, loss 2.5 and an expert at 5% after 600
  steps, while lr 1e-3 reached loss 1.74 and 54% copy exact match in 600 steps.)
- Experts: task k = "BOS x SEP f_k(x) EOS", x 2–6 symbols of A_k, f_k a fixed seeded bijection A_k → B_k
  applied token-wise (`mapping`); loss on the answer and its EOS; 200 steps, AdamW lr 3e-3 on the
  embedding and LM head, lr 3e-5 (`body_lr_scale` 0.01) on the shared layers; the embedding and head
  rows outside the task's own two alphabets keep their gradient at zero (`own_rows`): with Adam a
  row that only the softmax's normaliser pushes still moves a full step, so every expert would have
  rewritten every head row (and BOS/SEP/EOS), and 8 such pushes summed destroy the merge.
- Measured (one run each; experts' own accuracy / 8-way task arithmetic): the first family (0.88M
  parameters; tasks of a two-digit input sharing one output alphabet, all weights at lr 5e-4): 91% /
  1–10% at every λ. Then at size "quick", λ = 1: disjoint alphabets, all weights Adam lr 1e-3 (600
  pre-training steps): 33–56% / 0%; from here 1200 pre-training steps at lr 3e-3; shared-layer lr
  ×0.1: 86–94% / 0% (the shared EOS head row and BOS/SEP embeddings still summed 8×; an expert with
  the shared layers reset to the base kept 17–52%); own rows only, shared lr ×0.1: 86–92% / 2%;
  own rows only, lr 3e-3, shared ×0.01: 92–97% / 90% (λ 0.7: 66%, λ 0.5: 11%) — the recipe.
  99.5% of ‖Δ_k‖² is then in the expert's own 32 embedding and 32 head rows.
- Evaluation: a fixed, seeded set per task (`EVAL_SEED`, a generator stream of its own); accuracy is
  exact match of the whole answer (EOS included) under teacher forcing: argmax at every answer
  position of one forward pass, no generation loop (`accuracy_per_example`).
- Storage: Hugging Face folders (config.json + model.safetensors) in bf16, the dtype real checkpoints
  ship in; `build` records each expert's accuracy in fp32 and after bf16 rounding, so a fine-tune that
  bf16 erases would show. Training runs in fp32.
- Determinism: every batch is drawn from numpy generators seeded by (seed, phase, step); torch is seeded
  per phase; the thread count is part of the recipe (float reductions depend on it). Default 1 thread
  (on the shared 2-core machine 2 threads were measured 2–14× slower per step than 1).
- Build time: "quick" 143 s wall on the shared machine (pre-training 50 s, 10–13 s an expert); "bench":
  461 s wall, 456 CPU-s (pre-training 217 s, 29–32 s an expert; experts 100%, 8-way TA λ 0.5 99.9%);
  see benchmarks/RESULTS.md ("Fidelity on a real fine-tuned family").

Recipe "wide" (`WIDE`, layout "spread"; the harder family, benchmarks/RESULTS.md "… a harder, larger
real family"): hidden 256, 3 layers, 4 heads, MLP 1024, vocabulary 24,576 (15.73M parameters, 80% of the
bytes in the embedding and the LM head). 16-token input alphabets per task, output alphabets shared by
pairs of tasks, then a background lexicon. Pre-training 800 steps, lr 1e-3, 40% generic / 40% task
alphabets / 20% lexicon copies (base copy exact match 31%). Experts 200 steps, lr 3e-3 on the task's own
32 embedding and 32 head rows and lr × 0.03 on everything else, no row frozen (`_train`'s `fast_rows`):
experts 50–64%, 44–68% of ‖Δ_k‖² outside their own rows; 8-way TIES at full budget 23%, task arithmetic
at chance (the summed shared-layer deltas; `bench_fidelity_real --check`). Measured on the way: with the
same pre-training and everything else at × 0.1: experts 59–76%, 92–97% outside own rows, TIES 21%, TA
0%; before that, 64-token alphabets, × 0.3 and a third of pre-training on the lexicon (its own 800-step
pre-training, copy exact match 14%): the first three experts at 0–12% after 150 steps (an exploration
script, not kept).
Build: 961 s wall (pre-training 240 s, experts 67–100 s each), niced on the shared 2-core machine.

`python -m benchmarks.realfamily OUT [--size bench|quick|wide]` builds OUT/base and OUT/expert_<task> and
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
GEN0 = 4  # the generic alphabet: 16 tokens 4..19; rows 20..31 unused, so alphabets align to 16 rows
ALPHA = 16  # tokens per alphabet
TASK_ROW0 = 32  # task k: input alphabet A_k at 32 + 32k, output alphabet B_k at 32 + 32k + 16
N_TASKS = 8
VOCAB = TASK_ROW0 + 2 * ALPHA * N_TASKS  # 288
TASKS = tuple(f"map{k}" for k in range(N_TASKS))
MIN_SEQ, MAX_SEQ = 2, 6
MAX_LEN = 2 * MAX_SEQ + 4
EVAL_SEED = 10_000
MAP_SEED = 20_000

# (hidden, layers, heads, mlp)
SIZES = {
    "bench": (256, 2, 4, 1024),
    "quick": (128, 2, 4, 384),
    "tiny": (32, 1, 2, 64),
    "wide": (256, 3, 4, 1024),  # with layout "spread": vocabulary 24,576, 15.8M parameters
}


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the tasks' tokens sit in the vocabulary, and how wide the vocabulary is.

    "disjoint" (the first recipe): per task an input alphabet A_k and an output alphabet B_k of 16 tokens.
    "spread": per task an input alphabet A_k of `alpha` tokens (32 + alpha·k), output alphabets shared by
    pairs of tasks (B_j, j = k // 2, after the 8 input alphabets), then a lexicon of background tokens up
    to `vocab` that only pre-training uses (their embedding rows no expert touches; their LM-head rows
    every expert moves, through the softmax's normaliser)."""

    name: str
    alpha: int
    vocab: int

    def alphabets(self, task: str) -> tuple[int, int]:
        """(first token of the input alphabet, first token of the output alphabet) of `task`."""
        if task not in TASKS:
            raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")
        k = TASKS.index(task)
        if self.name == "disjoint":
            return TASK_ROW0 + 2 * ALPHA * k, TASK_ROW0 + 2 * ALPHA * k + ALPHA
        return TASK_ROW0 + self.alpha * k, TASK_ROW0 + self.alpha * (N_TASKS + k // 2)

    def n_alphabets(self) -> int:
        return 2 * N_TASKS if self.name == "disjoint" else N_TASKS + N_TASKS // 2

    def lexicon0(self) -> int:
        return TASK_ROW0 + self.alpha * self.n_alphabets()

    def mapping(self, task: str) -> np.ndarray:
        """Task k's fixed bijection (f_k[i]: the output symbol for input symbol i)."""
        return np.random.default_rng([MAP_SEED, TASKS.index(task)]).permutation(self.alpha)

    def own_rows(self, task: str) -> list[int]:
        """The embedding and LM-head rows of the task's own alphabets (input, then output)."""
        a0, b0 = self.alphabets(task)
        return list(range(a0, a0 + self.alpha)) + list(range(b0, b0 + self.alpha))


DISJOINT = Layout("disjoint", ALPHA, VOCAB)
SPREAD = Layout("spread", ALPHA, 24_576)
LAYOUTS = {"disjoint": DISJOINT, "spread": SPREAD}


@dataclasses.dataclass(frozen=True)
class Recipe:
    size: str = "bench"
    seed: int = 0
    threads: int = 1
    batch: int = 32
    pretrain_steps: int = 1500
    pretrain_lr: float = 1e-3
    expert_steps: int = 200
    expert_lr: float = 3e-3
    body_lr_scale: float = 0.01  # experts: the shared layers' lr is expert_lr × this; embeddings/head get expert_lr
    eval_examples: int = 256
    dtype: str = "bf16"
    # "disjoint": other tasks' rows frozen; "spread": no row frozen, every row but the task's own alphabets
    # (and every shared layer) at expert_lr × body_lr_scale; see `Layout`
    layout: str = "disjoint"

    def digest(self) -> str:
        d = dataclasses.asdict(self)
        if self.layout == "disjoint":  # the first recipe's hash (and cache) predates the field
            del d["layout"]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def tokens(self) -> Layout:
        return LAYOUTS[self.layout]


WIDE = Recipe(size="wide", layout="spread", pretrain_steps=800, expert_steps=200, expert_lr=3e-3, body_lr_scale=0.03)


def config(size: str, vocab: int = VOCAB):
    from transformers import LlamaConfig

    hidden, layers, heads, mlp = SIZES[size]
    return LlamaConfig(
        vocab_size=vocab,
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


def alphabets(task: str, layout: Layout = DISJOINT) -> tuple[int, int]:
    """(first token of the input alphabet A_k, first token of the output alphabet B_k) of `task`."""
    return layout.alphabets(task)


def mapping(task: str, layout: Layout = DISJOINT) -> np.ndarray:
    """Task k's fixed bijection f_k of the alphabet's symbols (f_k[i]: the output symbol for input symbol i)."""
    return layout.mapping(task)


def own_rows(task: str, layout: Layout = DISJOINT) -> list[int]:
    """The embedding and LM-head rows expert `task` fine-tunes at the full rate: its two alphabets."""
    return layout.own_rows(task)


def task_example(task: str, rng: np.random.Generator, layout: Layout = DISJOINT) -> tuple[list[int], list[int]]:
    """(input tokens, answer tokens): 2–6 symbols of A_k in, the same symbols mapped by f_k into B_k out."""
    a0, b0 = layout.alphabets(task)
    xs = rng.integers(0, layout.alpha, int(rng.integers(MIN_SEQ, MAX_SEQ + 1)))
    f = layout.mapping(task)
    return [a0 + int(x) for x in xs], [b0 + int(f[x]) for x in xs]


def task_batch(
    task: str, n: int, rng: np.random.Generator, layout: Layout = DISJOINT
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids (n, MAX_LEN) int64, answer mask (n, MAX_LEN) bool: the answer's tokens and its EOS)."""
    ids = np.full((n, MAX_LEN), PAD, np.int64)
    mask = np.zeros((n, MAX_LEN), bool)
    for i in range(n):
        inp, ans = task_example(task, rng, layout)
        seq = [BOS, *inp, SEP, *ans, EOS]
        ids[i, : len(seq)] = seq
        mask[i, len(seq) - len(ans) - 1 : len(seq)] = True
    return torch.from_numpy(ids), torch.from_numpy(mask)


def eval_set(task: str, n: int, seed: int = 0, layout: Layout = DISJOINT) -> tuple[torch.Tensor, torch.Tensor]:
    return task_batch(task, n, np.random.default_rng([seed, EVAL_SEED, TASKS.index(task)]), layout)


def pretrain_batch(n: int, rng: np.random.Generator, layout: Layout = DISJOINT) -> torch.Tensor:
    """(n, MAX_LEN) int64: in-context copies "BOS x SEP x EOS" of 2–6 tokens drawn from one alphabet (the
    generic one half the time, else any of the task alphabets): the base learns to copy every token
    and never sees a mapping, so it scores 0 on the tasks. Layout "spread": 40% generic, 40% one
    task alphabet, a fifth the background lexicon (uniform)."""
    ids = np.full((n, MAX_LEN), PAD, np.int64)
    for i in range(n):
        length = None
        if layout.name == "disjoint":
            a = rng.integers(0, 2 * N_TASKS) if rng.random() < 0.5 else -1
            first, width = (GEN0 if a < 0 else TASK_ROW0 + ALPHA * int(a)), ALPHA
        else:
            u = rng.random()
            if u < 0.4:
                first, width = GEN0, ALPHA
            elif u < 0.8:
                first, width = TASK_ROW0 + layout.alpha * int(rng.integers(0, layout.n_alphabets())), layout.alpha
            else:
                first, width = layout.lexicon0(), layout.vocab - layout.lexicon0()
        length = int(rng.integers(MIN_SEQ, MAX_SEQ + 1)) if layout.name != "disjoint" else None
        if length is None:
            xs = [first + int(v) for v in rng.integers(0, width, int(rng.integers(MIN_SEQ, MAX_SEQ + 1)))]
        else:
            xs = [first + int(v) for v in rng.integers(0, width, length)]
        seq = [BOS, *xs, SEP, *xs, EOS]
        ids[i, : len(seq)] = seq
    return torch.from_numpy(ids)


# ---- evaluation -------------------------------------------------------------------------------------


@torch.no_grad()
def accuracy_per_example(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(n,) bool: every answer token is the argmax of the logits one position before it. A transformers
    causal LM computes the LM head only at the answer positions (the same numbers, a fraction of the
    work at a 24k vocabulary)."""
    target = mask[:, 1:]  # (n, L-1): positions whose next token is scored
    if hasattr(model, "lm_head") and hasattr(model, "model"):
        hidden = model.model(input_ids=ids, attention_mask=(ids != PAD).long()).last_hidden_state  # (n, L, H)
        pred = model.lm_head(hidden[:, :-1][target]).argmax(-1)  # (answer tokens,)
        wrong = pred != ids[:, 1:][target]
        rows = target.nonzero()[:, 0]
        bad = torch.zeros(ids.shape[0], dtype=torch.bool)
        bad[rows[wrong]] = True
        return ~bad
    logits = model(input_ids=ids, attention_mask=(ids != PAD).long()).logits  # (n, L, V)
    pred = logits[:, :-1].argmax(-1)  # predicts ids[:, 1:]
    ok = (pred == ids[:, 1:]) | ~target
    return ok.all(dim=1)


def accuracy(model, task: str, n: int, seed: int = 0, layout: Layout = DISJOINT) -> float:
    ids, mask = eval_set(task, n, seed, layout)
    return float(accuracy_per_example(model, ids, mask).float().mean())


def all_accuracies(model, n: int, seed: int = 0, layout: Layout = DISJOINT) -> dict[str, float]:
    model.eval()
    return {t: accuracy(model, t, n, seed, layout) for t in TASKS}


# ---- training --------------------------------------------------------------------------------------


def _loss(model, ids: torch.Tensor, labels: torch.Tensor, sparse: bool) -> torch.Tensor:
    """Next-token cross-entropy over the labelled positions; `sparse` applies the LM head only there (the
    same loss as transformers' `labels=`, without a (batch, length, vocab) logits tensor)."""
    if not sparse:
        return model(input_ids=ids, attention_mask=(ids != PAD).long(), labels=labels).loss
    hidden = model.model(input_ids=ids, attention_mask=(ids != PAD).long()).last_hidden_state  # (n, L, H)
    keep = labels[:, 1:] != -100  # (n, L-1)
    logits = model.lm_head(hidden[:, :-1][keep])  # (labelled tokens, V)
    return torch.nn.functional.cross_entropy(logits, labels[:, 1:][keep])


def _train(model, steps, lr, batches, seed, log=None, body_scale: float = 1.0, head_rows=None, fast_rows=None) -> None:
    """AdamW without weight decay. `head_rows`: the only embedding/head rows that move (the others' gradient
    is zeroed); `fast_rows`: every weight moves at lr × body_scale except these embedding/head rows, at lr
    (an AdamW step without weight decay is linear in lr, so their step is rescaled by 1 / body_scale)."""
    torch.manual_seed(seed)
    model.train()
    vocab = [p for n, p in model.named_parameters() if "embed_tokens" in n or "lm_head" in n]
    body = [p for n, p in model.named_parameters() if not ("embed_tokens" in n or "lm_head" in n)]
    vocab_scale = 1.0 if fast_rows is None else body_scale
    groups = [{"params": vocab, "scale": vocab_scale}, {"params": body, "scale": body_scale}]
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    warm = max(1, steps // 10)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * g["scale"] * min(1.0, (step + 1) / warm)
        ids, labels = batches(step)
        loss = _loss(model, ids, labels, sparse=fast_rows is not None)
        loss.backward()
        if head_rows is not None:  # rows of other alphabets keep their weights (see the recipe)
            keep = torch.ones(model.lm_head.weight.shape[0], dtype=torch.bool)
            keep[head_rows] = False
            model.lm_head.weight.grad[keep] = 0
            model.model.embed_tokens.weight.grad[keep] = 0
        before = [w.data[fast_rows].clone() for w in vocab] if fast_rows is not None else []
        opt.step()
        with torch.no_grad():
            for w, old in zip(vocab, before):  # (rows, hidden): the own rows' step at the full lr
                w[fast_rows] = old + (w[fast_rows] - old) / body_scale
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


def _rounded(model, recipe: Recipe):
    """A copy of the model after a round trip through the stored dtype."""
    import copy

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[recipe.dtype]
    return copy.deepcopy(model).to(dt).to(torch.float32)


def spread(model, base_state: dict, task: str, layout: Layout) -> dict:
    """Where expert `task`'s change sits: shares of ‖Δ‖² in its own embedding/head rows, the other
    embedding/head rows and the shared layers."""
    own = torch.zeros(layout.vocab, dtype=torch.bool)
    own[layout.own_rows(task)] = True
    parts = {"own_rows": 0.0, "other_rows": 0.0, "shared_layers": 0.0}
    for name, w in model.state_dict().items():
        d = (w.double() - base_state[name].double()).square()
        if "embed_tokens" in name or "lm_head" in name:
            parts["own_rows"] += float(d[own].sum())
            parts["other_rows"] += float(d[~own].sum())
        else:
            parts["shared_layers"] += float(d.sum())
    total = sum(parts.values()) or 1.0
    return {k: v / total for k, v in parts.items()}


def _own_rows_only(model, base_state: dict, task: str, layout: Layout):
    """The base with only the expert's own embedding/head rows: how much of the skill sits there."""
    import copy

    m = copy.deepcopy(model)
    state = {k: v.clone() for k, v in base_state.items()}
    rows = layout.own_rows(task)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name][rows] = model.state_dict()[name][rows]
    m.load_state_dict(state)
    return m


def build(out: str | Path, recipe: Recipe = Recipe(), log=None) -> dict:
    """Build (or reuse) the family under `out`; returns the recipe record (also out/recipe.json)."""
    from transformers import LlamaForCausalLM

    out = Path(out)
    record_path = out / "recipe.json"
    if record_path.exists():
        record = json.loads(record_path.read_text())
        if record.get("digest") == recipe.digest() and all((out / d).is_dir() for d in record["folders"]):
            return record
    layout = recipe.tokens()
    sparse = layout.name != "disjoint"
    torch.set_num_threads(recipe.threads)
    transformers.utils.logging.disable_progress_bar()
    t0, c0 = time.time(), time.process_time()
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(recipe.seed)
    base = LlamaForCausalLM(config(recipe.size, layout.vocab))

    def pre_batches(step):
        ids = pretrain_batch(recipe.batch, np.random.default_rng([recipe.seed, 1, step]), layout)
        return ids, ids.masked_fill(ids == PAD, -100)

    # layout "spread" keeps the pre-trained weights (fp32) under a hash of the pre-training fields, so a
    # change of the expert phase reuses them; the record keeps the seconds the pre-training took
    pre_key = {k: getattr(recipe, k) for k in ("size", "layout", "seed", "threads", "batch", "pretrain_steps")}
    pre_key["pretrain_lr"] = recipe.pretrain_lr
    pre_path = out / f"pretrained-{hashlib.sha256(json.dumps(pre_key, sort_keys=True).encode()).hexdigest()[:16]}.pt"
    pretrain_seconds = None
    if sparse and pre_path.exists():
        saved = torch.load(pre_path)
        base.load_state_dict(saved["state"])
        pretrain_seconds = saved["seconds"]
    else:
        _train(
            base,
            recipe.pretrain_steps,
            recipe.pretrain_lr,
            pre_batches,
            recipe.seed,
            log,
            fast_rows=[] if sparse else None,
        )
        if sparse:
            torch.save({"state": base.state_dict(), "seconds": time.time() - t0}, pre_path)
    n = recipe.eval_examples
    record: dict = {
        "digest": recipe.digest(),
        "recipe": dataclasses.asdict(recipe),
        "parameters": sum(p.numel() for p in base.parameters()),
        "base": {"accuracy": all_accuracies(base, n, recipe.seed, layout)},
        "experts": {},
        "folders": ["base"] + [f"expert_{t}" for t in TASKS],
    }
    if sparse:
        ids = pretrain_batch(n, np.random.default_rng([recipe.seed, EVAL_SEED, 99]), layout)
        copy_mask = torch.zeros_like(ids, dtype=torch.bool)
        for i, row in enumerate(ids.tolist()):
            copy_mask[i, row.index(SEP) + 1 : row.index(EOS) + 1] = True
        record["base"]["copy_accuracy"] = float(accuracy_per_example(base, ids, copy_mask).float().mean())
    record["pretrain_seconds"] = time.time() - t0
    if pretrain_seconds is not None:  # reused: this build's seconds, plus the pre-training's when it ran
        record["pretrain_reused"] = True
        record["pretrain_seconds"] = pretrain_seconds
        t0 -= pretrain_seconds
    if log:
        log(f"base: {record['base']} ({record['pretrain_seconds']:.0f} s)")
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    _save(base, out / "base", recipe.dtype)
    stored_base = {k: v.clone() for k, v in _rounded(base, recipe).state_dict().items()}
    for ti, task in enumerate(TASKS):
        te = time.time()
        model = LlamaForCausalLM(config(recipe.size, layout.vocab))
        model.load_state_dict(base_state)

        def batches(step, task=task, ti=ti):
            ids, mask = task_batch(task, recipe.batch, np.random.default_rng([recipe.seed, 2, ti, step]), layout)
            return ids, ids.masked_fill(~mask, -100)

        rows = own_rows(task, layout)
        _train(
            model,
            recipe.expert_steps,
            recipe.expert_lr,
            batches,
            recipe.seed + 1 + ti,
            log,
            recipe.body_lr_scale,
            head_rows=None if sparse else rows,
            fast_rows=rows if sparse else None,
        )
        own = accuracy(model, task, n, recipe.seed, layout)
        stored = _rounded(model, recipe)
        rounded = all_accuracies(stored, n, recipe.seed, layout)
        record["experts"][task] = {"accuracy_fp32": own, "accuracy": rounded[task], "all_tasks": rounded}
        if sparse:
            rec = record["experts"][task]
            rec["delta_share"] = spread(stored, stored_base, task, layout)
            rec["own_rows_only_accuracy"] = accuracy(
                _own_rows_only(stored, stored_base, task, layout), task, n, recipe.seed, layout
            )
        _save(model, out / f"expert_{task}", recipe.dtype)
        if log:
            log(
                f"{task}: own {own:.3f} (stored {rounded[task]:.3f}) {time.time() - te:.0f} s {record['experts'][task]}"
            )
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


RECIPES = {
    "bench": Recipe(),
    "quick": Recipe(size="quick", pretrain_steps=1200, pretrain_lr=3e-3),
    "wide": WIDE,
    "wide01": dataclasses.replace(WIDE, body_lr_scale=0.1),  # the first try: more spread, TA at chance
}


if __name__ == "__main__":
    args = sys.argv[1:]
    size = args[args.index("--size") + 1] if "--size" in args else "bench"
    rec = build(args[0], RECIPES.get(size, Recipe(size=size)), log=lambda s: print(s, flush=True))
    print(json.dumps({k: rec[k] for k in ("parameters", "build_wall_s", "build_cpu_s")}))
