from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings

from mergedb import synth
from mergedb.catalog import Catalog

# Property tests draw the same examples on every run, so that a CI run cannot fail on a draw no
# earlier run made; `HYPOTHESIS_PROFILE=explore pytest` draws new ones (and prints how to replay a
# failure).
settings.register_profile("repeatable", derandomize=True, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

# A suite started in the background (nohup, `&` without job control) inherits SIGINT ignored, and
# so would every `mergedb` process a test starts: the Ctrl-C tests need it delivered.
signal.signal(signal.SIGINT, signal.default_int_handler)

# The suite writes its checkpoints under pytest's temporary folder: ~1.5 GB at its peak, the demo's
# tests ~0.8 GB at once. On a fuller disk hundreds of tests would fail with errors that do not say
# why (a CI run did, at 2.3 GB free with old runs' folders kept), so the run stops first, saying so.
# MERGEDB_TESTS_MIN_FREE (bytes) sets another floor, e.g. 0 to run a few tests on a fuller disk.
NEEDS_FREE = int(os.environ.get("MERGEDB_TESTS_MIN_FREE", 2 * 10**9))


def pytest_sessionstart(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    # measured where pytest will make its folder, without making it (that would take space, and
    # count as one of the runs whose folders pytest keeps)
    where = Path(session.config.option.basetemp or os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir())
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < NEEDS_FREE:
        pytest.exit(
            f"only {free / 1e9:.1f} GB free under {where}; the tests need ~{NEEDS_FREE / 1e9:.1f} GB there: free "
            "some space (old /tmp/pytest-of-* folders?), point --basetemp at a roomier disk, or set "
            "MERGEDB_TESTS_MIN_FREE to a lower floor in bytes",
            returncode=1,
        )


# (dtype, shard_size): bf16 single file, fp16 sharded, fp32 single file with small blocks
FAMILIES = {
    "bf16": ("bf16", 10**9),
    "fp16-sharded": ("fp16", 700_000),
    "fp32": ("fp32", 10**9),
}
BLOCK_SIZE = {"bf16": 64 * 1024, "fp16-sharded": 100_000, "fp32": 200_000}


@pytest.fixture(scope="session", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, Path, Catalog]:
    """A registered tiny family of 3 experts: (kind, folder, catalog)."""
    kind = request.param
    dtype, shard = FAMILIES[kind]
    root = tmp_path_factory.mktemp(f"fam-{kind}")
    synth.make_family(root / "family", experts=3, size="tiny", dtype=dtype, seed=7, shard_size=shard)
    cat = Catalog(root / "catalog.duckdb")
    cat.register([root / "family"], base_model="base", block_size=BLOCK_SIZE[kind])
    return kind, root / "family", cat


@pytest.fixture
def tiny_family(tmp_path) -> Path:
    """A fresh, unregistered tiny bf16 family of 2 experts under tmp_path."""
    return synth.make_family(tmp_path / "family", experts=2, size="tiny", seed=3)
