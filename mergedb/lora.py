"""PEFT LoRA adapter folders: find the factors of each base tensor, without reading a weight.

An adapter folder holds `adapter_config.json` and `adapter_model.safetensors` (or shards listed
in `adapter_model.safetensors.index.json`). Its keys are the base model's module names under the
prefix `base_model.model.`, with (checked against peft 0.21's saved files, tests/test_lora.py):

- `<module>.lora_A.weight` (r, in) and `<module>.lora_B.weight` (out, r) for a Linear layer of
  weight (out, in): ΔW = s · B @ A. With `fan_in_fan_out` (GPT-2's Conv1D, weight (in, out)) the
  factors keep the Linear layout and peft transposes the product: ΔW = s · (B @ A)ᵀ.
- `<module>.lora_embedding_A` (r, num_embeddings) and `<module>.lora_embedding_B` (dim, r) for an
  Embedding of weight (num_embeddings, dim): ΔW = s · (B @ A)ᵀ (peft's Embedding.get_delta_weight
  transposes unconditionally; `fan_in_fan_out` does not apply to embeddings).
- `<module>.weight` (and `.bias`) of a `modules_to_save` module: the trained module's full
  weight, a dense replacement of the base tensor of that name.

A key may carry the adapter's name (`.lora_A.default.weight`); it is dropped. s = lora_alpha / r,
or lora_alpha / sqrt(r) with `use_rslora`; `rank_pattern` / `alpha_pattern` override r and
lora_alpha per module (see `pattern_value` for the matching rule).

In the base tensor's orientation every factor pair reads ΔW = s · L @ R with L (rows, r) and
R (r, cols): L = B, R = A for a Linear; L = Aᵀ, R = Bᵀ when transposed. A block of rows of ΔW
needs those rows of L plus all of R (`LoraFactor.rows_factor` / `fixed_factor`).
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import jsondoc, loraconfig, loratargets
from .checkpoint import Checkpoint, FileInfo, file_info, fingerprint, is_checkpoint
from .errors import AlignmentError, FormatError
from .plainfile import leads_inside, link_roots, read_small
from .remote import is_url
from .stray import refuse_output, refuse_stray_weights
from .tensorfile import FLOAT_DTYPES, TensorInfo

CONFIG = loraconfig.CONFIG
SINGLE = "adapter_model.safetensors"
INDEX = "adapter_model.safetensors.index.json"
PREFIX = "base_model.model."
# the suffixes of a factor key, with or without an adapter-name segment (".lora_A.default.weight")
_FACTOR = re.compile(
    r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B)(?:\.(?!weight$|bias$)[^.]+)?(?:\.weight)?$"
)


@dataclass(frozen=True)
class LoraFactor:
    """One base tensor's low-rank delta: ΔW = scale · B @ A in the base tensor's orientation
    (transposed when `fan_in_fan_out` or `embedding`; see the module docstring)."""

    a: tuple[int, TensorInfo]  # (file index, tensor) of lora_A / lora_embedding_A
    b: tuple[int, TensorInfo]  # (file index, tensor) of lora_B / lora_embedding_B
    rank: int
    scale: float
    fan_in_fan_out: bool
    embedding: bool

    @property
    def transposed(self) -> bool:
        """ΔW = scale · (B @ A)ᵀ: rows of ΔW are columns of A."""
        return self.fan_in_fan_out or self.embedding

    @property
    def rows_factor(self) -> tuple[int, TensorInfo]:
        """The factor a block of ΔW's rows reads part of: B (rows of B), or A when transposed (columns of A)."""
        return self.a if self.transposed else self.b

    @property
    def fixed_factor(self) -> tuple[int, TensorInfo]:
        """The factor every block of the tensor needs whole: A, or B when transposed."""
        return self.b if self.transposed else self.a

    @property
    def fixed_bytes(self) -> int:
        return self.fixed_factor[1].nbytes

    def row_bytes(self) -> int:
        """Bytes of the rows factor per row of ΔW (rank elements)."""
        t = self.rows_factor[1]
        return t.nbytes // max(1, math.prod(t.shape)) * self.rank


@dataclass(frozen=True)
class Adapter:
    """A PEFT LoRA adapter folder, checked against its base (nothing of the weights read yet)."""

    name: str
    path: Path
    root: Path
    files: tuple[FileInfo, ...]
    fingerprint: str  # a checkpoint's fingerprint of `files`, hashed with adapter_config.json's bytes
    factors: dict[str, LoraFactor]  # base tensor name -> its factors
    dense: dict[str, tuple[int, TensorInfo]]  # base tensor name -> a full replacement (modules_to_save)
    config: dict[str, Any]

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def tensors(self) -> tuple[tuple[int, TensorInfo], ...]:
        """Every tensor of the adapter's files, (file index, tensor), as a Checkpoint lists them."""
        return tuple((i, t) for i, f in enumerate(self.files) for t in f.header.tensors)

    @property
    def dtype(self) -> str:
        """The dtype holding most of the adapter's bytes (the catalog's one-word label)."""
        counts: dict[str, int] = {}
        for _, t in self.tensors:
            counts[t.dtype] = counts.get(t.dtype, 0) + t.nbytes
        return max(sorted(counts), key=lambda d: counts[d])

    @property
    def architecture(self) -> str | None:
        return None  # an adapter has no model class of its own: its base's

    def touched(self) -> list[str]:
        """Base tensor names with a delta, sorted."""
        return sorted({*self.factors, *self.dense})


def is_adapter(path: str | os.PathLike[str]) -> bool:
    """A folder holding adapter_config.json and adapter_model.safetensors (or its shard index)."""
    p = Path(path)
    try:
        return p.is_dir() and (p / CONFIG).is_file() and ((p / SINGLE).is_file() or (p / INDEX).is_file())
    except PermissionError:  # a folder this user cannot look into (stray.py)
        return False


def open_adapter(path: str | os.PathLike[str], base: Checkpoint, name: str | None = None) -> Adapter:
    """Read the config and headers of the adapter at `path` and map its keys to `base`'s tensors.

    Refuses (FormatError / AlignmentError, one line naming the key and the fix) what mergedb
    cannot merge exactly: DoRA, `target_parameters`, a peft_type other than LORA, LoRA biases,
    keys that are neither LoRA factors nor base tensors, a factor without its partner or its
    base tensor, non-float factors, and shapes that do not match the base's."""
    root = Path(path)
    if not is_adapter(root):
        raise FormatError(f"{root}: not a PEFT adapter folder (needs {CONFIG} and {SINGLE} or {INDEX})")
    cfg, cfg_bytes = loraconfig.read_config(root)
    files = _files(root)
    tensors: dict[str, tuple[int, TensorInfo]] = {}
    for i, f in enumerate(files):
        for t in f.header.tensors:
            if t.name in tensors:
                raise FormatError(f"{root}: key {t.name!r} appears in two shards; remove one copy")
            tensors[t.name] = (i, t)
    if not tensors:
        raise FormatError(f"{root}: the adapter holds no tensors; point at a trained adapter")
    base_t = {t.name: t for _, t in base.tensors}
    pairs: dict[str, dict[str, tuple[int, TensorInfo]]] = {}
    dense: dict[str, tuple[int, TensorInfo]] = {}
    for key, ft in tensors.items():
        if "lora_magnitude_vector" in key:
            raise FormatError(f"{root}: key {key!r} is a DoRA magnitude vector; DoRA adapters are not supported")
        rest = key[len(PREFIX) :] if key.startswith(PREFIX) else key
        m = _FACTOR.match(rest)
        if m is None and rest.endswith(".base_layer.weight"):
            _refuse_tied_head(root, base, rest[: -len(".base_layer.weight")], base_t)  # the reason, not a resave
            raise FormatError(
                f"{root}: key {key!r} is a saved copy of the base layer under a LoRA-adapted module (peft's "
                "save_embedding_layers); mergedb merges deltas against the registered base: save the adapter "
                "again with save_pretrained(..., save_embedding_layers=False)"
            )
        if m is None:
            if ".lora_" in rest:
                raise FormatError(
                    f"{root}: key {key!r} is a LoRA tensor mergedb does not know (LoRA biases, trainable tokens "
                    "and other variants are not supported); train the adapter without it"
                )
            target = _dense_target(rest, base_t)
            if target is None:
                raise AlignmentError(
                    f"{root}: key {key!r} names no tensor of base {base.name!r}; register the adapter "
                    "against the base it was trained on (--base-model NAME)"
                )
            if target in dense:  # e.g. a prefixed and a bare copy: which one would be merged?
                raise FormatError(
                    f"{root}: keys {dense[target][1].name!r} and {key!r} both hold base tensor {target!r}; "
                    "keep one of them (save the adapter again)"
                )
            dense[target] = ft
            continue
        slot = pairs.setdefault(m["module"], {})
        if m["kind"] in slot:  # two adapter names (lora_A.default and lora_A.other), or a prefixed and a bare copy
            raise FormatError(
                f"{root}: keys {slot[m['kind']][1].name!r} and {key!r} are both the {m['kind']} of module "
                f"{m['module']!r}; an adapter folder holds one adapter: save each adapter on its own"
            )
        slot[m["kind"]] = ft
    factors: dict[str, LoraFactor] = {}
    for module, p in sorted(pairs.items()):
        emb = any("embedding" in k for k in p)
        need = ("lora_embedding_A", "lora_embedding_B") if emb else ("lora_A", "lora_B")
        if sorted(p) != sorted(need):
            raise FormatError(
                f"{root}: module {module!r} has factors {sorted(p)}, expected {list(need)}; "
                "the adapter file is incomplete or mixes layouts: save it again"
            )
        if not loratargets.targeted(cfg, module):
            raise FormatError(
                f"{root}: the adapter holds factors for module {module!r}, which its {CONFIG} does not select "
                f"(target_modules {cfg.get('target_modules')!r}); peft would drop them and adapt the modules it "
                f"selects with new factors instead: fix target_modules in {CONFIG}, or save the adapter again"
            )
        target = f"{module}.weight"
        _refuse_tied_head(root, base, module, base_t)
        if target not in base_t:
            raise AlignmentError(
                f"{root}: the factors of {module!r} adapt {target!r}, which base {base.name!r} does not have; "
                "register the adapter against the base it was trained on (--base-model NAME)"
            )
        if target in dense:
            raise FormatError(f"{root}: {target!r} is both LoRA-adapted and saved whole; save the adapter again")
        conv1d = _conv1d(base.architecture, module)
        factors[target] = _factor(root, module, p[need[0]], p[need[1]], emb, cfg, base_t[target], conv1d)
    _refuse_undecided_layouts(root, base, cfg, factors, base_t)
    for target, (_, t) in dense.items():
        bt = base_t[target]
        if t.shape != bt.shape:
            raise AlignmentError(
                f"{root}: {t.name!r} is {list(t.shape)} but base tensor {target!r} is {list(bt.shape)}; "
                "register the adapter against the base it was trained on (--base-model NAME)"
            )
        if t.dtype not in FLOAT_DTYPES or bt.dtype not in FLOAT_DTYPES:
            raise FormatError(
                f"{root}: {t.name!r} is {t.dtype} and base tensor {target!r} is {bt.dtype}; "
                f"only {'/'.join(FLOAT_DTYPES)} tensors can be merged"
            )
    return Adapter(name or root.name, root, root, files, _fingerprint(files, cfg_bytes), factors, dense, cfg)


def adapter_fingerprint(path: str | os.PathLike[str]) -> str:
    """The fingerprint `open_adapter` records, from the folder alone (no base needed)."""
    root = Path(path)
    if not is_adapter(root):
        raise FormatError(f"{root}: not a PEFT adapter folder (needs {CONFIG} and {SINGLE} or {INDEX})")
    return _fingerprint(_files(root), loraconfig.read_config(root)[1])


def _files(root: Path) -> tuple[FileInfo, ...]:
    return tuple(file_info(root, rel) for rel in ([SINGLE] if (root / SINGLE).is_file() else _shards(root)))


def _fingerprint(files: tuple[FileInfo, ...], cfg_bytes: bytes) -> str:
    return hashlib.sha256(f"{fingerprint(files)}\0".encode() + cfg_bytes).hexdigest()


def pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    r"""peft 0.21's rule (utils/other.py `get_pattern_key`, used by tuners/lora/model.py
    `_create_and_replace`): the first key, in the config's order, for which
    `re.match(rf"(.*\.)?({key})$", module)` matches (the key is a regex for a suffix of the module
    name starting at a dot boundary) gives the value; when none matches, peft looks the module name
    itself up (`patterns.get(module, default)`)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return patterns.get(module, default)


def _factor(
    root: Path,
    module: str,
    a: tuple[int, TensorInfo],
    b: tuple[int, TensorInfo],
    embedding: bool,
    cfg: dict[str, Any],
    base: TensorInfo,
    conv1d: bool = False,
) -> LoraFactor:
    """One module's factors, checked against its base tensor. The layout follows the module's type,
    as peft's does: a Conv1D (GPT-2's c_attn, c_proj, c_fc) is fan_in_fan_out, a Linear never is,
    whatever `fan_in_fan_out` the config says (peft sets it per module and warns); a module whose
    factors fit its base tensor only transposed is a Conv1D of an architecture not listed here."""
    ta, tb = a[1], b[1]
    for t in (ta, tb):
        if t.dtype not in FLOAT_DTYPES:
            raise FormatError(
                f"{root}: factor {t.name!r} is {t.dtype}; only {'/'.join(FLOAT_DTYPES)} factors can be merged "
                "(a quantized adapter must be dequantized first)"
            )
        if len(t.shape) != 2:
            raise FormatError(
                f"{root}: factor {t.name!r} has shape {list(t.shape)}; only 2-D (Linear, Conv1D, Embedding) "
                "LoRA factors are supported"
            )
    if base.dtype not in FLOAT_DTYPES or len(base.shape) != 2:
        raise AlignmentError(
            f"{root}: module {module!r} adapts base tensor {base.name!r} of {base.dtype}{list(base.shape)}; "
            "only 2-D float base tensors can take a LoRA delta"
        )
    r = int(pattern_value(cfg.get("rank_pattern") or {}, module, cfg.get("r", 8)))
    alpha = float(pattern_value(cfg.get("alpha_pattern") or {}, module, cfg.get("lora_alpha", 8)))
    rank, cols = ta.shape  # A: (r, in) for a Linear, (r, num_embeddings) for an Embedding
    out, rank_b = tb.shape  # B: (out, r) / (dim, r)
    if rank != rank_b:
        raise FormatError(
            f"{root}: module {module!r}: lora_A {list(ta.shape)} has {rank} rows but lora_B {list(tb.shape)} "
            f"{rank_b} columns; the adapter file is damaged or mixes adapters: save it again"
        )
    if rank != r:
        raise FormatError(
            f"{root}: module {module!r}: its factors have rank {rank} but {CONFIG} says r = {r} (r, rank_pattern; "
            f"8 when absent), which sets the scaling alpha/r; correct r in {CONFIG}"
        )
    fifo = not embedding and (conv1d or ((cols, out) == base.shape and (out, cols) != base.shape))
    want = (cols, out) if (fifo or embedding) else (out, cols)
    if want != base.shape:
        raise AlignmentError(
            f"{root}: module {module!r}: lora_A {list(ta.shape)} and lora_B {list(tb.shape)} do not make a delta "
            f"of base tensor {base.name!r} {list(base.shape)}"
            + (" (a Conv1D: fan_in_fan_out)" if fifo else "")
            + "; register the adapter against the base it was trained on (--base-model NAME)"
        )
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return LoraFactor(a, b, r, scale, fifo, embedding)


def _refuse_undecided_layouts(
    root: Any, base: Any, cfg: dict[str, Any], factors: dict[str, LoraFactor], base_t: dict[str, TensorInfo]
) -> None:
    """Refuse an adapter with a square module over a base whose architecture is unknown (no config.json)
    when the adapter shows signs of Conv1D layers (a module that fits only transposed, or
    `fan_in_fan_out: true`, which peft saves for them): (in, out) or (out, in) cannot be told apart
    there, and GPT-2's square c_proj was merged untransposed, silently (review, 2026-12-03)."""
    if base.architecture:
        return
    square = [t for t, f in factors.items() if not f.embedding and base_t[t].shape[0] == base_t[t].shape[1]]
    conv_like = cfg.get("fan_in_fan_out") is True or any(f.fan_in_fan_out for f in factors.values())
    if square and conv_like:
        raise AlignmentError(
            f"{root}: base {base.name!r} has no architecture (no config.json beside its weights), so the layout "
            f"of square module {square[0]!r} cannot be told: a Conv1D (GPT-2: (in, out), as this adapter's other "
            "modules or its fan_in_fan_out suggest) or a Linear (out, in); register the base's folder with its "
            "config.json (mergedb register BASE_FOLDER --base)"
        )


def _refuse_tied_head(root: Any, base: Any, module: str, base_t: dict[str, TensorInfo]) -> None:
    """Refuse an adapter of an output layer the base ties to its input embedding (it holds no
    `lm_head.weight`): peft writes that delta into the shared tensor, which mergedb does not do."""
    tied = module.rsplit(".", 1)[-1] == "lm_head" and any(n.endswith(_EMBEDDINGS) for n in base_t)
    if tied and f"{module}.weight" not in base_t:
        raise AlignmentError(
            f"{root}: the adapter adapts {module!r}, the output layer, which base {base.name!r} ties to its input "
            "embedding (tie_word_embeddings: it holds no lm_head.weight); peft writes that delta into the shared "
            "tensor, which mergedb does not do: train the adapter without lm_head in target_modules"
        )


_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")  # input embeddings

# transformers' models whose attention and MLP use Conv1D (weights stored (in, out)), and its modules
CONV1D_ARCHITECTURES = ("GPT2", "OpenAIGPT", "ImageGPT", "DecisionTransformer")
CONV1D_MODULES = frozenset({"c_attn", "c_proj", "c_fc", "q_attn"})


def _conv1d(architecture: str | None, module: str) -> bool:
    """Whether `module` of a model of `architecture` (config.json's) is a Conv1D."""
    return (
        bool(architecture)
        and str(architecture).startswith(CONV1D_ARCHITECTURES)
        and (module.rsplit(".", 1)[-1] in CONV1D_MODULES)
    )


def _dense_target(rest: str, base_t: dict[str, TensorInfo]) -> str | None:
    """The base tensor a modules_to_save key replaces: the key itself, or with the adapter-name
    segment of `<module>.modules_to_save.<adapter>.weight` style keys dropped."""
    if rest in base_t:
        return rest
    cut = re.sub(r"\.modules_to_save(\.[^.]+)?(?=\.[^.]+$)", "", rest)
    return cut if cut in base_t else None


def _shards(root: Path) -> list[str]:
    path = root / INDEX
    try:
        raw = read_small(path)
    except OSError:
        raise FormatError(f"{path}: not a valid index (expected JSON with a 'weight_map' object)") from None
    roots = link_roots(root)  # the folder, or a Hugging Face cache snapshot's own blobs/
    shards = sorted(set(jsondoc.weight_map(raw, path).values()))
    for s in shards:
        if "\x00" in s or os.path.isabs(s) or not leads_inside(root / s, roots) or not (root / s).is_file():
            raise FormatError(f"{path}: shard {s!r} is missing or outside the adapter folder")
    return shards


def partition(items: Iterable[Any]) -> tuple[list[Any], list[Adapter]]:
    """(the items that are not adapters, the adapters), each in order."""
    items = list(items)
    return [c for c in items if not isinstance(c, Adapter)], [c for c in items if isinstance(c, Adapter)]


def split_paths(paths: Iterable[str | os.PathLike[str]], base: bool = False) -> tuple[list[Path | str], list[Path]]:
    """(checkpoint paths, adapter folders) among `paths`: an adapter folder itself, or the adapters
    among a folder's direct subfolders (the folder stays a checkpoint path when it also holds
    models or is one, for `checkpoint.discover` to expand). `base`: the paths are to be bases,
    which an adapter cannot be."""
    ckpts: list[Path | str] = []
    adapters: list[Path] = []
    for raw in paths:
        if is_url(raw):  # a URL stays a string (checkpoint.discover reads it); adapters are local folders
            ckpts.append(str(raw))
            continue
        p = Path(raw)
        if is_adapter(p):
            adapters.append(p)
            continue
        if p.is_dir() and ((p / SINGLE).is_file() or (p / INDEX).is_file()) != (p / CONFIG).is_file():
            has, lacks = (CONFIG, SINGLE) if (p / CONFIG).is_file() else (SINGLE, CONFIG)
            raise FormatError(
                f"{p} holds {has} but no {lacks}: a PEFT LoRA adapter needs both; copy the missing file from "
                "where the adapter was saved"
            )
        subs = sorted(c for c in p.iterdir() if is_adapter(c)) if p.is_dir() and not is_checkpoint(p) else []
        for c in subs:
            refuse_output(c)  # an --as-lora output beside the adapters
        adapters.extend(subs)
        if not subs or any(is_checkpoint(c) for c in p.iterdir()):
            ckpts.append(p)  # checkpoint.discover looks at the rest
        else:
            for c in sorted(p.iterdir()):
                refuse_stray_weights(c)
    if adapters and base:
        raise FormatError(f"{adapters[0]} is a LoRA adapter, not a base model; register it with --base-model NAME")
    return ckpts, adapters
