"""The CLI's plain parameter values (str, int, float, Path) coerced without pydantic.

typer 0.29 coerces every parameter through a pydantic TypeAdapter: the first one imports pydantic
and builds schemas (~0.05 s of every `mergedb execute` / `mergedb plan` process). The values the
commands take are plain, so `install` gives each such parameter a coercion that handles the
ordinary spellings (a decimal integer, a decimal number, a path, any UTF-8 text) exactly as the
adapter would, and hands every other value (and every value of another type) to typer's own
coercion, whose result or error message is then the same as before. tests/test_cliparse.py checks
the fast results against typer's adapters."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:  # typer's private coercion API (0.29); another typer keeps its own coercion (install does nothing)
    from typer._coercion import RuntimeParam, build_runtime_param
    from typer._param_types import coerce_cli_path
except ImportError:  # pragma: no cover - tested in a subprocess (tests/test_cliparse.py)
    RuntimeParam = object  # type: ignore[assignment,misc]
    build_runtime_param = coerce_cli_path = None  # type: ignore[assignment]

_INT = re.compile(r"-?(?:0|[1-9][0-9]{0,17})")
_FLOAT = re.compile(r"-?(?:0|[1-9][0-9]{0,14})(?:\.[0-9]{1,15})?")
_PLAIN = (str, int, float, Path, bool)  # bool: a flag's None (unset) needs no adapter either


@dataclass(frozen=True)
class PlainParam(RuntimeParam):
    """typer's RuntimeParam for a str/int/float/Path/bool parameter without constraints."""

    descriptor: Any

    def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
        kind = self.annotation
        if kind is str and type(value) is str and _utf8(value):
            return value
        if kind is int and (type(value) is int or (type(value) is str and _INT.fullmatch(value))):
            return int(value)
        if kind is float and (type(value) is float or (type(value) is str and _FLOAT.fullmatch(value))):
            return float(value)
        if kind is Path and (isinstance(value, Path) or (type(value) is str and value and _utf8(value))):
            path = value if isinstance(value, Path) else Path(value)
            return coerce_cli_path(path, self.parameter_info, path_type=Path, param=param, ctx=ctx)
        return build_runtime_param(self.descriptor)._coerce_value(value, param=param, ctx=ctx)


def _utf8(text: str) -> bool:
    """False for text pydantic refuses as a str (lone surrogates: undecodable bytes in argv)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\0" not in text


def install(param: Any) -> None:
    """Give `param` (a typer parameter) the plain coercion when its type and options allow it."""
    d = getattr(param, "type_descriptor", None)
    if build_runtime_param is None or d is None or d.annotation not in _PLAIN or d.file_annotation is not None:
        return
    info = d.parameter_info
    constrained = (info.parser, info.min, info.max, info.path_type) != (None, None, None, None)
    if constrained or info.clamp or info.resolve_path or info.allow_dash or param.multiple or param.nargs != 1:
        return
    if getattr(param, "_runtime_param", None) is None:
        param._runtime_param = PlainParam(parameter_info=info, annotation=d.annotation, descriptor=d)
