"""mergedb: an embedded merge engine for families of fine-tuned LLM checkpoints."""

from .catalog import Catalog, CheckpointRow, connect
from .errors import MergeDBError
from .planner import PlanRequest
from .register import RegisterResult

__version__ = "0.1.0"
__all__ = ["Catalog", "CheckpointRow", "MergeDBError", "PlanRequest", "RegisterResult", "connect", "__version__"]
