"""§11.1 beyond one machine: the Redis second level of the cache (stax/remote_cache.py).

A real `redis-server` (Debian's package, installed by .ci/run) runs on a loopback port for these
tests. Processes with empty local caches stand for new machines; a compiler wrapper that logs its
compile commands shows whether a process compiled anything.
"""
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest

redis = pytest.importorskip("redis", reason="the `redis` client is not installed (pip install 'stax[remote]')")
if shutil.which("redis-server") is None:
    pytest.skip("redis-server is not installed (apt install redis-server; .ci/run installs it)",
                allow_module_level=True)

from stax import cache, remote_cache  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = textwrap.dedent("""
    import sys
    import numpy as np
    import stax

    @stax.compile
    def f(x, y):
        return (stax.relu(x + y) * {scale}).sum(-1)

    x = stax.tensor(np.arange(12, dtype=np.float32).reshape(3, 4) - 5)
    y = stax.tensor(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))
    want = (np.maximum(x.numpy() + y.numpy(), 0) * {scale}).sum(-1)
    got = f(x, y).numpy()
    assert np.allclose(got, want, rtol=1e-5), (got, want)
    print("OK")
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, tmp: Path, *extra):
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(tmp), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis(port=self.port, socket_timeout=2)
        for _ in range(100):
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self):
        self.proc.kill()
        self.proc.wait()

    def stax_keys(self):
        return sorted(k.decode() for k in self.client.keys("stax:*"))


@pytest.fixture
def server(tmp_path):
    s = RedisServer(tmp_path)
    yield s
    s.stop()


@pytest.fixture
def compiler_log(tmp_path):
    """A CXX that logs each compile (a command with -o) and then runs the real compiler."""
    log = tmp_path / "cxx_calls.log"
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    wrapper = tmp_path / "cxx-logging"
    wrapper.write_text(f'#!/bin/sh\ncase "$*" in *" -o "*) echo "$*" >> {log};; esac\nexec {cxx} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, log


def run_program(tmp_path, name, url, cxx, scale=2, trust=True, extra_env=None):
    """Run PROGRAM in a fresh process with an empty (or given) local cache: a new machine."""
    script = tmp_path / f"prog_{scale}.py"
    script.write_text(PROGRAM.format(scale=scale))
    env = dict(os.environ, STAX_CACHE_DIR=str(tmp_path / name), STAX_REMOTE_CACHE=url, CXX=str(cxx),
               PYTHONPATH=str(ROOT))
    env.pop("STAX_REMOTE_CACHE_TRUST_NATIVE", None)
    if trust:
        env["STAX_REMOTE_CACHE_TRUST_NATIVE"] = "1"
    env.update(extra_env or {})
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=300)


def compiles(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_new_machine_reaches_first_result_without_compiling(tmp_path, server, compiler_log):
    cxx, log = compiler_log
    first = run_program(tmp_path, "machine1", server.url, cxx)
    assert first.returncode == 0, first.stderr
    assert compiles(log) == 1
    assert any(k.startswith("stax:artifacts/") for k in server.stax_keys())
    assert any(k.startswith("stax:cpp/") and k.endswith(".so") for k in server.stax_keys())
    second = run_program(tmp_path, "machine2", server.url, cxx)
    assert second.returncode == 0, second.stderr
    assert compiles(log) == 1, "the second machine compiled instead of using the remote library"
    stats = subprocess.run([sys.executable, "-m", "stax", "cache", "stats"], capture_output=True, text=True,
                           env=dict(os.environ, STAX_CACHE_DIR=str(tmp_path / "machine2"),
                                    STAX_REMOTE_CACHE=server.url, PYTHONPATH=str(ROOT)))
    assert stats.returncode == 0, stats.stderr
    assert "remote: 2 hits, 0 misses" in stats.stdout, stats.stdout
    assert "artifacts" in stats.stdout and "Stax entries" in stats.stdout


def test_native_code_from_the_remote_needs_trust(tmp_path, server, compiler_log):
    cxx, log = compiler_log
    assert run_program(tmp_path, "machine1", server.url, cxx).returncode == 0
    second = run_program(tmp_path, "machine2", server.url, cxx, trust=False)
    assert second.returncode == 0, second.stderr
    assert compiles(log) == 2, "a .so from the remote was loaded without STAX_REMOTE_CACHE_TRUST_NATIVE=1"


def test_corrupted_remote_entries_are_ignored_deleted_and_rewritten(tmp_path, server, compiler_log):
    cxx, log = compiler_log
    assert run_program(tmp_path, "machine1", server.url, cxx).returncode == 0
    keys = server.stax_keys()
    for k in keys:                                   # garbage, and a truncated library
        good = server.client.get(k)
        server.client.set(k, good[: len(good) // 2] if k.endswith(".so") else b"garbage\n{}")
    second = run_program(tmp_path, "machine2", server.url, cxx)
    assert second.returncode == 0 and "OK" in second.stdout, second.stderr
    assert "failed its check" in second.stderr
    assert compiles(log) == 2
    for k in keys:                                   # the rebuilt entries replaced the bad ones
        data = server.client.get(k)
        assert data is not None and cache._unseal(data) is not None, k
    third = run_program(tmp_path, "machine3", server.url, cxx)
    assert third.returncode == 0 and compiles(log) == 2


def test_two_processes_racing_on_one_key(tmp_path, server, compiler_log):
    cxx, log = compiler_log
    results = [None, None]

    def go(i):
        results[i] = run_program(tmp_path, f"racer{i}", server.url, cxx, scale=3)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        assert r.returncode == 0 and "OK" in r.stdout, r.stderr
    for k in server.stax_keys():
        assert cache._unseal(server.client.get(k)) is not None, k
    before = compiles(log)
    assert run_program(tmp_path, "late", server.url, cxx, scale=3).returncode == 0
    assert compiles(log) == before


@pytest.fixture
def in_process(tmp_path, monkeypatch):
    """This process's cache pointed at a fresh folder and a given remote (reset afterwards)."""
    def use(url, name="local"):
        monkeypatch.setenv("STAX_CACHE_DIR", str(tmp_path / name))
        monkeypatch.setenv("STAX_REMOTE_CACHE", url)
        remote_cache._stores.clear()
    yield use
    remote_cache._stores.clear()


def test_tuning_records_and_cubins_are_shared_data(server, in_process):
    in_process(server.url, "a")
    path = cache.folder("autotune") / "triton_poi_fused_add_0_abc.json"
    cache.write_sealed(path, b'{"config": {"XBLOCK": 1024}, "ms": 0.5}')
    in_process(server.url, "b")
    path_b = cache.folder("autotune") / "triton_poi_fused_add_0_abc.json"
    assert not path_b.exists()
    assert cache.read_sealed(path_b) == b'{"config": {"XBLOCK": 1024}, "ms": 0.5}'
    assert path_b.exists(), "a remote hit is kept in the local level"


def test_server_killed_mid_run_and_flushed(server, in_process):
    in_process(server.url, "a")
    p1 = cache.folder("artifacts") / "one.json"
    cache.write_sealed(p1, b"first")
    server.client.flushdb()                          # flushed: a miss, nothing else
    in_process(server.url, "b")
    assert cache.read_sealed(cache.folder("artifacts") / "one.json") is None
    server.stop()                                    # killed: one warning, then local only
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache.write_sealed(cache.folder("artifacts") / "two.json", b"second")
        assert cache.read_sealed(cache.folder("artifacts") / "two.json") == b"second"
        assert cache.read_sealed(cache.folder("artifacts") / "three.json") is None
    remote = [w for w in caught if issubclass(w.category, remote_cache.RemoteCacheWarning)]
    assert len(remote) == 1 and "local cache only" in str(remote[0].message)


def test_slow_server_times_out(in_process, monkeypatch):
    listener = socket.socket()                       # accepts, never answers
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    monkeypatch.setenv("STAX_REMOTE_CACHE_TIMEOUT", "0.2")
    in_process(f"redis://127.0.0.1:{listener.getsockname()[1]}/0")
    start = time.perf_counter()
    with pytest.warns(remote_cache.RemoteCacheWarning, match="failed"):
        assert cache.read_sealed(cache.folder("artifacts") / "x.json") is None
    assert cache.read_sealed(cache.folder("artifacts") / "y.json") is None     # resting: no wait
    assert time.perf_counter() - start < 2.0
    listener.close()


def test_full_server_and_large_entries(tmp_path, in_process, monkeypatch):
    full = RedisServer(tmp_path, "--maxmemory-policy", "noeviction")
    try:
        full.client.set("filler", b"x" * (2 << 20))
        full.client.config_set("maxmemory", "1mb")    # now over its limit: writes fail (OOM)
        in_process(full.url)
        with pytest.warns(remote_cache.RemoteCacheWarning, match="write"):
            cache.write_sealed(cache.folder("artifacts") / "z.json", b"payload")
        assert cache.read_sealed(cache.folder("artifacts") / "z.json") == b"payload"
    finally:
        full.stop()
    server = RedisServer(tmp_path)
    try:
        monkeypatch.setenv("STAX_REMOTE_CACHE_MAX_BYTES", "100")
        in_process(server.url, "big")
        cache.write_sealed(cache.folder("artifacts") / "big.json", b"y" * 1000)
        cache.write_sealed(cache.folder("artifacts") / "small.json", b"y" * 10)
        assert server.stax_keys() == ["stax:artifacts/small.json"]
    finally:
        server.stop()


def test_bad_url_is_a_clear_error(in_process):
    in_process("http://example.com/")
    with pytest.raises(ValueError, match="redis://host:port/db"):
        cache.read_sealed(cache.folder("artifacts") / "q.json")
