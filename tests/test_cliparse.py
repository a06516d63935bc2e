"""cliparse's pydantic-free coercion against typer's own (pydantic) coercion of the same values."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import typer.main
from typer._click.exceptions import BadParameter
from typer._coercion import build_runtime_param

from mergedb import cliparse
from mergedb.cli import app

COMMAND = typer.main.get_command(app)


def _param(command: str, name: str):
    return next(p for p in COMMAND.commands[command].params if p.name == name)


def _outcome(coerce, value, param):
    try:
        v = coerce(value, param=param, ctx=None)
    except BadParameter as e:
        return ("error", e.message)
    return (type(v), repr(v))  # repr: nan == nan


TEXT = ["", "x", "plan-1", " spaced ", "ü名", "a\udcffb", "a\0b", "5GB", "-1"]
NUMBERS = [
    "0",
    "7",
    "-3",
    "007",
    "+5",
    " 5",
    "5 ",
    "1_000",
    "12345678901234567890123",
    "1e3",
    "1.5",
    "-0",
    "-0.0",
    "0.1",
    ".5",
    "5.",
    "nan",
    "inf",
    "-inf",
    "abc",
    "",
    "3.14159265358979323846",
    "1.0000000000000002",
]


@pytest.mark.parametrize(
    ("command", "name", "values"),
    [
        ("execute", "plan_ref", TEXT + NUMBERS),  # str
        ("execute", "threads", NUMBERS + [0, 12, -1]),  # int | None
        ("execute", "wait", NUMBERS + [0.0, 2.5]),  # float
        ("execute", "out_dir", TEXT + ["."]),  # Path | None
        ("execute", "quiet", [True, False]),  # bool
    ],
)
def test_plain_coercion_equals_typers(command, name, values, tmp_path):
    param = _param(command, name)
    fast = cliparse.PlainParam(
        parameter_info=param.type_descriptor.parameter_info,
        annotation=param.type_descriptor.annotation,
        descriptor=param.type_descriptor,
    )
    slow = build_runtime_param(param.type_descriptor)
    for value in values:
        assert _outcome(fast._coerce_value, value, param) == _outcome(slow._coerce_value, value, param), value


def test_paths_that_exist_unreadable_or_given_as_path(tmp_path):
    param = _param("execute", "out_dir")
    fast = cliparse.PlainParam(
        parameter_info=param.type_descriptor.parameter_info, annotation=Path, descriptor=param.type_descriptor
    )
    slow = build_runtime_param(param.type_descriptor)
    (tmp_path / "f").write_text("x")
    locked = tmp_path / "locked"
    locked.write_text("x")
    os.chmod(locked, 0)
    for value in [str(tmp_path), str(tmp_path / "f"), str(locked), str(tmp_path / "missing"), tmp_path / "f"]:
        assert _outcome(fast._coerce_value, value, param) == _outcome(slow._coerce_value, value, param), value


def test_every_plain_parameter_of_the_cli_gets_it():
    for cmd in COMMAND.commands.values():
        for p in cmd.params:
            plain = p.type_descriptor.annotation in (str, int, float, Path, bool) and p.nargs == 1 and not p.multiple
            assert isinstance(p._runtime_param, cliparse.PlainParam) == plain, (cmd.name, p.name)


def test_a_typer_without_the_private_coercion_api_keeps_its_own(tmp_path):
    """cliparse uses typer 0.29's private modules; with a typer that lacks them the CLI still parses
    every option (typer's own coercion), instead of failing at import."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import typer._coercion as c\n"
        "del c.build_runtime_param\n"  # `from typer._coercion import …` now raises ImportError
        "from mergedb import cli, cliparse\n"
        "assert cliparse.build_runtime_param is None\n"
        "sys.argv = ['mergedb', 'synth', sys.argv[1], '--experts', '1', '--size', 'tiny']\n"
        "cli.main()\n"
    )
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "fam")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "fam" / "expert_00").is_dir()
