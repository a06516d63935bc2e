"""Per-tensor block sizes (`--block-size auto`, issue 16): the vocabulary tensors in small row blocks,
every other tensor in 4 MiB blocks; row ranges written out by hand, the stored layout, and merges
of an auto-registered family against whole-tensor references."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

from mergedb import executor, synth
from mergedb.catalog import Catalog
from mergedb.cli import app
from mergedb.errors import MergeDBError
from mergedb.layout import family_layout, vocab_size
from mergedb.planner import PlanRequest
from mergedb.tensorfile import TensorInfo
from mergedb.units import BlockSizes, block_sizes
from tests.reference import block_rows, cast_like, load_model, ref_merge

MiB = 2**20
AUTO = BlockSizes(4 * MiB, 64 * 1024, 64)


def _t(name: str, shape: tuple[int, ...], dtype: str = "BF16", itemsize: int = 2) -> TensorInfo:
    n = int(np.prod(shape)) * itemsize
    return TensorInfo(name, dtype, shape, 0, n)


def _rows(tensors: list[TensorInfo], rule, vocab) -> dict[str, list[tuple[int, int]]]:
    return {ft.name: [(b.row_start, b.row_end) for b in ft.blocks] for ft in family_layout(tensors, rule, vocab)}


def test_auto_rule_against_hand_computed_rows():
    # vocabulary 1000, hidden 256 bf16: 512-byte rows, so 64 KiB is 128 rows, capped at 64 rows;
    # a (20000, 256) bf16 matrix is 10,240,000 bytes: 4 MiB blocks of 8192 rows
    tensors = [
        _t("model.embed_tokens.weight", (1000, 256)),
        _t("model.layers.0.self_attn.q_proj.weight", (256, 256)),
        _t("model.layers.0.mlp.up_proj.weight", (20000, 256)),
        _t("model.norm.weight", (256,)),
        _t("lm_head.weight", (1000, 256)),
    ]
    vocab_rows = [(0, 64), (64, 128), (128, 192), (192, 256), (256, 320), (320, 384), (384, 448), (448, 512),
                  (512, 576), (576, 640), (640, 704), (704, 768), (768, 832), (832, 896), (896, 960),
                  (960, 1000)]  # fmt: skip
    assert _rows(tensors, AUTO, 1000) == {
        "model.embed_tokens.weight": vocab_rows,
        "model.layers.0.self_attn.q_proj.weight": [(0, 256)],
        "model.layers.0.mlp.up_proj.weight": [(0, 8192), (8192, 16384), (16384, 20000)],
        "model.norm.weight": [(0, 1)],  # 1-D: one block
        "lm_head.weight": vocab_rows,  # untied head: split like the embedding
    }
    # wide rows (hidden 4096 bf16: 8 KiB a row): 64 KiB is 8 rows, below the 64-row cap
    wide = [_t("model.embed_tokens.weight", (20, 4096)), _t("model.layers.0.mlp.down_proj.weight", (20, 4096))]
    assert _rows(wide, AUTO, 20) == {
        "model.embed_tokens.weight": [(0, 8), (8, 16), (16, 20)],
        # dim 0 equals the vocabulary size: counts as a vocabulary tensor, whatever its name
        "model.layers.0.mlp.down_proj.weight": [(0, 8), (8, 16), (16, 20)],
    }
    # an explicit vocabulary block has no row cap: 16 KiB of 512-byte rows is 32 rows
    explicit = block_sizes("4MiB", "16KiB")
    assert explicit == BlockSizes(4 * MiB, 16 * 1024, None)
    assert _rows(tensors[:1], explicit, 1000)["model.embed_tokens.weight"][:2] == [(0, 32), (32, 64)]
    # no vocabulary found: every tensor at the 4 MiB size
    assert _rows(tensors, AUTO, None) == {t.name: block_rows(t.shape, 2, 4 * MiB) for t in tensors}
    # a plain size: the same size for every tensor, vocabulary or not
    assert _rows(tensors, block_sizes("64KiB"), 1000) == {t.name: block_rows(t.shape, 2, 64 * 1024) for t in tensors}


def test_vocab_size_detection():
    llama = [_t("model.embed_tokens.weight", (1000, 64)), _t("model.layers.0.mlp.up_proj.weight", (128, 64))]
    tied = llama[:1]
    untied = [*llama, _t("lm_head.weight", (1000, 64))]
    assert vocab_size(llama) == vocab_size(tied) == vocab_size(untied) == 1000  # no config.json: the names
    assert vocab_size(untied, config_vocab=1000) == 1000
    assert vocab_size(untied, config_vocab=128) == 128  # config.json wins when a tensor has that many rows
    assert vocab_size(untied, config_vocab=999) == 1000  # … and is ignored when none has
    gpt2 = [_t("transformer.wte.weight", (50257, 8)), _t("transformer.wpe.weight", (1024, 8))]
    assert vocab_size(gpt2) == 50257  # position embeddings are not token-indexed
    neox = [_t("gpt_neox.embed_in.weight", (500, 8)), _t("embed_out.weight", (500, 8))]
    meta = [_t("tok_embeddings.weight", (300, 8)), _t("output.weight", (300, 8))]
    assert (vocab_size(neox), vocab_size(meta)) == (500, 300)
    bert = [
        _t("bert.embeddings.word_embeddings.weight", (700, 8)),
        _t("bert.encoder.0.attention.output.dense.weight", (8, 8)),
    ]
    assert vocab_size(bert) == 700
    assert vocab_size([_t("model.layers.0.mlp.up_proj.weight", (128, 64)), _t("norm.weight", (64,))]) is None
    assert vocab_size([_t("embed_tokens.weight", (1000,))]) is None  # 1-D: no rows to index


def _blocks(cat: Catalog) -> dict[str, list[tuple[int, int]]]:
    rows = cat.sql(
        "SELECT t.name, b.row_start, b.row_end FROM blocks b JOIN family_tensors t USING (base_id, tensor_idx) "
        "ORDER BY t.tensor_idx, b.block_idx"
    ).to_pylist()
    out: dict[str, list[tuple[int, int]]] = {}
    for r in rows:
        out.setdefault(r["name"], []).append((r["row_start"], r["row_end"]))
    return out


def _expected(fam) -> dict[str, list[tuple[int, int]]]:
    """The auto layout of a tiny synth family, from the definition: vocabulary 2048 rows of 128 bf16
    (256 bytes: 64 KiB is 256 rows, capped at 64), every other tensor in 4 MiB blocks."""
    out = {}
    for name, arr in load_model(fam / "base").items():
        vocab = arr.ndim == 2 and arr.shape[0] == 2048
        itemsize = 2 if arr.dtype.kind == "f" else arr.itemsize  # bf16 on disk (loaded as float32)
        out[name] = [(r, r + 64) for r in range(0, 2048, 64)] if vocab else block_rows(arr.shape, itemsize, 4 * MiB)
    return out


@pytest.fixture(scope="module")
def auto_family(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto")
    fam = synth.make_family(root / "fam", experts=3, size="tiny", seed=16)
    cat = Catalog(root / "c.duckdb")
    cat.register([fam / "base"], base=True, block_size="auto")
    cat.register([fam / "expert_00", fam / "expert_01"], base_model="base")
    cat.register([fam / "expert_02"], base_model="base")  # a later expert uses the stored layout
    return fam, cat


def test_registered_auto_catalog_stores_the_rows(auto_family):
    fam, cat = auto_family
    got = _blocks(cat)
    assert got == _expected(fam)
    assert len(got["model.embed_tokens.weight"]) == len(got["lm_head.weight"]) == 32
    base = cat.sql(
        "SELECT block_size, vocab_block_size, vocab_block_rows, vocab_size FROM checkpoints WHERE name = 'base'"
    ).to_pylist()
    assert base == [{"block_size": 4 * MiB, "vocab_block_size": 64 * 1024, "vocab_block_rows": 64, "vocab_size": 2048}]
    n_blocks = sum(len(v) for v in got.values())
    per_expert = cat.sql(
        "SELECT c.name, count(*) AS n FROM expert_blocks e JOIN checkpoints c USING (checkpoint_id) "
        "GROUP BY 1 ORDER BY 1"
    ).to_pylist()
    mergeable = load_model(fam / "base")
    n_float = sum(len(v) for k, v in got.items() if mergeable[k].dtype.kind == "f")
    assert [r["n"] for r in per_expert] == [n_float] * 3 and n_float < n_blocks  # the int buffer has no stats
    # registering again: unchanged, same layout
    res = cat.register([fam], base_model="base", block_size="auto")
    assert res.registered == () and set(res.unchanged) == {"base", "expert_00", "expert_01", "expert_02"}
    assert _blocks(cat) == got


def test_auto_without_config_json_finds_the_vocabulary_by_name(auto_family, tmp_path):
    fam, _ = auto_family
    shutil.copytree(fam / "base", tmp_path / "base")
    (tmp_path / "base" / "config.json").unlink()
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([tmp_path / "base"], base=True, block_size="auto")
    assert _blocks(cat) == _expected(fam)
    assert cat.sql("SELECT vocab_size FROM checkpoints").to_pylist() == [{"vocab_size": 2048}]


@pytest.mark.parametrize(
    "method,params", [("task_arithmetic", {"lambda": 0.7}), ("ties", {"density": 0.2, "lambda": 0.9})]
)
def test_full_budget_on_auto_layout_equals_reference(auto_family, tmp_path, method, params):
    fam, cat = auto_family
    experts = ["expert_00", "expert_01", "expert_02"]
    weights = (1.0, 0.6, 0.3)
    plan = cat.plan(PlanRequest("base", tuple(experts), method, "all", weights, params))
    executor.execute(cat.execution_plan(plan.plan_id), tmp_path / "out")
    got = load_model(tmp_path / "out")
    models = {n: load_model(fam / n) for n in ["base", *experts]}
    for name, b in models["base"].items():
        if b.dtype.kind != "f":
            assert np.array_equal(got[name], b)
            continue
        full = ref_merge(
            method, params, list(weights), b, [models[e][name] for e in experts], expert_names=experts, tensor=name
        )
        assert np.array_equal(got[name], cast_like(full, "bf16")), (method, name)


def test_partial_budget_reads_vocabulary_rows_in_small_blocks(auto_family):
    fam, cat = auto_family
    plan = cat.plan(PlanRequest("base", None, "task_arithmetic", "10%", params={"lambda": 1.0}))
    xp = cat.execution_plan(plan.plan_id)
    sizes = {t.name: len(t.rows) for t in xp.tensors}
    assert sizes["model.embed_tokens.weight"] == 32 and sizes["lm_head.weight"] == 32
    assert plan.selected_bytes <= plan.budget_bytes


@pytest.mark.parametrize("bad", ["autox", "automatic", "auto4MiB", ""])
def test_bad_block_size_is_a_clear_error(tmp_path, bad):
    with pytest.raises(MergeDBError, match="block size .*write auto or a number of bytes"):
        block_sizes(bad)
    fam = synth.make_family(tmp_path / "fam", experts=0, size="tiny", seed=1)
    with pytest.raises(MergeDBError, match="e.g. 4MiB"):
        Catalog(tmp_path / "c.duckdb").register([fam / "base"], base=True, block_size=bad)
    with pytest.raises(MergeDBError, match="vocabulary block size '0' must be between 1B and 1TiB"):
        block_sizes("auto", "0")
    res = CliRunner().invoke(
        app, ["register", str(fam / "base"), "--base", "-q", "-c", str(tmp_path / "c.duckdb"), "--block-size", bad]
    )
    assert res.exit_code != 0 and "write auto or a number of bytes" in res.output, res.output


def test_cli_auto_and_explicit_vocab_block(tmp_path):
    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=2)
    db = tmp_path / "c.duckdb"
    res = CliRunner().invoke(
        app, ["register", str(fam), "--base-model", "base", "-q", "-c", str(db), "--block-size", "AUTO"]
    )
    assert res.exit_code == 0, res.output
    assert _blocks(Catalog(db)) == _expected(fam)
    db2 = tmp_path / "d.duckdb"
    res = CliRunner().invoke(
        app,
        [
            "register",
            str(fam / "base"),
            "--base",
            "-q",
            "-c",
            str(db2),
            "--block-size",
            "1MiB",
            "--vocab-block-size",
            "8KiB",
        ],
    )
    assert res.exit_code == 0, res.output
    got = _blocks(Catalog(db2))
    assert got["lm_head.weight"] == [(r, r + 32) for r in range(0, 2048, 32)]  # 8 KiB of 256-byte rows, no cap
    row = Catalog(db2).sql("SELECT block_size, vocab_block_size, vocab_block_rows FROM checkpoints").to_pylist()
    assert row == [{"block_size": MiB, "vocab_block_size": 8192, "vocab_block_rows": None}]


def _catalog_rows(cat: Catalog) -> tuple:
    return tuple(
        cat.sql(f"SELECT * FROM {t} ORDER BY ALL").to_pylist() for t in ("checkpoints", "blocks", "expert_blocks")
    )


def test_a_layout_asked_for_a_registered_base_with_another_is_refused(tmp_path):
    """The layout is fixed when the base is registered; asking for another one later (for the base
    again, or while adding experts) is an error that changes nothing, never silently ignored."""
    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=5)
    db = tmp_path / "c.duckdb"
    cat = Catalog(db)
    cat.register([fam / "base"], base=True, block_size="8KiB")
    cat.register([fam / "expert_00"], base_model="base")
    before = _catalog_rows(cat)
    for kwargs in ({"block_size": "auto"}, {"block_size": "16KiB"}, {"block_size": "8KiB", "vocab_block_size": "1KiB"}):
        with pytest.raises(MergeDBError, match=r"base 'base' is registered with blocks of 8\.0 KiB, not .*new catalog"):
            cat.register([fam / "expert_01"], base_model="base", **kwargs)
        with pytest.raises(MergeDBError, match="cannot change in place"):
            cat.register([fam / "base"], base=True, **kwargs)
        assert _catalog_rows(cat) == before
    res = CliRunner().invoke(
        app, ["register", str(fam / "expert_01"), "--base-model", "base", "-q", "-c", str(db), "--block-size", "auto"]
    )
    assert res.exit_code != 0 and "registered with blocks of 8.0 KiB" in res.output, res.output
    assert _catalog_rows(cat) == before
    # the same layout asked again, or none, is accepted: the base unchanged, the expert added
    assert cat.register([fam / "base"], base=True, block_size=8192).unchanged == ("base",)
    res = CliRunner().invoke(app, ["register", str(fam / "expert_01"), "--base-model", "base", "-q", "-c", str(db)])
    assert res.exit_code == 0, res.output
    names = {r["name"] for r in cat.sql("SELECT name FROM checkpoints").to_pylist()}
    assert names == {"base", "expert_00", "expert_01"}


def test_a_new_base_gets_the_auto_layout_by_default(tmp_path):
    """No --block-size: a new base is registered with `auto` (issue 16's measured default), in the
    library and the CLI; --block-size 4MiB still gives every tensor 4 MiB blocks (the old default),
    and an existing base registered so keeps its layout when experts are added without options."""
    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=3)
    cat = Catalog(tmp_path / "lib.duckdb")
    cat.register([fam / "base", fam / "expert_00"], base_model="base")
    assert _blocks(cat) == _expected(fam)
    res = CliRunner().invoke(
        app, ["register", str(fam), "--base-model", "base", "-q", "-c", str(tmp_path / "c.duckdb")]
    )
    assert res.exit_code == 0, res.output
    assert _blocks(Catalog(tmp_path / "c.duckdb")) == _expected(fam)
    uniform = Catalog(tmp_path / "u.duckdb")
    uniform.register([fam / "base"], base=True, block_size="4MiB")
    want = {
        n: block_rows(a.shape, 2 if a.dtype.kind == "f" else a.itemsize, 4 * MiB)
        for n, a in load_model(fam / "base").items()
    }
    assert _blocks(uniform) == want and len(want["lm_head.weight"]) == 1
    uniform.register([fam / "expert_00"], base_model="base")  # no option: the base's own layout
    assert _blocks(uniform) == want
    row = uniform.sql("SELECT block_size, vocab_block_size FROM checkpoints WHERE name = 'base'").to_pylist()
    assert row == [{"block_size": 4 * MiB, "vocab_block_size": None}]


@pytest.mark.parametrize(
    "method,params",
    [
        ("task_arithmetic", {"lambda": 0.7}),
        ("ties", {"density": 0.2}),
        ("dare_ties", {"density": 0.5}),
        ("della", {"density": 0.5, "epsilon": 0.1}),
        ("breadcrumbs_ties", {}),
    ],
)
@pytest.mark.parametrize("budget,dtype", [("all", None), ("30%", None), ("30%", "fp32")])
def test_spans_of_small_blocks_merge_exactly_as_blocks_one_by_one(
    auto_family, tmp_path, monkeypatch, method, params, budget, dtype
):
    """The executor merges runs of consecutive blocks with one expert set as one unit (one read per
    expert, one kernel call: merger.SPAN_BYTES); the output bytes equal those of block-by-block
    units (SPAN_BYTES = 0), DARE's and DELLA's draws included, and the spans do form; with --dtype
    fp32 every block is a unit (untouched ones convert the base), so spans also cover blocks no
    expert is read for."""
    from mergedb import merger

    _, cat = auto_family
    plan = cat.plan(PlanRequest("base", None, method, budget, params=params, seed=3))
    xp = cat.execution_plan(plan.plan_id)
    m = merger.Merger(xp, dtype=dtype)
    try:
        units = [u for ti in range(len(xp.tensors)) for u in m.units(ti)]
    finally:
        m.close()
    assert any(len(u.blocks) > 1 for u in units)  # spans formed on the vocabulary tensors
    if dtype is None:
        assert sorted((u.tensor_idx, b) for u in units for b in u.blocks) == sorted(
            (ti, b) for ti, blocks in xp.selected().items() for b in blocks
        )
    else:  # every block of every mergeable tensor
        sel = xp.selected()
        assert any(b not in sel.get(u.tensor_idx, {}) for u in units for b in u.blocks)
    spans = executor.execute(xp, tmp_path / "spans", dtype=dtype)
    monkeypatch.setattr(merger, "SPAN_BYTES", 0)
    one = executor.execute(xp, tmp_path / "one", dtype=dtype)
    assert spans.expert_bytes == one.expert_bytes == plan.selected_bytes
    for f in sorted((tmp_path / "one").glob("*.safetensors")):
        assert (tmp_path / "spans" / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.mark.parametrize("budget", ["all", "30%"])
def test_spans_under_slerp_rescale_blocks_no_expert_is_read_for(auto_family, tmp_path, monkeypatch, budget):
    """SLERP scales the base of every block (s0 + s1), so its units also cover blocks no expert is
    read for (an empty expert set): spans of those merge byte for byte as blocks one by one, and the
    spans do form."""
    from mergedb import merger

    _, cat = auto_family
    plan = cat.plan(PlanRequest("base", ("expert_01",), "slerp", budget, params={"t": 0.3}))
    xp = cat.execution_plan(plan.plan_id)
    m = merger.Merger(xp)
    try:
        units = [u for ti in range(len(xp.tensors)) for u in m.units(ti)]
    finally:
        m.close()
    sel = xp.selected()
    assert any(len(u.blocks) > 1 for u in units)
    if budget != "all":  # blocks of no expert, scaled all the same
        assert any(b not in sel.get(u.tensor_idx, {}) for u in units for b in u.blocks)
    spans = executor.execute(xp, tmp_path / "spans")
    monkeypatch.setattr(merger, "SPAN_BYTES", 0)
    one = executor.execute(xp, tmp_path / "one")
    assert spans.expert_bytes == one.expert_bytes == plan.selected_bytes
    for f in sorted((tmp_path / "one").glob("*.safetensors")):
        assert (tmp_path / "spans" / f.name).read_bytes() == f.read_bytes(), f.name


@pytest.mark.parametrize(
    "method,params,experts,dtype",
    [
        ("ties", {"density": 0.2}, None, "fp32"),  # --dtype: every block is a unit, untouched ones too
        ("slerp", {"t": 0.3}, ("expert_01",), None),  # the base of every block scaled
        ("dare_ties", {"density": 0.5}, None, None),
    ],
)
def test_slices_merge_exactly_as_whole_blocks(auto_family, tmp_path, monkeypatch, method, params, experts, dtype):
    """Blocks and spans merged slice by slice (slicefold.py; 1,000-byte slices) give the bytes of whole
    blocks, at a budget where some units read no expert (their slices only scale or convert the base),
    and they are sliced."""
    from mergedb import slicefold

    _, cat = auto_family
    plan = cat.plan(PlanRequest("base", experts, method, "30%", params=params, seed=3))
    xp = cat.execution_plan(plan.plan_id)
    monkeypatch.setattr(slicefold, "SLICE_BYTES", 2**40)  # no block is sliced
    whole = executor.execute(xp, tmp_path / "whole", dtype=dtype)
    monkeypatch.setattr(slicefold, "SLICE_BYTES", 1000)
    groups = []
    merge_sliced = slicefold.merge_sliced
    monkeypatch.setattr(
        slicefold,
        "merge_sliced",
        # groups of READ_AHEAD (a large block's): 0 where the unit reads no expert
        lambda m, ti, b, *a: groups.append(len(m._groups(ti, b, 1 << 30))) or merge_sliced(m, ti, b, *a),
    )
    sliced = executor.execute(xp, tmp_path / "sliced", dtype=dtype)
    assert sliced.expert_bytes == whole.expert_bytes == plan.selected_bytes
    assert any(groups) and (0 in groups or method == "dare_ties")
    for f in sorted((tmp_path / "whole").glob("*.safetensors")):
        assert (tmp_path / "sliced" / f.name).read_bytes() == f.read_bytes(), f.name
