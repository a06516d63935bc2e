"""How numba and the merge kernels' compiled code are loaded: numba imported with Ctrl-C held (every
module of mergedb that uses numba takes it from here), and the first call of each cached kernel of a
process without numba's full target refresh (light_cache_loads).
"""

from __future__ import annotations

import functools
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def _interrupts_held() -> Iterator[None]:
    """Hold SIGINT (Ctrl-C) while the body runs on the main thread, then act on it as the handler
    in place would have: a KeyboardInterrupt, by default. Other threads never see the signal."""
    before = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or before is None:
        yield  # another thread, or a handler Python did not install (an embedding host's): left alone
        return
    got: list[Any] = []
    try:
        signal.signal(signal.SIGINT, lambda signum, frame: got.append(frame))
    except ValueError:  # not the main interpreter (a subinterpreter)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
        if got and callable(before):
            before(signal.SIGINT, got[0])
        elif got and before == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)


# A Ctrl-C that lands while numba imports itself (~0.15 s, once a process, often on the main thread
# inside a user's first execute or register call) leaves numba's modules half-initialised in
# sys.modules, and every later merge of the process fails with an AttributeError from numba until the
# interpreter restarts. Held, it arrives once numba is whole; a retry then works.
with _interrupts_held():
    import numba
    import numba.cpython.unsafe.numbers  # noqa: F401  (deltapass's trailing_zeros)

TESTED_NUMBA = ((0, 68),)  # numba (major, minor) whose private cache API this was checked against


def tested_numba() -> bool:
    """Whether the installed numba is one whose Cache internals light_cache_loads was checked on."""
    try:
        return tuple(int(x) for x in numba.__version__.split(".")[:2]) in TESTED_NUMBA
    except ValueError:  # a version string of another shape (a source build's "0+unknown")
        return False


def _load_without_refresh(cache: Any, sig: Any, target_context: Any) -> Any:
    """numba's Cache.load_overload without its `target_context.refresh()`: load a cached kernel with
    only numba's runtime initialised (see light_cache_loads)."""
    from numba.core.runtime import rtsys

    rtsys.initialize(target_context)
    with cache._guard_against_spurious_io_errors():
        return cache._load_overload(sig, target_context)


def light_cache_loads(namespace: dict[str, Any]) -> None:
    """Make the first call of each cached kernel in `namespace` load its machine code without
    numba's full target refresh. numba's Cache.load_overload first refreshes the CPU target, which
    imports every lowering registry numba has (numpy's API, typed containers, cffi, ...: ~0.08 of
    the ~0.15 CPU-s of a process's first kernel call, measured). Those are needed to compile, not
    to link code compiled before, which needs numba's runtime (NRT) only. A cache miss still
    compiles through numba's pipeline, which refreshes the target itself (numba.core.compiler).
    Left as numba has it on any numba this was not checked against (TESTED_NUMBA) or whose cache
    does not have the shape this relies on."""
    if not tested_numba():
        return
    for f in namespace.values():
        cache = getattr(f, "_cache", None)
        if all(hasattr(cache, a) for a in ("load_overload", "_load_overload", "_guard_against_spurious_io_errors")):
            cache.load_overload = functools.partial(_load_without_refresh, cache)
