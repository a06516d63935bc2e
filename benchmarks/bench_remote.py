"""Remote (a local HTTP server with Range support) against local-file execution, side by side.

On the bench family (benchmarks/cache/family-bench-20: the base and the first K experts), served
by a Range-capable HTTP server in a process of its own (`--serve`), which appends every request's
range and body bytes to a log file. The remote catalog registers the URLs (timed: registration
streams each file once); the local arm uses a copy of the cached local catalog. For each budget
(100%, 25%, 10%) both arms plan task_arithmetic over the same experts and run `mergedb execute`
in a fresh process, alternating, every file evicted from the page cache first (so the server
reads cold as the local executor does). Recorded: process wall, the executor's seconds, expert
bytes (logical), bytes fetched (the manifest's count and the server's log), peak RSS.

Run: python -m benchmarks.bench_remote [--k 4] [--repeats 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from mergedb import synth
from mergedb.catalog import Catalog
from mergedb.planner import PlanRequest

from .common import CACHE, evict, save

CLI = [sys.executable, "-m", "mergedb.cli"]
BUDGETS = ("100%", "25%", "10%")


def serve(root: Path, port_file: Path, log_file: Path) -> None:
    """Serve `root` over HTTP with single-range GETs; log 'METHOD path lo hi body' per request."""
    log = open(log_file, "a", buffering=1)  # noqa: SIM115 (open for the server's lifetime)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve(True)

        def do_GET(self) -> None:
            self._serve(False)

        def _serve(self, head: bool) -> None:
            rel = unquote(urlsplit(self.path).path).lstrip("/")
            path = root / rel
            if not path.is_file():
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            st = path.stat()
            lo, hi, status = 0, st.st_size, 200
            rng = self.headers.get("Range")
            if rng and not head:
                a, _, b = rng.removeprefix("bytes=").partition("-")
                lo, hi, status = int(a), min(int(b) + 1 if b else st.st_size, st.st_size), 206
            self.send_response(status)
            self.send_header("Content-Length", str(hi - lo))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", f'"{st.st_mtime_ns:x}-{st.st_size:x}"')
            self.send_header("Last-Modified", formatdate(st.st_mtime, usegmt=True))
            if status == 206:
                self.send_header("Content-Range", f"bytes {lo}-{hi - 1}/{st.st_size}")
            self.end_headers()
            sent = 0
            if not head:
                with open(path, "rb") as f:
                    f.seek(lo)
                    while sent < hi - lo:
                        chunk = f.read(min(8 * 2**20, hi - lo - sent))
                        self.wfile.write(chunk)
                        sent += len(chunk)
            log.write(f"{self.command} {rel} {lo} {hi} {sent}\n")

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port_file.write_text(str(httpd.server_port))
    httpd.serve_forever()


def _served(log_file: Path) -> int:
    return sum(int(line.split()[4]) for line in log_file.read_text().splitlines() if line.strip())


def _execute(catalog: Path, plan_id: int, out: Path, files: list[Path]) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    evict(files)
    t0 = time.perf_counter()
    subprocess.run([*CLI, "execute", str(plan_id), "--out", str(out), "--catalog", str(catalog), "-q"], check=True)
    wall = time.perf_counter() - t0
    m = json.loads((out / "mergedb_manifest.json").read_text())
    r = m["run"]
    return {
        "wall": wall,
        "seconds": r["seconds"],
        "expert_bytes": r["expert_bytes_logical"],
        "base_bytes": r["base_bytes"],
        "remote_bytes_fetched": r.get("remote_bytes_fetched", 0),
        "peak_rss_bytes": r["peak_rss_bytes"],
        "content_hash": m["content_hash"],
        "tensor_hashes": m["tensor_hashes"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--serve", nargs=3, metavar=("ROOT", "PORT_FILE", "LOG"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve(Path(a.serve[0]), Path(a.serve[1]), Path(a.serve[2]))
        return
    work = Path(tempfile.mkdtemp(prefix="mergedb-remote-"))
    if a.quick:
        fam = synth.make_family(work / "family", experts=a.k, size="tiny", seed=0)
        local_cat = work / "local.duckdb"
        Catalog(local_cat).register([fam], base_model="base", block_size="64KiB")
    else:
        fam = CACHE / "family-bench-20"
        local_cat = work / "local.duckdb"
        shutil.copyfile(CACHE / "catalog-bench-20-4MiB.duckdb", local_cat)
    experts = tuple(f"expert_{i:02d}" for i in range(a.k))
    files = sorted(p for d in ("base", *experts) for p in (fam / d).glob("*.safetensors"))
    port_file, log_file = work / "port", work / "requests.log"
    log_file.write_text("")
    server = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.bench_remote", "--serve", str(fam), str(port_file), str(log_file)]
    )
    try:
        while not port_file.exists() or not port_file.read_text():
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        remote_cat = work / "remote.duckdb"
        evict(files)
        t0 = time.perf_counter()
        cat = Catalog(remote_cat)
        cat.register([f"{url}/base"], base=True, block_size="64KiB" if a.quick else "4MiB")
        cat.register([f"{url}/{e}" for e in experts], base_model="base")  # one scan: the base fetched once more
        register = {"seconds": time.perf_counter() - t0, "served_bytes": _served(log_file)}
        register["file_bytes"] = sum(p.stat().st_size for p in files)
        plans = {}
        for name, path in (("local", local_cat), ("remote", remote_cat)):
            c = Catalog(path)
            for b in BUDGETS:
                p = c.plan(PlanRequest("base", experts, "task_arithmetic", b, params={"lambda": 0.5}))
                plans[name, b] = (p.plan_id, p.selected_bytes, p.budget_bytes)
        rows = []
        for b in BUDGETS:
            for rep in range(a.repeats):
                for arm, path in (("local", local_cat), ("remote", remote_cat)):
                    before = _served(log_file)
                    r = _execute(path, plans[arm, b][0], work / "out", files)
                    r.update(arm=arm, budget=b, repeat=rep, selected_bytes=plans[arm, b][1])
                    r["served_bytes"] = _served(log_file) - before
                    rows.append(r)
        for b in BUDGETS:  # every remote output equals the local one of its budget
            hashes = {json.dumps(r["tensor_hashes"], sort_keys=True) for r in rows if r["budget"] == b}
            if len(hashes) != 1:
                raise SystemExit(f"remote and local outputs differ at {b}")
        for r in rows:
            del r["tensor_hashes"]
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)
    doc = {
        "quick": a.quick,
        "k": a.k,
        "repeats": a.repeats,
        "family": "tiny" if a.quick else "bench",
        "register_remote": register,
        "rows": rows,
        "outputs_identical": True,
        "note": "Measured on a shared 2-core machine with other sessions running, the server (Python http.server) "
        "on the same cores: compare the arms side by side only",
        "load": os.getloadavg(),
    }
    print(json.dumps({k: v for k, v in doc.items() if k != "rows"}, indent=1))
    for r in rows:
        print(
            r["arm"], r["budget"], f"{r['wall']:.2f}s", r["expert_bytes"], r["remote_bytes_fetched"], r["served_bytes"]
        )
    save("remote-quick" if a.quick else "remote", doc)


if __name__ == "__main__":
    main()
