"""The Ray executor and Ray registration against the local ones, whole-tensor references, and
worker deaths. One local Ray (2 CPUs, no dashboard) serves the whole module: starting it is slow."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import ray
from typer.testing import CliRunner

from mergedb import executor, rayexec, synth
from mergedb.catalog import Catalog
from mergedb.cli import app
from mergedb.errors import ChangedFileError, MergeDBError
from mergedb.manifest import MANIFEST
from mergedb.planner import PlanRequest
from tests.reference import cast_like, load_model, ref_merge

EXPERTS = ["expert_00", "expert_01", "expert_02"]
WEIGHTS = (1.0, 0.6, 0.3)
SHARD = 300_000  # bytes: the tiny family's ~1.9 MB of bf16 output in several shards
CASES = [
    ("ties", {"density": 0.3, "lambda": 0.9}),
    ("dare_ties", {"density": 0.4}),
    ("task_arithmetic", {"lambda": 0.7}),
]


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-fam")
    folder = synth.make_family(root / "family", experts=3, size="tiny", seed=21)
    cat = Catalog(root / "catalog.duckdb")
    cat.register([folder], base_model="base", block_size="64KiB")
    return folder, cat


def _plan(cat, method, params, budget="50%"):
    return cat.plan(PlanRequest("base", tuple(EXPERTS), method, budget, WEIGHTS, params, seed=9))


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != MANIFEST}


def _shards(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("model-*.safetensors"))


def _leftovers(out: Path) -> list[str]:
    """What a run left beside or in `out` other than a finished output (temporary, part, lock files)."""
    names = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]
    if out.is_dir():
        names += [p.name for p in out.iterdir() if p.name.startswith(".")]
    return names


@pytest.mark.parametrize("method,params", CASES)
def test_ray_equals_local_bit_for_bit(fam, tmp_path, method, params):
    folder, cat = fam
    plan = _plan(cat, method, params)
    xp = cat.execution_plan(plan.plan_id)
    local = executor.execute(xp, tmp_path / "local", max_shard_size=SHARD)
    remote = executor.execute(xp, tmp_path / "ray", max_shard_size=SHARD, write_shards=rayexec.shard_writer())
    got, want = _files(tmp_path / "ray"), _files(tmp_path / "local")
    assert sum(n.endswith(".safetensors") for n in want) >= 4  # several shards, so several tasks
    assert got == want
    doc_l = json.loads((tmp_path / "local" / MANIFEST).read_text())
    doc_r = json.loads((tmp_path / "ray" / MANIFEST).read_text())
    run_l, run_r = doc_l.pop("run"), doc_r.pop("run")
    assert doc_r == doc_l  # the deterministic part, content hash included
    for key in ("expert_bytes_logical", "base_bytes", "bytes_written", "files"):
        assert run_r[key] == run_l[key], key
    # the tasks' counters, summed: what the plan selected, and the whole base once per read tensor
    assert remote.expert_bytes == plan.selected_bytes == local.expert_bytes
    assert remote.physical_bytes >= 0 and remote.peak_rss > 0
    assert _leftovers(tmp_path / "ray") == []


def test_ray_equals_local_with_per_tensor_values_and_model_stock(fam, tmp_path):
    """The tables a task gets cut to its shard's tensors (tensor_params, model_stock's dots) still
    give the local bytes."""
    folder, cat = fam
    names = sorted(n for n, a in load_model(folder / "base").items() if a.dtype.kind == "f")
    per_tensor = pa.table(
        {
            "position": pa.array([i % 3 for i in range(len(names))], pa.int32()),
            "tensor": names,
            "param": ["weight"] * len(names),
            "value": [0.25 + 0.5 * (i % 4) for i in range(len(names))],
        }
    )
    plans = [
        cat.plan(
            PlanRequest("base", tuple(EXPERTS), "ties", "60%", WEIGHTS, {"density": 0.3}, tensor_params=per_tensor)
        ),
        cat.plan(PlanRequest("base", tuple(EXPERTS), "model_stock", "60%")),
    ]
    for plan in plans:
        xp = cat.execution_plan(plan.plan_id)
        assert xp.tensor_params is not None or xp.stock is not None
        local, on_ray = tmp_path / f"local-{plan.plan_id}", tmp_path / f"ray-{plan.plan_id}"
        executor.execute(xp, local, max_shard_size=SHARD)
        executor.execute(xp, on_ray, max_shard_size=SHARD, write_shards=rayexec.shard_writer())
        assert _files(on_ray) == _files(local)
        assert (
            json.loads((on_ray / MANIFEST).read_text())["content_hash"]
            == json.loads((local / MANIFEST).read_text())["content_hash"]
        )


@pytest.mark.parametrize("method,params", CASES[:2])
def test_ray_full_budget_equals_reference(fam, tmp_path, method, params):
    folder, cat = fam
    xp = cat.execution_plan(_plan(cat, method, params, budget="all").plan_id)
    executor.execute(xp, tmp_path / "out", max_shard_size=SHARD, write_shards=rayexec.shard_writer())
    got = load_model(tmp_path / "out")
    models = {n: load_model(folder / n) for n in ["base", *EXPERTS]}
    checked = 0
    for name, b in models["base"].items():
        if b.dtype.kind != "f":
            assert np.array_equal(got[name], b)
            continue
        full = ref_merge(
            method,
            params,
            list(WEIGHTS),
            b,
            [models[e][name] for e in EXPERTS],
            seed=9,
            expert_names=EXPERTS,
            tensor=name,
        )
        assert np.array_equal(got[name], cast_like(full, "bf16")), name
        checked += 1
    assert checked > 10


def test_killed_worker_is_retried_and_output_identical(fam, tmp_path):
    folder, cat = fam
    xp = cat.execution_plan(_plan(cat, "dare_ties", {"density": 0.4}).plan_id)
    executor.execute(xp, tmp_path / "local", max_shard_size=SHARD)
    marker = tmp_path / "killed"
    fault = rayexec.KillOnce(_shards(tmp_path / "local")[1], str(marker))
    executor.execute(xp, tmp_path / "ray", max_shard_size=SHARD, write_shards=rayexec.shard_writer(fault=fault))
    assert marker.exists()  # a worker really died mid-shard
    assert _files(tmp_path / "ray") == _files(tmp_path / "local")
    assert _leftovers(tmp_path / "ray") == []  # the killed attempt's part file is gone


def test_killed_worker_without_retries_fails_cleanly(fam, tmp_path):
    folder, cat = fam
    xp = cat.execution_plan(_plan(cat, "ties", {"density": 0.3}).plan_id)
    executor.execute(xp, tmp_path / "local", max_shard_size=SHARD)
    shard = _shards(tmp_path / "local")[2]
    fault = rayexec.KillOnce(shard, str(tmp_path / "killed"))
    out = tmp_path / "out"
    with pytest.raises(MergeDBError, match=f"{shard}.*lost its worker 1 times"):
        executor.execute(xp, out, max_shard_size=SHARD, write_shards=rayexec.shard_writer(retries=0, fault=fault))
    assert (tmp_path / "killed").exists()
    assert not out.exists() and _leftovers(out) == []


def test_more_threads_than_any_node_has_is_refused(fam, tmp_path):
    folder, cat = fam
    xp = cat.execution_plan(_plan(cat, "ties", {"density": 0.3}).plan_id)
    with pytest.raises(MergeDBError, match="--threads 3 asks each Ray task for 3 CPUs.*has 2; pass --threads 2"):
        executor.execute(xp, tmp_path / "out", write_shards=rayexec.shard_writer(threads=3))
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path / "out") == []


def test_task_that_raises_fails_cleanly_and_is_recorded(tmp_path):
    folder = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=4)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([folder], base_model="base", block_size="64KiB")
    plan = cat.plan(PlanRequest("base", None, "task_arithmetic", "all"))
    f = folder / "expert_01" / "model.safetensors"
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))  # changed since registration
    out = tmp_path / "out"
    with pytest.raises(ChangedFileError, match="expert_01"):
        cat.execute(plan.plan_id, out, max_shard_size=SHARD, write_shards=rayexec.shard_writer())
    assert not out.exists() and _leftovers(out) == []
    assert cat.sql("SELECT status FROM runs").column(0).to_pylist() == ["failed"]


def test_register_on_ray_stores_the_same_rows(tmp_path):
    folder = synth.make_family(tmp_path / "fam", experts=3, size="tiny", seed=31)
    local, on_ray = Catalog(tmp_path / "local.duckdb"), Catalog(tmp_path / "ray.duckdb")
    r1 = local.register([folder], base_model="base", block_size="64KiB")
    r2 = on_ray.register([folder], base_model="base", block_size="64KiB", scanner=rayexec.expert_scanner())
    assert r2.registered == r1.registered == ("base", "expert_00", "expert_01", "expert_02")
    assert r2.bytes_read == r1.bytes_read
    for table in ("checkpoints", "files", "tensors", "blocks", "expert_blocks", "expert_tensors"):
        q = f"SELECT * EXCLUDE (registered_at) FROM {table}" if table == "checkpoints" else f"SELECT * FROM {table}"
        rows = [sorted(map(str, c.sql(q).to_pylist())) for c in (local, on_ray)]
        assert rows[0] == rows[1] and rows[0], table


def test_cli_execute_and_register_with_ray(tmp_path):
    folder = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=6)
    db = str(tmp_path / "c.duckdb")
    runner = CliRunner()
    r = runner.invoke(app, ["register", str(folder), "--base-model", "base", "--ray", "local", "-c", db, "-q"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["plan", "--base", "base", "--all", "-m", "ties", "--density", "0.3", "-c", db])
    assert r.exit_code == 0, r.output
    args = ["execute", "1", "--max-shard-size", "400KB", "-c", db, "-q"]
    assert runner.invoke(app, [*args, "--out", str(tmp_path / "local")]).exit_code == 0
    r = runner.invoke(app, [*args, "--out", str(tmp_path / "ray"), "--ray", "local"])
    assert r.exit_code == 0, r.output
    assert _files(tmp_path / "ray") == _files(tmp_path / "local")
    runs = Catalog(db).sql("SELECT status, expert_bytes FROM runs ORDER BY run_id").to_pylist()
    assert [x["status"] for x in runs] == ["ok", "ok"] and runs[0]["expert_bytes"] == runs[1]["expert_bytes"]


def test_cli_register_with_ray_gives_each_expert_task_its_threads(tmp_path):
    """`register --ray ADDRESS --threads N` ran every expert's scan on 1 CPU and 1 thread, --threads
    dropped without a word (code-health review): each task asks for N CPUs now, as execute --ray's do,
    so more than any node has is refused before anything is stored."""
    folder = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=6)
    db = tmp_path / "c.duckdb"
    n = int(ray.cluster_resources().get("CPU", 0)) if ray.is_initialized() else os.cpu_count()
    args = ["register", str(folder), "--base-model", "base", "--ray", "local", "-c", str(db), "-q"]
    r = CliRunner().invoke(app, [*args, "--threads", str(n + 1)])
    assert r.exit_code == 1 and f"--threads {n + 1} asks each Ray task for {n + 1} CPUs" in r.output, r.output
    assert not db.exists() or Catalog(db).sql("SELECT count(*) FROM checkpoints").column(0)[0].as_py() == 0


def test_unreachable_or_malformed_address_is_refused_quickly(monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh process
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for address, needle in [
        (f"127.0.0.1:{port}", f"cannot reach the Ray head at 127.0.0.1:{port}"),
        (f"ray://127.0.0.1:{port}", "cannot reach the Ray head"),
        ("head-without-port", "is not a Ray address"),
    ]:
        with pytest.raises(MergeDBError, match=needle), rayexec.session(address):
            pass


def test_an_address_that_answers_but_is_no_ray_head_is_refused_quickly(monkeypatch, tmp_path):
    """--ray host:8265 (the dashboard) or any server that is not Ray's: the TCP check passed and
    ray.init waited forever, holding the output's lock (review, 2026-12-03). gRPC greets at once with
    an HTTP/2 SETTINGS frame; a server that does not is refused, before execute takes the lock."""
    import http.server
    import threading
    import time

    gcs = ray.get_runtime_context().gcs_address
    rayexec._check_reachable(gcs)  # the real head passes
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh process
    t0 = time.monotonic()
    try:
        with pytest.raises(MergeDBError, match=f"{address} answers, but not as a Ray head .* not the dashboard"):
            rayexec.shard_writer(address)
        with pytest.raises(MergeDBError, match="not as a Ray head"), rayexec.session(f"ray://{address}"):
            pass
    finally:
        server.shutdown()
    assert time.monotonic() - t0 < 20

    def no_session_folder(**kw):
        raise PermissionError(13, "Permission denied", "/tmp/ray-of-another-user/ray")

    monkeypatch.setattr(ray, "init", no_session_folder)  # Ray's session folder is another user's
    with pytest.raises(MergeDBError, match="Ray could not start .*set RAY_TMPDIR to a folder of yours"):
        with rayexec.session("local"):
            pass


def test_mergedb_works_without_ray_and_says_how_to_get_it(tmp_path):
    """In a process where `import ray` fails: mergedb imports and runs, --ray names the extra."""
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "import mergedb, mergedb.cli, mergedb.rayexec\n"
        "from typer.testing import CliRunner\n"
        "r = CliRunner().invoke(mergedb.cli.app, ['register', sys.argv[1], '--ray', 'auto', '-c', sys.argv[2]])\n"
        "print(r.exit_code, r.output)\n"
    )
    fam = synth.make_family(tmp_path / "fam", experts=1, size="tiny", seed=2)
    p = subprocess.run(
        [sys.executable, "-c", code, str(fam), str(tmp_path / "c.duckdb")], capture_output=True, text=True, check=True
    )
    assert p.stdout.startswith("1 ") and "pip install 'mergedb[ray]'" in p.stdout, p.stdout + p.stderr
    assert not (tmp_path / "c.duckdb").exists()  # refused before anything was read or written


def test_readme_ray_example_runs(tmp_path, monkeypatch):
    import re

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    code = re.search(r"## Running on Ray\n.*?```python\n(.*?)```", text, re.S).group(1)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    assert ray.is_initialized()  # the module's session was reused, and left running
    assert len(list((tmp_path / "merged").glob("model-*.safetensors"))) >= 2
    assert Catalog(tmp_path / "catalog.duckdb").sql("SELECT status FROM runs").column(0).to_pylist() == ["ok"]


def test_ray_over_http_records_the_bytes_fetched(tmp_path):
    """Each Ray task asked whether its inputs were remote after closing them (always no), so a Ray run
    over URLs recorded no run.remote_bytes_fetched; the same run without Ray did."""
    from mergedb.sources import RemoteOptions
    from tests.test_remote import RangeServer, _data_start

    folder = synth.make_family(tmp_path / "family", experts=2, size="tiny", seed=21)
    server = RangeServer(folder)
    try:
        cat = Catalog(tmp_path / "c.duckdb")
        cat.register([f"{server.url}/base"], base=True, block_size="64KiB")
        cat.register([f"{server.url}/expert_00", f"{server.url}/expert_01"], base_model="base")
        xp = cat.execution_plan(cat.plan(PlanRequest("base", None, "task_arithmetic", "50%")).plan_id)
        server.log.clear()  # registration read the base twice
        executor.execute(xp, tmp_path / "ray", max_shard_size=SHARD, write_shards=rayexec.shard_writer())
    finally:
        server.close()
    run = json.loads((tmp_path / "ray" / MANIFEST).read_text())["run"]
    assert run["remote_bytes_fetched"] >= run["expert_bytes_logical"] + run["base_bytes"] > 0
    # each task fetched ahead the base requests of its own tensors only: before, every task declared
    # the whole base, and its 16 MiB requests and read-ahead fetched the base ~4× in all (remote review)
    base = folder / "base" / "model.safetensors"
    start = _data_start(base)
    served = sum(e.body for e in server.log if e.path == "base/model.safetensors" and e.start >= start)
    tasks = len(_shards(tmp_path / "ray"))
    assert tasks > 2 and served <= base.stat().st_size - start + tasks * RemoteOptions().gap_bytes


def test_verify_reaches_the_shards_writer_or_is_refused(tmp_path):
    """verify=True beside a Ray shard writer built without it was ignored: an expert changed in place
    (size and time kept) was merged, installed and recorded ok (review, 2026-12-03). A writer that
    does not verify is refused before anything is read; one that does finds the change."""
    folder = synth.make_family(tmp_path / "fam", experts=2, size="tiny", seed=4)
    cat = Catalog(tmp_path / "c.duckdb")
    cat.register([folder], base_model="base", block_size="64KiB")
    plan = cat.plan(PlanRequest("base", None, "task_arithmetic", "all"))
    f = folder / "expert_01" / "model.safetensors"
    st = f.stat()
    data = bytearray(f.read_bytes())
    n = int.from_bytes(data[:8], "little")
    lo, hi = json.loads(data[8 : 8 + n])["lm_head.weight"]["data_offsets"]
    data[8 + n + (lo + hi) // 2] ^= 0x40  # a byte inside a changed tensor: same size, the time put back below
    f.write_bytes(bytes(data))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    out = tmp_path / "out"
    with pytest.raises(MergeDBError, match=r"verify=True with write_shards: .*shard_writer\(\.\.\., verify=True\)"):
        cat.execute(plan.plan_id, out, verify=True, write_shards=rayexec.shard_writer())
    assert not out.exists() and _leftovers(out) == []
    with pytest.raises(MergeDBError, match="does not match its registered hash"):
        cat.execute(plan.plan_id, out, verify=True, write_shards=rayexec.shard_writer(verify=True))
    assert not out.exists() and _leftovers(out) == []
