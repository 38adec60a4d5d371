"""The cache's second level: a Redis server shared by many machines (§11.1, beyond one machine).

Layer: bottom (imports no other stax module; ``cache.py`` calls it on a local miss and after a
local write).

Consumes: ``STAX_REMOTE_CACHE=redis://host:port/db`` (unset: no remote level), an entry's name as
the local cache names it (``artifacts/<hash>.json``, ``cubin/<kernel>_<hash>.bin``,
``autotune/<kernel>_<hash>.json``, ``cpp/<hash>.so``) and its sealed bytes (the sha256 line that
``cache.write_sealed`` puts first, then the payload).
Produces: the same bytes back on another machine, or None (a miss). The caller checks the seal
before it uses anything: an entry that fails is ignored, logged, deleted here, and overwritten
when the caller writes the rebuilt one.

The remote is an accelerator, never a dependency. Every call has a short timeout
(``STAX_REMOTE_CACHE_TIMEOUT``, default 0.5 s); any failure (server down, slow, full, flushed,
the ``redis`` client not installed) becomes one warning per process and a pause of
``_RETRY_AFTER`` seconds, during which the remote level is skipped and compiling goes on
locally. Entries larger than ``STAX_REMOTE_CACHE_MAX_BYTES`` (default 64 MiB) are not sent, and
every entry expires after ``STAX_REMOTE_CACHE_TTL`` seconds (default 30 days), so the server's
use stays bounded. Whether a native library fetched from here may be loaded is ``cache.py``'s
decision (``STAX_REMOTE_CACHE_TRUST_NATIVE``): loading one runs its code.

Where to look: ``remote()`` parses the URL once; ``RemoteStore.get``/``put``/``delete`` are the
three operations; ``STATS`` holds this process's counters (``python -m stax cache stats``).
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from urllib.parse import urlparse

__all__ = ["RemoteStore", "RemoteCacheWarning", "remote", "STATS", "ENV"]

ENV = "STAX_REMOTE_CACHE"
_PREFIX = "stax:"           # every key Stax writes starts with it (a shared server stays tidy)
_RETRY_AFTER = 30.0         # seconds the remote is skipped after a failure


class RemoteCacheWarning(UserWarning):
    """The remote cache failed (down, slow, full) or served a bad entry; Stax went on locally."""


@dataclass
class RemoteStats:
    """This process's remote traffic (the local level counts its own in cache.py)."""
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    writes: int = 0
    bad_entries: int = 0
    errors: int = 0
    skipped_large: int = 0
    by_kind: dict = field(default_factory=dict)    # "artifacts" -> {"hits": n, "misses": n}

    def count(self, kind: str, what: str) -> None:
        setattr(self, what, getattr(self, what) + 1)
        per = self.by_kind.setdefault(kind, {"hits": 0, "misses": 0})
        if what in per:
            per[what] += 1


STATS = RemoteStats()


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return value


# ---- The store: three operations, each allowed to fail ----

class RemoteStore:
    """One Redis database. ``get``/``put``/``delete`` never raise: a failure is a miss (or a
    write not made), reported once per process, after which the store rests ``_RETRY_AFTER`` s."""

    def __init__(self, url: str):
        parsed = urlparse(url)
        if parsed.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"{ENV}={url!r}: expected redis://host:port/db "
                             "(or rediss:// or unix://); unset it to cache on this machine only")
        self.url = url
        self.timeout = _env_number("STAX_REMOTE_CACHE_TIMEOUT", 0.5)
        self.max_bytes = int(_env_number("STAX_REMOTE_CACHE_MAX_BYTES", 64 << 20))
        self.ttl = int(_env_number("STAX_REMOTE_CACHE_TTL", 30 * 24 * 3600))
        self._client = None
        self._resting_until = 0.0
        self._warned = False

    def _connect(self):
        if self._client is None:
            try:
                import redis
            except ImportError:
                raise RuntimeError("the `redis` client is not installed "
                                   "(pip install 'stax[remote]')") from None
            self._client = redis.Redis.from_url(self.url, socket_timeout=self.timeout,
                                                socket_connect_timeout=self.timeout)
        return self._client

    def _failed(self, what: str, error: Exception) -> None:
        STATS.errors += 1
        self._resting_until = time.monotonic() + _RETRY_AFTER
        self._client = None          # reconnect after the rest (a restarted server is found again)
        if not self._warned:
            self._warned = True
            warnings.warn(f"stax: the remote cache {self.url} failed ({what}: {error}); "
                          "compiling goes on with the local cache only", RemoteCacheWarning,
                          stacklevel=4)

    def _usable(self) -> bool:
        return time.monotonic() >= self._resting_until

    def get(self, name: str) -> bytes | None:
        """The bytes stored under `name`, or None (absent, or the server failed)."""
        if not self._usable():
            return None
        kind = name.split("/", 1)[0]
        try:
            data = self._connect().get(_PREFIX + name)
        except Exception as e:       # noqa: BLE001 - any client failure is a miss, by design
            self._failed("read", e)
            return None
        if data is None:
            STATS.count(kind, "misses")
            return None
        STATS.count(kind, "hits")
        STATS.bytes_read += len(data)
        return bytes(data)

    def put(self, name: str, data: bytes) -> None:
        """Store `data` under `name` (last writer wins: racing writers write the same bytes)."""
        if not self._usable():
            return
        if len(data) > self.max_bytes:
            STATS.skipped_large += 1
            return
        try:
            self._connect().set(_PREFIX + name, data, ex=self.ttl)
        except Exception as e:       # noqa: BLE001 - a full or gone server: local only
            self._failed("write", e)
            return
        STATS.writes += 1
        STATS.bytes_written += len(data)

    def delete(self, name: str, why: str) -> None:
        """Remove a bad entry (it failed its check here; the rebuilt one will replace it)."""
        STATS.bad_entries += 1
        warnings.warn(f"stax: remote cache entry {name} failed its check ({why}); ignored and "
                      "deleted, it is rebuilt locally and written again", RemoteCacheWarning,
                      stacklevel=4)
        if not self._usable():
            return
        try:
            self._connect().delete(_PREFIX + name)
        except Exception as e:       # noqa: BLE001
            self._failed("delete", e)

    def server_info(self) -> dict | None:
        """Keys and memory on the server (for `cache stats`), or None if it cannot be reached."""
        try:
            client = self._connect()
            keys = sum(1 for _ in client.scan_iter(match=_PREFIX + "*", count=1000))
            memory = client.info("memory").get("used_memory_human", "?")
        except Exception:            # noqa: BLE001
            return None
        return {"keys": keys, "used_memory": memory}


_stores: dict = {}


def remote() -> RemoteStore | None:
    """The store named by ``$STAX_REMOTE_CACHE`` (one per URL per process), or None when unset."""
    url = os.environ.get(ENV, "").strip()
    if not url:
        return None
    store = _stores.get(url)
    if store is None:
        store = _stores[url] = RemoteStore(url)
    return store
