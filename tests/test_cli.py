"""The CLI: every command has help with an example; commands work end to end."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from mergedb import synth
from mergedb.cli import app

runner = CliRunner(env={"COLUMNS": "250"})


def test_every_command_has_help_with_example():
    commands = get_command(app).commands
    assert {"register", "sql", "ls", "show", "synth"} <= set(commands)
    for name in commands:
        res = runner.invoke(app, [name, "--help"])
        assert res.exit_code == 0, name
        assert "Example:" in res.output, name


def test_register_ls_show_sql(tmp_path):
    fam = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=21)
    db = str(tmp_path / "c.duckdb")
    res = runner.invoke(app, ["register", str(fam), "--base-model", "base", "-c", db])
    assert res.exit_code == 0, res.output
    assert "registered 3" in res.output
    res = runner.invoke(app, ["ls", "-c", db])
    assert res.exit_code == 0 and "expert_01" in res.output
    res = runner.invoke(app, ["show", "expert_00", "-c", db])
    assert res.exit_code == 0 and "lm_head" in res.output
    # a base has no per-tensor delta rows: csv still gives the expert's header, json an empty list
    header = runner.invoke(app, ["show", "expert_00", "-c", db, "-f", "csv"]).output.splitlines()[0]
    res = runner.invoke(app, ["show", "base", "-c", db, "-f", "csv"])
    assert res.exit_code == 0 and res.output.splitlines() == [header] and "tensor" in header
    assert json.loads(runner.invoke(app, ["show", "base", "-c", db, "-f", "json"]).output) == []
    res = runner.invoke(
        app, ["sql", "SELECT expert, total_bytes FROM expert_costs ORDER BY expert", "-c", db, "-f", "json"]
    )
    rows = json.loads(res.output)
    assert [r["expert"] for r in rows] == ["expert_00", "expert_01"]
    res = runner.invoke(app, ["sql", "SELECT count(*) AS n FROM checkpoints", "-c", db, "-f", "csv"])
    assert res.output.splitlines() == ["n", "3"]
    res = runner.invoke(app, ["sql", "SELECT 1", "-c", db, "-f", "xml"])
    assert res.exit_code == 1 and "unknown --format" in res.output


def test_console_script_subprocess(tmp_path):
    exe = shutil.which("mergedb", path=os.path.dirname(sys.executable))
    assert exe, "the mergedb console script should be installed next to python"
    out = subprocess.run([exe, "synth", str(tmp_path / "f"), "--experts", "1"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    out = subprocess.run(
        [exe, "register", str(tmp_path / "f"), "--base-model", "base", "-c", str(tmp_path / "c.duckdb")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    out = subprocess.run([exe, "show", "nope", "-c", str(tmp_path / "c.duckdb")], capture_output=True, text=True)
    assert out.returncode == 1 and "no checkpoint named 'nope'" in out.stderr and "Traceback" not in out.stderr
    # synth never writes over a model (it would overwrite it file by file): a second run into f is refused
    before = (tmp_path / "f" / "base" / "model.safetensors").read_bytes()
    out = subprocess.run(
        [exe, "synth", str(tmp_path / "f"), "--experts", "1", "--seed", "9"], capture_output=True, text=True
    )
    assert out.returncode == 1 and "base exists; synth writes new checkpoints there" in out.stderr, out.stderr
    assert (tmp_path / "f" / "base" / "model.safetensors").read_bytes() == before


def test_demo_runs_and_reports(tmp_path):
    res = runner.invoke(app, ["demo", "--dir", str(tmp_path / "d"), "--size", "tiny", "--experts", "3"])
    assert res.exit_code == 0, res.output
    assert "100%" in res.output and "10%" in res.output


def test_readme_library_example_runs(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    code = re.search(r"## Library quickstart\n\n```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    assert (tmp_path / "merged" / "mergedb_manifest.json").is_file()


def test_execute_process_ends_with_its_output_status_and_atexit_handlers(tmp_path, tiny_family):
    """An execute process ends without the interpreter's teardown (cli._exit_now): what it prints,
    its exit status and other atexit handlers are as an ordinary exit's, for a merge and an error."""
    from mergedb.catalog import Catalog

    db = str(tmp_path / "c.duckdb")
    Catalog(db).register([tiny_family], base_model="base")
    plan = ["plan", "--base", "base", "--all", "--method", "ties", "-c", db]
    subprocess.run([sys.executable, "-m", "mergedb.cli", *plan], check=True, capture_output=True)
    code = (
        "import atexit, os, runpy, sys, threading\n"
        "atexit.register(lambda: print('ATEXIT RAN', flush=True))\n"
        # the interpreter's shutdown calls these before the atexit handlers; the early end does not
        "threading._register_atexit(lambda: os.write(1, b'TEARDOWN RAN\\n'))\n"
        "sys.argv = ['mergedb', *sys.argv[1:]]\n"
        "runpy.run_module('mergedb.cli', run_name='__main__')\n"
    )
    # the probe works: a command that ends the ordinary way runs the teardown
    plain = subprocess.run([sys.executable, "-c", code, "ls", "-c", db], capture_output=True, text=True)
    assert plain.returncode == 0 and "TEARDOWN RAN" in plain.stdout, plain.stdout + plain.stderr
    run = [sys.executable, "-c", code, "execute"]
    ok = subprocess.run(run + ["1", "--out", str(tmp_path / "o"), "-c", db], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("wrote ") and ok.stdout.rstrip().endswith("ATEXIT RAN")
    assert "TEARDOWN RAN" not in ok.stdout  # the early end was taken
    assert (tmp_path / "o" / "model.safetensors").exists()
    bad = subprocess.run(run + ["7", "--out", str(tmp_path / "p"), "-c", db], capture_output=True, text=True)
    assert bad.returncode == 1 and "no plan matching '7'" in bad.stderr and "Traceback" not in bad.stderr
    assert bad.stdout.strip() == "ATEXIT RAN"  # a failed execute ends early too: no teardown line
    # a program calling cli.main() keeps running after an execute, a failed one, and a later command
    host = (
        "import sys\n"
        "from mergedb import cli\n"
        "for argv in sys.argv[1:]:\n"
        "    sys.argv = ['mergedb', *argv.split('|')]\n"
        "    try:\n"
        "        cli.main()\n"
        "    except SystemExit as e:\n"
        "        print('HOST GOT', e.code, flush=True)\n"
        "print('HOST CONTINUES', flush=True)\n"
    )
    calls = [f"execute|1|--out|{tmp_path / 'h'}|-c|{db}", f"execute|7|--out|{tmp_path / 'q'}|-c|{db}", "--version"]
    res = subprocess.run([sys.executable, "-c", host, *calls], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("HOST GOT") == 3 and res.stdout.rstrip().endswith("HOST CONTINUES"), res.stdout
    assert (tmp_path / "h" / "model.safetensors").exists()


@pytest.mark.parametrize("command", ["synth", "demo"])
def test_synth_and_demo_on_a_disk_that_fills_leave_no_partial_checkpoint(tmp_path, command):
    """A write cut short (here a file size limit, as a full disk cuts it) left a truncated
    model.safetensors that looked like a checkpoint and blocked a rerun, with advice to choose
    another folder (synth) or a traceback (demo). Now: a message saying what to free, nothing left."""
    import resource

    exe = shutil.which("mergedb", path=os.path.dirname(sys.executable))

    def limit():  # below a model file's 1.8 MB: the first model written is cut short
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))

    args = (
        ["synth", str(tmp_path / "a" / "b" / "f"), "--experts", "2"]  # folders it makes, removed again
        if command == "synth"
        else ["demo", "--dir", str(tmp_path / "f"), "--size", "tiny", "--experts", "2"]
    )
    res = subprocess.run([exe, *args], capture_output=True, text=True, preexec_fn=limit)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "File too large; nothing was left behind, free space or raise the file size limit" in res.stderr
    assert not list(tmp_path.rglob("*.safetensors"))
    assert command == "demo" or not (tmp_path / "a").exists()
    again = subprocess.run([exe, *args], capture_output=True, text=True)
    assert again.returncode == 0, again.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["--experts", "1", "--seed", "-1"], "--seed must be a whole number"),
        (["--experts", "1000000000"], "--experts must be a whole number from 0 to 10000"),
        (["--experts", "-1"], "--experts must be a whole number from 0 to 10000"),
    ],
)
def test_synth_refuses_a_negative_seed_and_an_impossible_count_before_writing(tmp_path, args, words):
    """--seed -1 reached numpy (a traceback), and --experts 1000000000 listed a billion folder names
    before writing anything (GBs of memory; review, 2026-12-02)."""
    from typer.testing import CliRunner

    from mergedb.cli import app
    from mergedb.errors import MergeDBError

    res = CliRunner().invoke(app, ["synth", str(tmp_path / "f"), *args])
    assert res.exit_code == 1 and words in res.output and not (tmp_path / "f").exists(), res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), res.exception
    for bad in ({"experts": 1.5}, {"experts": "2"}, {"shard_size": "5GB"}, {"seed": -1}):
        with pytest.raises(MergeDBError):
            synth.make_family(tmp_path / "g", **{"experts": 1, **bad})
    assert not (tmp_path / "g").exists()
