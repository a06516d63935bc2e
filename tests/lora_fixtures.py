"""Real PEFT adapters on a tiny Llama-layout base, for the LoRA tests (and the --as-lora tests).

`make_base` saves a randomly initialised LlamaForCausalLM (hidden 64, 2 layers, fixed seed) as
safetensors; `make_adapter` wraps it with peft, randomises every LoRA factor (peft initialises B
to zero, which would make every delta zero) and saves the adapter folder; `merged_state` is the
independent reference: peft's own `merge_and_unload()` of base + adapter, as a state dict.
`save_dense` writes such a state dict as a full-weight expert (mergekit's route for adapters).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

HIDDEN, LAYERS, VOCAB = 64, 2, 96
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _config(dtype: torch.dtype, hidden: int = HIDDEN) -> Any:
    import transformers

    return transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        dtype=dtype,
    )


def load_base(base_dir: Path, dtype: torch.dtype = torch.float32) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype)


def make_base(path: Path, dtype: torch.dtype = torch.float32, seed: int = 0, hidden: int = HIDDEN) -> Path:
    """A tiny Llama base under `path` (model.safetensors + config.json) in `dtype` (`hidden` wide)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(_config(dtype, hidden)).to(dtype)
    with torch.no_grad():  # transformers' init leaves norms at 1: perturb them so every tensor is generic
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_adapter(base_dir: Path, path: Path, seed: int = 1, dtype: torch.dtype = torch.float32, **lora: Any) -> Path:
    """A LoRA adapter folder under `path`, every factor random (seeded); `lora` are LoraConfig
    keywords (defaults: r=4, lora_alpha=8, the attention and MLP projections)."""
    import peft

    model = load_base(base_dir, dtype)
    cfg = peft.LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": TARGETS, "init_lora_weights": False, **lora})
    pm = peft.get_peft_model(model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.copy_(
                    (0.1 * torch.randn(p.shape, generator=gen)).to(p.dtype) + (p if "modules_to_save" in name else 0)
                )
    pm.save_pretrained(path, safe_serialization=True, save_embedding_layers=False)
    return path


def merged_state(base_dir: Path, adapter_dir: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """peft's merge_and_unload() of the adapter on the base: the full model's state dict."""
    import peft

    pm = peft.PeftModel.from_pretrained(load_base(base_dir, dtype), adapter_dir)
    return {k: v.detach().clone() for k, v in pm.merge_and_unload().state_dict().items()}


def base_state(base_dir: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in load_base(base_dir, dtype).state_dict().items()}


def save_dense(state: dict[str, torch.Tensor], base_dir: Path, path: Path) -> Path:
    """A full-weight expert folder from a state dict (config copied from the base)."""
    import shutil

    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    shutil.copy(base_dir / "config.json", path / "config.json")
    return path
