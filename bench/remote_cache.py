"""A new machine's cold start with a shared cache (§11.1 beyond one machine; issue: remote cache).

Runs the six examples in `examples/` one after another, each in its own process, three ways:

- cold:        empty local cache, empty remote (everything is generated and compiled);
- remote-warm: empty local cache, warm remote (a new machine joining a team);
- local-warm:  warm local cache (the same machine again).

and prints the total wall time of each and the ratio remote-warm / local-warm (target <= 2.0).
Starts its own `redis-server` on a loopback port (Debian's package) and uses private temporary
caches, so it leaves nothing behind.

    .venv/bin/python bench/remote_cache.py [--repeat 3]
"""
import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_examples(cache: Path, url: str) -> float:
    env = dict(os.environ, STAX_CACHE_DIR=str(cache), STAX_REMOTE_CACHE=url,
               STAX_REMOTE_CACHE_TRUST_NATIVE="1", PYTHONPATH=str(ROOT))
    start = time.perf_counter()
    for ex in EXAMPLES:
        subprocess.run([sys.executable, str(ex)], env=env, check=True, stdout=subprocess.DEVNULL,
                       cwd=str(ex.parent))
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ns = ap.parse_args()
    if shutil.which("redis-server") is None:
        sys.exit("bench/remote_cache.py needs redis-server (apt install redis-server)")
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    work = Path(tempfile.mkdtemp(prefix="stax-remote-bench-"))
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(work)], stdout=subprocess.DEVNULL)
    try:
        import redis
        client = redis.Redis(port=port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        times = {"cold": [], "remote-warm": [], "local-warm": []}
        for i in range(ns.repeat):
            client.flushdb()
            times["cold"].append(run_examples(work / f"cold{i}", url))
            times["remote-warm"].append(run_examples(work / f"new{i}", url))
            times["local-warm"].append(run_examples(work / f"cold{i}", url))
        print(f"six examples, each in its own process ({len(EXAMPLES)} scripts), {ns.repeat} rounds; "
              "median [min, max] seconds")
        for name, ts in times.items():
            print(f"  {name:<12} {statistics.median(ts):6.2f}  [{min(ts):.2f}, {max(ts):.2f}]")
        ratio = statistics.median(times["remote-warm"]) / statistics.median(times["local-warm"])
        print(f"remote-warm / local-warm = {ratio:.2f} (target <= 2.0); "
              f"cold / remote-warm = {statistics.median(times['cold']) / statistics.median(times['remote-warm']):.2f}")
    finally:
        server.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
