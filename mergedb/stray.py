"""Weights in a folder of checkpoints that mergedb would not register, refused with the way out.

`mergedb register ./experts` takes each subfolder that is a checkpoint (model.safetensors or its
index) or a LoRA adapter (adapter_config.json beside adapter_model.safetensors or its index). A
subfolder holding weights in another shape was skipped without a word, so the family was registered
an expert short: shards without their index, a lone file under another name, an adapter missing
its config or saved as a pickle, pickled or GGUF model weights, a model file that is a broken link.
Folders without weights (logs, runs, training state such as optimizer.pt or training_args.bin),
hidden folders and lost+found are left alone.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from .errors import FormatError

MODEL, MODEL_INDEX = "model.safetensors", "model.safetensors.index.json"
ADAPTER_CONFIG, ADAPTER, ADAPTER_INDEX = (
    "adapter_config.json",
    "adapter_model.safetensors",
    "adapter_model.safetensors.index.json",
)
OUTPUT_MANIFEST = "mergedb_manifest.json"  # manifest.MANIFEST: what marks a folder as a mergedb output
PICKLED = ("pytorch_model", "consolidated.", "model.ckpt", "adapter_model.bin")  # weights' usual pickle names
SHARD = re.compile(r".+-\d+-of-\d+\.safetensors")


def refuse_stray_weights(folder: Path) -> None:
    """Raise FormatError when `folder` (a subfolder of a folder of checkpoints) holds weights that
    would be skipped; return when it is a checkpoint, an adapter, or holds no weights."""
    if folder.name.startswith(".") or folder.name == "lost+found" or not folder.is_dir():
        return  # hidden, or a file system's own (root's, unreadable to others, never weights)
    try:
        names = sorted(os.listdir(folder))
    except OSError as e:
        raise FormatError(f"{folder}: cannot be read ({e.strerror}); fix its permissions or move it out") from None
    if (folder / MODEL).is_file() or (folder / MODEL_INDEX).is_file():
        return  # a checkpoint
    if ADAPTER_CONFIG in names and ((folder / ADAPTER).is_file() or (folder / ADAPTER_INDEX).is_file()):
        return  # a LoRA adapter
    _refuse(folder, names)


def refuse_output(folder: Path) -> None:
    """Raise FormatError when `folder`, a checkpoint or adapter found in a folder of checkpoints, is a
    mergedb output: registered with its family (`register ./fam` again, to add an expert) it counted
    the merge as one more fine-tune, its delta twice over in every later plan. Named by its own path,
    an output registers (on purpose)."""
    if (folder / OUTPUT_MANIFEST).is_file():
        raise FormatError(
            f"{folder}: a mergedb output (it holds {OUTPUT_MANIFEST}); registering it with the folder it is in "
            f"would count the merge as one more fine-tune: move it out of {folder.parent}, or register it "
            "by its own path if that is what you mean"
        )


def refuse_stray_names(folder: Any, names: list[str]) -> None:
    """refuse_stray_weights for a folder given by the names in it (a remote one, whose files are not
    looked at one by one): `folder` is neither a checkpoint nor an adapter."""
    if folder.name.startswith(".") or folder.name == "lost+found":
        return
    if ADAPTER_CONFIG in names and (ADAPTER in names or ADAPTER_INDEX in names):  # an adapter
        return
    _refuse(folder, names)


def refuse_loose_shards(folder: Any, names: list[str]) -> None:
    """Refuse a folder named as a folder of checkpoints (`names`: what it holds) that is a model saved
    in shards whose index is missing, a broken link or not a file: each shard would be registered as
    a checkpoint of its own (two partial bases of one tensor each, say). refuse_stray_weights says the
    same of such a folder one level down."""
    if MODEL in names or MODEL_INDEX in names or any(SHARD.fullmatch(n) for n in names):
        why = _why(folder, names)
        if why:
            raise FormatError(f"{folder} holds {why}")


def _refuse(folder: Any, names: list[str]) -> None:
    why = _why(folder, names)
    if why:
        raise FormatError(f"{folder} holds {why}, or move the folder out")


def _why(folder: Any, names: list[str]) -> str | None:
    tensors = [n for n in names if n.endswith(".safetensors")]
    pickled = [n for n in names if n.startswith(PICKLED) and n.endswith((".bin", ".json", ".pth", ".ckpt"))]
    gguf = [n for n in names if n.endswith(".gguf")]
    if MODEL in names or MODEL_INDEX in names:
        name = MODEL if MODEL in names else MODEL_INDEX
        return f"{name}, which is not a file (a broken link, or a folder): restore it"
    if ADAPTER in names or ADAPTER_INDEX in names:
        return f"{ADAPTER} but no {ADAPTER_CONFIG}: a PEFT LoRA adapter needs both; copy the config beside it"
    if "adapter_model.bin" in names:
        return "adapter_model.bin, a pickled adapter mergedb does not read: save it as safetensors (save_pretrained)"
    if any(SHARD.fullmatch(n) for n in tensors):
        shard = next(n for n in tensors if SHARD.fullmatch(n))
        return f"shards ({shard}, …) but no {MODEL_INDEX}: add the index that was saved with them"
    if tensors:
        more = f" and {len(tensors) - 1} more .safetensors" if len(tensors) > 1 else ""
        path = folder / tensors[0]
        return f"{tensors[0]}{more} but no {MODEL}: register a model file by its path (mergedb register {path})"
    if pickled or gguf:
        return f"{(pickled or gguf)[0]}, weights mergedb does not read (pickled or GGUF): save them as safetensors"
    return None
