"""mergedb: an embedded merge engine for families of fine-tuned LLM checkpoints."""

from .catalog import Catalog, CheckpointRow, RegisterResult, connect
from .errors import MergeDBError

__version__ = "0.1.0"
__all__ = ["Catalog", "CheckpointRow", "MergeDBError", "RegisterResult", "connect", "__version__"]
