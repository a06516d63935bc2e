"""Errors shown to users. Anything else escaping the library is a bug."""


class MergeDBError(Exception):
    """A problem the user can fix; the message says what went wrong and how to fix it."""


class FormatError(MergeDBError):
    """A checkpoint file or index is malformed or not what it claims to be."""


class AlignmentError(MergeDBError):
    """An expert does not line up with its base (names, shapes or dtypes differ)."""


class CatalogError(MergeDBError):
    """The catalog is missing, too new, locked, or does not hold what was asked for."""


class ChangedFileError(MergeDBError):
    """A file changed on disk since it was registered."""


class PlanError(MergeDBError):
    """A plan request is invalid: unknown method, bad parameter, bad budget."""


class RunNotRecordedError(MergeDBError):
    """A merge finished and its output is good, but the catalog could not record the run."""


class ConfigError(MergeDBError):
    """A mergekit-style YAML config uses a key, value or model that mergedb cannot honour exactly."""


class PlanExistsError(PlanError):
    """A plan of the requested name is stored already."""
