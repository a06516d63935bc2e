"""The bytes a plan's hash covers (planhash.py), against the textbook forms they were first made by:
`json.dumps(table.to_pylist(), sort_keys=True, default=str)`, and thresholds keyed by expert position
in (position, tensor_idx) order by Python's stable sort. A hash that changed would refuse every plan
stored before (`refuse_altered`), so the faster forms must give the same bytes, value for value."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mergedb import planhash


def textbook(t: pa.Table) -> bytes:
    return json.dumps(t.to_pylist(), sort_keys=True, default=str).encode()


def textbook_by_position(trims: pa.Table, ids: list[int]) -> bytes | None:
    at = {c: p for p, c in enumerate(ids)}
    rows = trims.to_pylist()
    if any(r["checkpoint_id"] not in at for r in rows):
        return None
    keyed = [{"position": at[r["checkpoint_id"]], **{k: v for k, v in r.items() if k != "checkpoint_id"}} for r in rows]
    keyed.sort(key=lambda r: (r["position"], r["tensor_idx"]))
    return json.dumps(keyed, sort_keys=True).encode()


def f32(x: float | None) -> float | None:
    return None if x is None else float(pa.array([x], pa.float32())[0].as_py())


_floats = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e-45]))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(-(2**63), 2**63 - 1), _floats, _floats, st.one_of(st.none(), st.booleans())),
        max_size=30,
    )
)
def test_numeric_tables_hash_as_their_json(rows):
    t = pa.table(
        {
            "tensor_idx": pa.array([r[0] for r in rows], pa.int64()),
            "t_lo": pa.array([f32(r[1]) for r in rows], pa.float32()),
            "weight": pa.array([r[2] for r in rows], pa.float64()),
            "exact": pa.array([r[3] for r in rows], pa.bool_()),
            "t_hi": pa.nulls(len(rows)),
        }
    )
    assert planhash._canonical_table(t) == textbook(t)


def test_tables_of_other_kinds_and_no_rows_hash_as_their_json():
    for t in (
        pa.table({}),
        pa.table({"a": pa.array([], pa.int32()), "b": pa.array([], pa.float32())}),
        pa.table({"name": ["x, y", 'q"'], "n": [1, 2]}),  # a text column: json's own path
        pa.table({"z": [math.nan, math.inf, -math.inf], "a": [1, 2, 3]}),
        pa.table({"a%%b": [1], "%s": [2.5], "é": [True]}),  # names that are format codes, or not ASCII
        pa.Table.from_arrays([pa.array([1, 2]), pa.array([3, 4])], names=["a", "a"]),  # a repeated name
        pa.table({"a": [1, 2]}).drop_columns(["a"]),  # rows but no column
    ):
        assert planhash._canonical_table(t) == textbook(t)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from([7, 3, 11, 5]), min_size=1, max_size=4, unique=True),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), _floats, st.booleans()), max_size=40),
)
def test_thresholds_by_position_are_the_stable_sort_of_their_rows(ids, rows):
    rows = [r for r in rows if r[0] < len(ids)]  # rows of the plan's experts (repeats included)
    trims = pa.table(
        {
            "checkpoint_id": pa.array([ids[r[0]] for r in rows], pa.int32()),
            "tensor_idx": pa.array([r[1] for r in rows], pa.int32()),
            "t_lo": pa.array([f32(r[2]) for r in rows], pa.float32()),
            "t_hi": pa.array([None] * len(rows), pa.float32()),
            "exact": pa.array([r[3] for r in rows], pa.bool_()),
        }
    )
    keyed = planhash.trims_by_position(trims, ids)
    assert keyed is not None
    assert planhash._canonical_table(keyed) == textbook_by_position(trims, ids)


def test_thresholds_of_another_checkpoint_have_no_form_by_position():
    trims = pa.table({"checkpoint_id": pa.array([3, 9], pa.int32()), "tensor_idx": pa.array([0, 0], pa.int32())})
    assert planhash.trims_by_position(trims, [3, 4]) is None
    assert textbook_by_position(trims, [3, 4]) is None


@pytest.mark.parametrize("n", [0, 1])
def test_no_thresholds_hash_as_an_empty_list(n):
    trims = pa.table({"checkpoint_id": pa.array([5] * n, pa.int32()), "tensor_idx": pa.array([2] * n, pa.int32())})
    keyed = planhash.trims_by_position(trims, [5])
    assert planhash._canonical_table(keyed) == textbook_by_position(trims, [5])
