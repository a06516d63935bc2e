"""Which modules a PEFT adapter's config adapts: peft 0.21's rule (tuners/tuners_utils.py
`check_target_module_exists`). Factors saved for a module the config does not select are refused,
not merged: peft, loading such a folder, drops them with a warning and adapts the modules the
config selects with freshly initialised factors instead, so the two tools would make different
models from one adapter.

The rule: `exclude_modules` (a regex matched whole, or names matched exactly or as a dot-bounded
suffix) and `modules_to_save` (names as dot-bounded segments) come first and exclude; then
`target_modules` — a string is a regex matched against the whole module name, a list matches a name
exactly or as a dot-bounded suffix, and a suffix match must also sit in `layers_to_transform`
(the module name's first numbered segment, or the one after `layers_pattern`). A config without
`target_modules` (peft picks its defaults per architecture) and `all-linear` (which peft expands
when it loads the model) are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .errors import FormatError

ALL_LINEAR = "all-linear"


def check_config(path: Path, cfg: dict[str, Any]) -> None:
    """Refuse the selection keys' wrong types and patterns that do not compile (one line, the key)."""
    for key in ("target_modules", "exclude_modules", "layers_pattern", "modules_to_save"):
        v = cfg.get(key)
        if v is None:
            continue
        if isinstance(v, str) and key != "modules_to_save":
            v = [v]  # a regex (target_modules, exclude_modules) or one name pattern (layers_pattern)
        if not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise FormatError(f"{path}: {key} is {cfg[key]!r}; expected a list of module names or one pattern")
        for x in v:
            try:
                re.compile(x)
            except re.error as e:
                raise FormatError(f"{path}: {key} has {x!r}, not a regular expression ({e})") from None
    layers = cfg.get("layers_to_transform")
    if layers is not None and not _index(layers) and not (isinstance(layers, list) and all(map(_index, layers))):
        raise FormatError(f"{path}: layers_to_transform is {layers!r}; expected a layer index or a list of them")
    for key in ("layers_to_transform", "layers_pattern"):  # combinations peft's LoraConfig refuses to load
        if isinstance(cfg.get("target_modules"), str) and cfg.get(key) is not None:
            raise FormatError(f"{path}: {key} is set with a target_modules regex, which peft refuses; drop one")
    if cfg.get("layers_pattern") and layers is None:
        raise FormatError(f"{path}: layers_pattern is set without layers_to_transform, which peft refuses")


def _index(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def targeted(cfg: dict[str, Any], module: str) -> bool:
    """Whether peft would adapt `module` (a name like model.layers.0.self_attn.q_proj) under `cfg`,
    which check_config accepted."""
    tm = cfg.get("target_modules")
    if tm is None or tm == ALL_LINEAR:
        return True
    ex = cfg.get("exclude_modules")
    if ex:
        if isinstance(ex, str) and re.fullmatch(ex, module):
            return False
        if not isinstance(ex, str) and (module in ex or any(module.endswith(f".{e}") for e in ex)):
            return False
    for m in cfg.get("modules_to_save") or ():
        if re.match(rf"(^|.*\.){re.escape(m)}($|\..*)", module):
            return False
    if isinstance(tm, str):
        return re.fullmatch(tm, module) is not None
    if module in tm:
        return True
    if not any(module.endswith(f".{t}") for t in tm):
        return False
    layers = cfg.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    patterns = cfg.get("layers_pattern")
    patterns = [patterns] if isinstance(patterns, str) else patterns
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
    else:
        match = next((x for x in (re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", module) for p in patterns) if x), None)
    if match is None:
        return False
    idx = int(match["idx"])
    return idx == layers if isinstance(layers, int) else idx in layers
