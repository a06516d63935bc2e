"""The `mergedb` console script's first code. Ctrl-C or SIGTERM while the command's modules load
(typer, rich, the CLI: 0.2-0.5 s) ends it as it does once a command runs: exit 130 or 143, no
traceback. Imports nothing but the standard library, so the window it cannot cover is the
interpreter's start and `mergedb/__init__.py` (which loads only errors.py)."""

from __future__ import annotations

import signal
from typing import Any


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # cli.entry installs its own handler once the CLI is loaded


def main() -> None:
    signal.signal(signal.SIGTERM, _terminated)
    try:
        from .cli import entry
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    entry()
