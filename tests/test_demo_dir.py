"""`mergedb demo --dir D` never deletes what it did not write (issue 10, item 1)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from mergedb import synth
from mergedb.cli import app
from mergedb.demo import MARKER, _load, run_demo
from mergedb.errors import MergeDBError

TINY = {"experts": 2, "size": "tiny"}  # the smallest family: each demo run well under a second


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every entry under `root`: relative path -> file bytes (None for a folder)."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(root.rglob("*"))}


def _user_files(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "thesis.tex").write_bytes(b"\\documentclass{article}\n")
    (root / "nested" / "deeper").mkdir(parents=True)
    (root / "nested" / "weights.bin").write_bytes(bytes(range(256)))
    (root / "nested" / "deeper" / "notes.txt").write_text("keep me\n")


def test_user_folder_is_refused_and_left_byte_for_byte(tmp_path):
    d = tmp_path / "mine"
    _user_files(d)
    before = _snapshot(d)
    with pytest.raises(MergeDBError) as e:
        run_demo(d, **TINY)
    assert str(d) in str(e.value) and "empty or new --dir" in str(e.value)
    assert _snapshot(d) == before
    assert not (d / MARKER).exists()


def test_dot_in_a_non_empty_cwd_is_refused(tmp_path, monkeypatch):
    _user_files(tmp_path)
    before = _snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MergeDBError) as e:
        run_demo(".", **TINY)
    assert str(tmp_path) in str(e.value)  # "." is shown with its absolute path
    assert _snapshot(tmp_path) == before


def test_a_file_as_dir_is_refused(tmp_path):
    f = tmp_path / "f.txt"
    f.write_text("data\n")
    with pytest.raises(MergeDBError, match="is a file"):
        run_demo(f, **TINY)
    assert f.read_text() == "data\n"


def test_rerun_into_marked_folder_keeps_user_files(tmp_path):
    d = tmp_path / "demo"
    first = run_demo(d, **TINY)
    assert (d / MARKER).is_file()
    (d / "notes.txt").write_text("my notes\n")
    (d / "mine").mkdir()
    (d / "mine" / "a.bin").write_bytes(b"\x00\x01")
    (d / "merged-50" / "extra").write_text("x")  # inside what the demo owns: replaced with it
    second = run_demo(d, **TINY)
    assert (d / "notes.txt").read_text() == "my notes\n"
    assert (d / "mine" / "a.bin").read_bytes() == b"\x00\x01"
    assert not (d / "merged-50" / "extra").exists()
    assert [r.expert_bytes for r in second] == [r.expert_bytes for r in first]
    assert [r.rel_to_model for r in second] == [r.rel_to_model for r in first]


def test_existing_empty_folder_is_used_and_marked(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    rows = run_demo(d, **TINY)
    assert [r.budget for r in rows] == ["100%", "50%", "10%"]
    assert (d / MARKER).is_file() and (d / "family" / "base").is_dir()


def test_rerun_unlinks_a_symlink_without_touching_its_target(tmp_path):
    d = tmp_path / "demo"
    run_demo(d, **TINY)
    _user_files(tmp_path / "precious")
    before = _snapshot(tmp_path / "precious")
    for name in ("family", "merged-10"):
        target = d / name
        shutil.rmtree(target)
        target.symlink_to(tmp_path / "precious", target_is_directory=True)
    run_demo(d, **TINY)
    assert _snapshot(tmp_path / "precious") == before
    assert not (d / "family").is_symlink() and (d / "family" / "base").is_dir()


def test_cli_refuses_non_empty_dir_without_traceback(tmp_path):
    d = tmp_path / "mine"
    _user_files(d)
    before = _snapshot(d)
    res = CliRunner().invoke(app, ["demo", "--dir", str(d), "--size", "tiny", "--experts", "2"])
    assert res.exit_code == 1
    assert isinstance(res.exception, SystemExit)  # a clean exit, not an escaped exception
    assert "Traceback" not in res.output
    assert str(d) in res.output and "empty or new --dir" in res.output
    assert _snapshot(d) == before


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_demo_loader_matches_safetensors(tmp_path, dtype):
    """The demo reads outputs with mergedb's reader; torch's safetensors loader is the reference."""
    import torch
    from safetensors.torch import load_file

    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", dtype=dtype, seed=1, shard_size=700_000)
    got = _load(fam / "base")
    want: dict[str, np.ndarray] = {}
    for f in sorted((fam / "base").glob("*.safetensors")):
        want.update({k: v.to(torch.float32).numpy() for k, v in load_file(str(f)).items() if v.is_floating_point()})
    assert sorted(got) == sorted(want) and want
    for k in want:
        assert got[k].dtype == np.float32 and got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_unwritable_places_and_no_experts_are_refused_in_one_line(tmp_path):
    """demo --dir and synth under a file (or on a read-only file system) raised OSError tracebacks;
    demo --experts 0 generated and registered a family before failing."""
    (tmp_path / "afile").write_text("x")
    for args, words in (
        (
            ["demo", "--dir", str(tmp_path / "afile" / "sub"), "--size", "tiny", "--experts", "2"],
            "cannot make demo folder",
        ),
        (["synth", str(tmp_path / "afile" / "fam")], "cannot write"),
        (["demo", "--dir", str(tmp_path / "none"), "--experts", "0"], "--experts must be from 1 to 10000 for a demo"),
    ):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 1 and words in res.output, (args, res.output)
        assert res.exception is None or isinstance(res.exception, SystemExit), (args, res.exception)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def test_demo_says_each_step_as_it_starts(tmp_path, monkeypatch):
    """demo() tells progress each step before it runs (the CLI shows it as a status line, -q: none);
    a progress that is not a function is refused before anything is written."""
    from contextlib import contextmanager

    from mergedb import demo, render

    steps: list[str] = []
    seen_out: list[bool] = []
    real_execute = demo.Catalog.execute

    def execute(self, *a, **k):  # the step is announced before its merge runs
        seen_out.append(steps[-1].startswith("merging at"))
        return real_execute(self, *a, **k)

    monkeypatch.setattr(demo.Catalog, "execute", execute)
    demo.demo(tmp_path / "d", repeats=2, progress=steps.append, **TINY)
    assert steps == [
        "generating a base and 2 tiny experts",
        "registering the family",
        "planning at 100%, 50%, 10%",
        *(f"merging at {b}, run {r} of 2" for r in (1, 2) for b in ("100%", "50%", "10%")),
        "comparing the merges",
    ]
    assert seen_out == [True] * 6
    with pytest.raises(MergeDBError, match="progress is a function or None"):
        demo.demo(tmp_path / "e", progress="yes", **TINY)
    assert not (tmp_path / "e").exists()

    shown: list[tuple[bool, str]] = []

    @contextmanager
    def status(quiet):
        yield None if quiet else (lambda step: shown.append((quiet, step)))

    monkeypatch.setattr(render, "status", status)
    for extra, d in (([], "f"), (["-q"], "g")):
        res = CliRunner().invoke(app, ["demo", "--dir", str(tmp_path / d), "--size", "tiny", "-k", "2", *extra])
        assert res.exit_code == 0, res.output
    assert [s for _, s in shown][:2] == ["generating a base and 2 tiny experts", "registering the family"]
    assert len(shown) == 3 + 9 + 1  # the default 3 runs of 3 budgets; none with -q


@pytest.mark.parametrize("bad", [{"size": "huge"}, {"method": "no_such_method"}, {"method": "linear"}])
def test_a_refused_demo_leaves_an_earlier_run_as_it_was(tmp_path, bad):
    """`demo --size huge` was refused only after the folder was prepared for a new run, which removed
    the earlier run's family, catalog and merges (review, 2026-12-03); and an unknown method (or one
    that takes no lambda) after a whole family was generated. Refused first; nothing touched."""
    d = tmp_path / "demo"
    run_demo(d, **TINY)
    before = _snapshot(d)
    with pytest.raises(MergeDBError, match="unknown size 'huge'|no_such_method|no parameter 'lambda'"):
        run_demo(d, **{**TINY, **bad})
    assert _snapshot(d) == before
    with pytest.raises(MergeDBError):
        run_demo(tmp_path / "new", **{**TINY, **bad})
    assert not (tmp_path / "new").exists()
