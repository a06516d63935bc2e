"""Registration's read-ahead (readahead.py): what the kernel is asked for, and when."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from mergedb import readahead
from mergedb.catalog import Catalog
from mergedb.layout import FamilyTensor
from mergedb.synth import make_family


class Recorder:
    """A byte source that records what it is asked to read ahead."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def will_need(self, offset: int, n: int) -> None:
        self.log.append((self.name, offset, n))


def _tensor(i: int, nbytes: int) -> FamilyTensor:
    return FamilyTensor(i, f"t{i}", "BF16", (nbytes // 2,), nbytes // 2, nbytes, 2, True, ())


def _setup(sizes: list[int], experts: int, log: list):
    tensors = [_tensor(i, n) for i, n in enumerate(sizes)]
    units = [(k, ft) for ft in tensors for k in range(experts)]  # as scan._scan orders them: a tensor's together

    def where(at: int) -> dict:  # tensor i of a file at offset at + 10_000 i
        return {ft.name: (0, SimpleNamespace(start=at + 10_000 * ft.tensor_idx, nbytes=ft.nbytes)) for ft in tensors}

    bfiles = SimpleNamespace(src=[Recorder("base", log)])
    efiles = [SimpleNamespace(src=[Recorder(f"e{k}", log)]) for k in range(experts)]
    ewhere = [where(1000 * (k + 1)) for k in range(experts)]
    return units, readahead.ReadAhead(units, bfiles, where(0), efiles, ewhere)


def test_each_unit_is_asked_for_once_and_before_it_starts(monkeypatch):
    """Units start in order on two threads: every unit's bytes are asked for exactly once, and always
    before the unit starts (by an earlier unit: at least the next one is asked ahead); the base's
    bytes of a tensor once, with the tensor's first unit. Fails if a unit asks only for itself."""
    monkeypatch.setattr(readahead, "READ_AHEAD_BYTES", 0)  # only the minimum look-ahead: the next unit
    log: list = []
    units, ahead = _setup([300, 200, 100], 2, log)
    for n, (k, ft) in enumerate(units):
        before = list(log)
        ahead.started(k, ft)
        mine = (f"e{k}", 1000 * (k + 1) + 10_000 * ft.tensor_idx, ft.nbytes)
        if n > 0:
            assert mine in before, f"unit {n} was not asked for before it started"
        if n + 1 < len(units):
            k2, ft2 = units[n + 1]
            assert (f"e{k2}", 1000 * (k2 + 1) + 10_000 * ft2.tensor_idx, ft2.nbytes) in log
    experts = [x for x in log if x[0] != "base"]
    assert sorted(experts) == sorted({x for x in experts}) and len(experts) == len(units)
    assert [x for x in log if x[0] == "base"] == [("base", 10_000 * i, n) for i, n in enumerate([300, 200, 100])]


def test_the_window_is_bytes_beyond_the_starting_unit():
    """With the default window, one start asks for every unit that begins within READ_AHEAD_BYTES of
    the starting unit's end, and no further."""
    log: list = []
    mib = 2**20
    units, ahead = _setup([200 * mib, 100 * mib, 100 * mib, 100 * mib], 1, log)
    ahead.started(*units[0])
    asked = {x[1] // 10_000 for x in log if x[0] == "e0"}
    # unit 0 ends at 400 MiB (its expert's 200 and the base's 200); unit 1 begins there, unit 2 at
    # 600 (< 400 + 256), unit 3 at 800 (beyond)
    assert asked == {0, 1, 2}
    log.clear()
    ahead.started(*units[1])  # asked already: nothing again; unit 3 begins at 800 < 600 + 256
    assert {x[1] // 10_000 for x in log if x[0] == "e0"} == {3}


def test_registration_asks_the_kernel_for_every_expert_byte_ahead(tmp_path, monkeypatch):
    """A whole registration on local files: every expert tensor's byte range is asked for
    (POSIX_FADV_WILLNEED), and the catalog is the same as without any read-ahead."""
    folder = make_family(tmp_path / "fam", experts=3, size="tiny", seed=1)
    calls = []
    real = os.posix_fadvise

    def spy(fd, offset, n, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            calls.append((os.readlink(f"/proc/self/fd/{fd}"), offset, n))
        return real(fd, offset, n, advice)

    monkeypatch.setattr(os, "posix_fadvise", spy)
    cat = Catalog(tmp_path / "a.duckdb")
    cat.register([folder], base_model="base", threads=2)
    from mergedb.checkpoint import open_checkpoint

    for k in range(3):
        ck = open_checkpoint(folder / f"expert_{k:02d}")
        for fi, t in ck.tensors:
            path = str((ck.root / ck.files[fi].relpath).resolve())
            assert (path, t.start, t.nbytes) in calls, f"expert_{k:02d} {t.name} was not read ahead"
    monkeypatch.setattr(readahead.ReadAhead, "started", lambda self, k, ft: None)
    plain = Catalog(tmp_path / "b.duckdb")
    plain.register([folder], base_model="base", threads=2)
    q = "SELECT * EXCLUDE (checkpoint_id) FROM expert_blocks ORDER BY ALL"
    with cat.duckdb_connection() as a, plain.duckdb_connection() as b:
        assert repr(a.execute(q).fetchall()) == repr(b.execute(q).fetchall())


def test_units_run_in_the_scans_order_without_a_list_of_them():
    """readahead.Units is the list scan._scan ran before (each tensor's units together, expert 0 first,
    the tensors largest first, then by index), item by item, made when asked for."""
    tensors = [_tensor(i, n) for i, n in enumerate([100, 300, 100, 200])]
    listed = sorted(((k, ft) for k in range(3) for ft in tensors), key=lambda u: (-u[1].nbytes, u[1].tensor_idx, u[0]))
    units = readahead.Units.scan_order(tensors, 3)
    assert list(units) == listed and len(units) == 12
    assert [units[i] for i in range(-12, 12)] == listed + listed
    for bad in (12, -13):
        with pytest.raises(IndexError):
            units[bad]
    with pytest.raises(TypeError):
        units[0:2]


def test_a_unit_the_scan_does_not_run_is_refused():
    """ReadAhead.started with an (expert, tensor) that is not one of its units raises, as the dict it
    kept did, instead of asking for some other unit's bytes."""
    log: list = []
    units, ahead = _setup([300, 200], 2, log)
    for k, ft in ((2, units[0][1]), (0, _tensor(5, 100))):
        with pytest.raises(KeyError):
            ahead.started(k, ft)
    assert log == []
