"""mergedb: an embedded merge engine for families of fine-tuned LLM checkpoints."""

from importlib import import_module
from typing import Any

from .errors import MergeDBError

__version__ = "0.1.0"
__all__ = ["Catalog", "CheckpointRow", "MergeDBError", "PlanRequest", "RegisterResult", "connect", "__version__"]

# Imported on first use, so `import mergedb` (and `mergedb --help`) loads neither DuckDB nor numba.
_LAZY = {
    "Catalog": "catalog",
    "CheckpointRow": "catalog",
    "connect": "catalog",
    "PlanRequest": "planner",
    "RegisterResult": "register",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
