"""Side files: what a merged model carries from its base besides the weights.

An explicit allow-list (config, generation config, tokenizer, chat templates, processor configs,
license), never "whatever lies beside the weights": a single-file base may sit in a folder of
unrelated things (keys, notes, other models), and pickled weights (.bin, .pt, .ckpt, .pkl) run code
when loaded. Besides the named files: the named chat templates transformers saves in
`additional_chat_templates/<name>.jinja`, and the Python files a custom-code model's `auto_map`
(config.json, tokenizer_config.json, the processor configs) names, with the files those import
relatively: `from_pretrained(..., trust_remote_code=True)` needs each of them. No other *.py. Those the
base lacks, the output lacks too (a config whose model_type transformers knows loads natively).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from . import jsondoc, remote
from .errors import ChangedFileError
from .plainfile import leads_inside, link_roots, read_small
from .remote import RemotePath

# Side files copied from the base into a merged model, by name (see `side_files`).
SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "spm.model",  # DeBERTa-v2/v3's sentencepiece model
    "source.spm",  # Marian translation models: the source and target sentencepiece models
    "target.spm",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tekken.json",  # Mistral's tekken tokenizer (Mistral-Nemo, Pixtral, Ministral, Mistral-Small 3)
    "tiktoken.model",  # tiktoken vocabularies transformers converts (Kimi K2)
    "qwen.tiktoken",  # Qwen (1)'s custom-code tokenizer reads its vocabulary from this file
    "ice_text.model",  # ChatGLM-6B's custom-code tokenizer: its sentencepiece model (vocab_file)
    "normalizer.json",  # Whisper's English text normalizer, read by its tokenizer
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",  # a multimodal processor's own settings (e.g. image tokens per image)
    "video_preprocessor_config.json",  # video processors (Qwen2-VL and later), since transformers 4.52
    "LICENSE",
    "LICENSE.txt",
    "LICENSE.md",
)
# Mistral's versioned sentencepiece models (tokenizer.model.v1, .v3, .v7: Mistral-7B-Instruct-v0.3, Mixtral,
# Mistral-Large), which transformers and mistral_common read beside or instead of tokenizer.model
_VERSIONED = re.compile(r"tokenizer\.model\.v\d+")
TEMPLATES = "additional_chat_templates"  # transformers' folder of named chat templates (<name>.jinja)
_TEMPLATE = re.compile(rf"{TEMPLATES}/[^/\0]+\.jinja")
_CODE = re.compile(r"[A-Za-z_]\w*\.py", re.ASCII)  # a top-level module file, as auto_map names it
_AUTO_MAP_IN = ("config.json", "tokenizer_config.json", "preprocessor_config.json", "processor_config.json")
# transformers' dynamic_module_utils.get_relative_imports: the modules a custom-code file needs beside it
_RELATIVE = re.compile(r"^\s*(?:import\s+\.(\S+)\s*$|from\s+\.(\S+)\s+import)", re.MULTILINE)


def is_side_name(name: object) -> bool:
    """Whether `name` (a path relative to the output folder) is one mergedb may copy from a base."""
    return isinstance(name, str) and (
        name in SIDE_FILES or any(p.fullmatch(name) for p in (_VERSIONED, _TEMPLATE, _CODE)) and ".." not in name
    )


def _regular(p: Path, roots: list[Path]) -> bool:
    """Whether `p` is a regular file, or a link to one inside `roots` (not a dangling or looping link)."""
    try:
        return leads_inside(p, roots) and stat.S_ISREG(os.stat(p).st_mode)
    except OSError:
        return False


def code_names(configs: dict[str, bytes]) -> list[str]:
    """The module files that the `auto_map` of these configs (name -> bytes) names, e.g.
    "configuration_my.MyConfig" -> configuration_my.py; a value may be a string or a list of
    strings and nulls. "repo--module.Class" is code in another repository: not ours to copy."""
    names = set()
    for data in configs.values():
        try:
            doc = jsondoc.parse(data)
        except ValueError:  # the base's own config, unreadable: it is copied as it is
            continue
        auto = doc.get("auto_map") if isinstance(doc, dict) else None
        for value in auto.values() if isinstance(auto, dict) else ():
            for ref in value if isinstance(value, list) else [value]:
                if isinstance(ref, str) and "--" not in ref and ref.count(".") == 1:
                    names.add(ref.split(".")[0] + ".py")
    return sorted(n for n in names if _CODE.fullmatch(n))


def _with_imports(names: list[str], read: Callable[[str], bytes | None]) -> dict[str, bytes]:
    """`names` and the top-level modules they import relatively, transitively, as name -> content;
    `read(name)` gives a file's bytes, None where the base lacks it (then the output lacks it too)."""
    todo, found, seen = list(names), {}, set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        data = read(name)
        if data is None:
            continue
        found[name] = data
        text = data.decode("utf-8", "replace")
        todo += [f"{a or b}.py" for a, b in _RELATIVE.findall(text) if _CODE.fullmatch(f"{a or b}.py")]
    return found


def side_files(root: Path) -> list[str]:
    """Paths, relative to `root`, of the files in `root` to copy into a merged model (see the module's
    note). The base's README.md is left out on purpose: it is the card of a different model (the
    merge's provenance is in mergedb_manifest.json). Only regular files count; a symlink counts only
    when it resolves to a regular file inside `root`, or, for a Hugging Face cache snapshot, inside
    its repository's blobs/ (so a config.json -> /etc/... link is skipped)."""
    roots = link_roots(root)
    try:
        listed = sorted(os.listdir(root))
    except OSError:
        listed = []
    found = [n for n in SIDE_FILES if _regular(root / n, roots)]
    found += [n for n in listed if _VERSIONED.fullmatch(n) and _regular(root / n, roots)]
    with_templates = (root / TEMPLATES).is_dir() and not (root / TEMPLATES).is_symlink()
    for n in sorted(os.listdir(root / TEMPLATES)) if with_templates else ():
        if _TEMPLATE.fullmatch(f"{TEMPLATES}/{n}") and _regular(root / TEMPLATES / n, roots):
            found.append(f"{TEMPLATES}/{n}")
    configs = {}
    for n in _AUTO_MAP_IN:
        if n in found:
            try:
                configs[n] = read_small(root / n)
            except OSError:
                continue

    def read(name: str) -> bytes | None:
        try:
            return read_small(root / name) if _regular(root / name, roots) else None
        except OSError:
            return None

    code = _with_imports(code_names(configs), read)  # those the base lacks, the output lacks too: a config
    # whose model_type transformers knows loads without them (Phi-3, Qwen2 downloads of *.json only)
    return sorted(found + list(code))


_TORCH_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}  # safetensors dtype -> config.json's


def side_record(root: Path | RemotePath) -> str | None:
    """What the catalog records of a base's side files (checkpoints.side_files): a JSON list of
    `side_files(root)`; None for a remote base (not listed at registration)."""
    return None if isinstance(root, RemotePath) else json.dumps(side_files(root))


def refuse_lost(base: str, root: str, record: str | None) -> None:
    """Refuse to merge when the base `base` has lost a side file it held when it was registered
    (`record`, checkpoints.side_files): the output would lack it (a model without config.json does not
    load) and look complete. Files added since are copied as ever; an edited file is the user's."""
    names = [] if record is None else json.loads(record)
    now = set(side_files(Path(root))) if names else set()  # listed once (it reads configs for auto_map)
    lost = [n for n in names if n not in now]
    if lost:
        raise ChangedFileError(
            f"base {base!r} ({root}) no longer holds {', '.join(lost[:5])}{' …' if len(lost) > 5 else ''}, which it "
            f"held when it was registered, and the merged model would lack {'it' if len(lost) == 1 else 'them'}; "
            f"restore {'it' if len(lost) == 1 else 'them'}, or register the base again (mergedb register {root} "
            f"--base --name {base}) to merge without (nothing was merged)"
        )


def copy_side_files(root: Path | RemotePath, dest: Path, dtype: str | None = None) -> list[str]:
    """Copy the side files of the checkpoint folder `root` (see `side_files`) into `dest`, as regular
    files (a link into a cache is copied by its content); the paths written, relative to `dest`. With
    `dtype` (the output's, a safetensors name), config.json's `torch_dtype` and `dtype` say it where
    they are present, so that transformers' dtype="auto" loads the weights as written."""
    if isinstance(root, RemotePath):
        names = _copy_remote(root, dest)
    else:
        names = side_files(root)
        for f in names:
            (dest / f).parent.mkdir(exist_ok=True)
            shutil.copyfile(root / f, dest / f)  # a link's content: the output never links into a cache
    config = dest / "config.json"
    if dtype is None or not config.is_file():
        return names
    try:
        doc = jsondoc.parse(read_small(config))
    except (OSError, ValueError):  # the base's own config, unreadable: copied as it is
        return names
    if isinstance(doc, dict) and any(k in doc for k in ("torch_dtype", "dtype")):
        doc.update({k: _TORCH_DTYPES[dtype] for k in ("torch_dtype", "dtype") if k in doc})
        config.write_text(json.dumps(doc, indent=2) + "\n")
    return names


def _copy_remote(root: RemotePath, dest: Path) -> list[str]:
    """copy_side_files from a remote folder, as from a local one where the filesystem lists folders
    (S3, GCS, file://). Over HTTP(S), which cannot list, the named files and the code are fetched by
    name, and the names a listing would find (tokenizer.model.vN, the templates' folder) are missed."""
    listed = remote.listdir(root.url)
    names = remote.side_names(root, SIDE_FILES, listed)  # the listing above, not a second one
    names += [n for n in listed or () if _VERSIONED.fullmatch(n) and remote.stat((root / n).url) is not None]
    templates = [] if listed is None or TEMPLATES not in listed else remote.listdir((root / TEMPLATES).url) or []
    names += [f"{TEMPLATES}/{n}" for n in templates if _TEMPLATE.fullmatch(f"{TEMPLATES}/{n}")]
    written = []
    for f in names:
        data = remote.read_small((root / f).url)  # None: not a file (a folder of that name, say)
        if data is not None:
            (dest / f).parent.mkdir(exist_ok=True)
            (dest / f).write_bytes(data)
            written.append(f)
    configs = {n: (dest / n).read_bytes() for n in _AUTO_MAP_IN if n in written}
    for f, data in _with_imports(code_names(configs), lambda n: remote.read_small((root / n).url)).items():
        (dest / f).write_bytes(data)
        written.append(f)
    return sorted(written)
