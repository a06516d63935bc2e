"""What a PEFT adapter's `adapter_config.json` says, and which of its settings mergedb can merge.

mergedb merges a plain LoRA: ΔW = s · B @ A per module (lora.py). peft 0.21's LoraConfig also
describes variants whose delta is something else (DoRA's magnitude vector, aLoRA's activation on
invocation tokens, KaSA's truncated base, ...) and initialisations that change the base the
adapter is a delta of (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA); peft itself refuses to merge some of
them (aLoRA, Arrow). Each is refused in one line that names the setting, never merged as a plain
LoRA (review, 2026-12-03: aLoRA and lora_ga adapters were). Which modules it adapts is
loratargets.py's.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from . import jsondoc, loratargets
from .errors import FormatError
from .plainfile import read_small
from .units import finite

CONFIG = "adapter_config.json"
# LoraConfig fields (peft 0.21) that make a LoRA variant, when set: what each is
VARIANTS = {
    "use_qalora": "QALoRA, for GPTQ-quantized layers",
    "alora_invocation_tokens": "aLoRA, active only after its invocation tokens; peft does not merge it",
    "velora_config": "VeLoRA",
    "use_bdlora": "BD-LoRA, block-diagonal factors",
    "monteclora_config": "MonteCLoRA",
    "arrow_config": "Arrow, routing between adapters; peft does not merge it",
    "kasa_config": "KaSA, which truncates the base weight",
    "megatron_config": "LoRA on Megatron-LM parallel layers",
}
# init_lora_weights values whose training started from a changed base
CHANGED_BASE_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


def read_config(root: Path) -> tuple[dict[str, Any], bytes]:
    """The adapter's config (its JSON object, and its bytes for the fingerprint), refused in one line
    when it asks for anything but a plain LoRA on modules."""
    path = root / CONFIG
    try:
        raw = read_small(path)
        cfg = jsondoc.parse(raw)
        if not isinstance(cfg, dict):
            raise TypeError
    except (OSError, ValueError, TypeError):
        raise FormatError(f"{path}: not a valid adapter config (expected a JSON object)") from None
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise FormatError(f"{path}: peft_type {peft_type!r} is not supported; mergedb merges LORA adapters only")
    if cfg.get("use_dora"):
        raise FormatError(f"{path}: use_dora is true; DoRA adapters are not supported (train a plain LoRA)")
    for key in VARIANTS:
        if cfg.get(key):
            raise FormatError(
                f"{path}: {key} is set: a LoRA variant ({VARIANTS[key]}) whose delta is not s·B@A, which "
                "mergedb merges; train a plain LoRA"
            )
    if cfg.get("bias", "none") != "none":
        raise FormatError(
            f"{path}: bias is {cfg['bias']!r}: the adapter trains the base's biases too (saved as "
            "'….base_layer.bias'), which mergedb does not merge; train it with bias='none'"
        )
    init = str(cfg.get("init_lora_weights", "")).lower()
    if init == "mica":
        raise FormatError(
            f"{path}: init_lora_weights is 'mica': a LoRA variant (MiCA) mergedb does not merge; train a plain LoRA"
        )
    if init.startswith(CHANGED_BASE_INITS) or cfg.get("lora_ga_config"):  # trained against a changed base
        init = cfg.get("init_lora_weights", "lora_ga")
        raise FormatError(
            f"{path}: init_lora_weights is {init!r}: the adapter is a delta of a base that "
            "initialisation changed, not of the registered one; save it again with peft's "
            "save_pretrained(..., path_initial_model_for_weight_conversion=...), which makes it a plain LoRA"
        )
    if cfg.get("target_parameters"):
        raise FormatError(
            f"{path}: target_parameters {cfg['target_parameters']!r} is not supported; "
            "only adapters on modules (target_modules) can be merged"
        )
    for flag in ("lora_bias", "layer_replication", "trainable_token_indices"):
        if cfg.get(flag):
            raise FormatError(f"{path}: {flag} is set; LoRA adapters with {flag} are not supported")
    for key in ("r", "lora_alpha"):
        v = cfg.get(key)
        if v is not None and not _positive(v, whole=key == "r"):
            raise FormatError(f"{path}: {key} is {v!r}; expected a positive {'whole ' if key == 'r' else ''}number")
    loratargets.check_config(path, cfg)
    for key in ("rank_pattern", "alpha_pattern"):  # module regex -> r or alpha (pattern_value)
        pats = cfg.get(key) or {}
        if not isinstance(pats, dict):
            raise FormatError(f"{path}: {key} is {pats!r}; expected an object of module pattern -> number")
        for pat, v in pats.items():
            try:
                re.compile(pat)
            except re.error as e:
                raise FormatError(f"{path}: {key} has the pattern {pat!r}, not a regular expression ({e})") from None
            if not _positive(v, whole=key == "rank_pattern"):
                raise FormatError(f"{path}: {key}[{pat!r}] is {v!r}; expected a positive number")
    return cfg, raw


def _positive(v: Any, whole: bool) -> bool:
    """A finite number > 0 (a whole one for a rank): NaN, inf, 4.7 as r, a str or a bool is not."""
    f = finite(v)
    return f is not None and f > 0 and (not whole or f.is_integer())
