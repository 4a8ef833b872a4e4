"""Every adapter the server knows, and the tiers below the device slots: host <- disk <- source.

Loads run on background threads (source -> disk cache -> validated weights in host memory) and
report back through a queue that the engine drains each step, so a load never stalls a batch.
The host tier is a byte-bounded LRU. Device slots belong to the engine (scheduler + LoRASlots).
Thread-safe: the HTTP admin routes and the engine thread both call in.
"""

from __future__ import annotations

import contextlib
import enum
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplane_server.adapters.disk_cache import DiskCache
from loraplane_server.adapters.weights import LoRAWeights, load_lora, read_adapter_config
from loraplane_server.errors import AdapterError, InvalidRequestError, UnknownAdapterError
from loraplane_server.executor.models.args import ModelArgs
from loraplane_server.platforms.torch_threads import serial_torch_thread
from loraplane_server.store.sources import AdapterSource, AdapterSourceError, fetch, parse_source

TIERS = ("device", "host", "disk", "source")


class AdapterState(str, enum.Enum):
    REGISTERED = "registered"
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"


@dataclass
class AdapterRecord:
    adapter_id: str
    source: AdapterSource
    state: AdapterState = AdapterState.REGISTERED
    rank: int | None = None
    size_bytes: int | None = None
    target_modules: list[str] = field(default_factory=list)
    last_error: str | None = None
    error_transient: bool | None = None  # with last_error: whether trying again later may succeed
    hits: int = 0
    loads: int = 0
    pinned: bool = False
    last_used: float = field(default_factory=time.time)
    load_seconds: float | None = None


@dataclass
class AdapterStats:
    """Counters for the metrics endpoint, by tier."""

    hits: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    misses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    loads: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    evictions: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    load_seconds: list[float] = field(default_factory=list)
    # loads that failed, by whether a retry may help (transient: the source or the disk) or not (the adapter)
    load_failures: dict[str, int] = field(default_factory=lambda: {"transient": 0, "permanent": 0})


class AdapterManager:
    def __init__(
        self,
        model_args: ModelArgs,
        dtype: torch.dtype,
        max_rank: int,
        host_max_bytes: int,
        disk_cache: DiskCache,
        adapter_dir: Path | None = None,
        num_workers: int = 2,
        source_allow: list[str] | None = None,
        pin_host: bool = False,
    ) -> None:
        """pin_host: hold the host tier's weights in page-locked memory (an engine on CUDA: a device slot then
        takes an adapter in one asynchronous transfer, adapters/weights.py's load_lora); the host budget then counts
        each adapter at its page-locked block's size (LoRAWeights.nbytes)."""
        self.model_args = model_args
        self.pin_host = pin_host
        self.dtype = dtype
        self.max_rank = max_rank
        self.host_max_bytes = host_max_bytes
        self.disk = disk_cache
        self.adapter_dir = adapter_dir
        # the allowlist every redirect of a remote source must pass (the HTTP server sets its own);
        # None checks a redirect's scheme only
        self.source_allow = source_allow
        self.records: dict[str, AdapterRecord] = {}
        self.host: OrderedDict[str, LoRAWeights] = OrderedDict()
        self.host_bytes = 0
        self.stats = AdapterStats()
        self.completions: queue.Queue[tuple[str, str | None]] = queue.Queue()
        self._completed = threading.Event()
        self._lock = threading.RLock()
        # serial: a loader that ran a parallel op would keep a second OpenMP team alive and slow every
        # parallel region of the engine's thread (async_engine's docstring)
        self._pool = ThreadPoolExecutor(
            max_workers=num_workers, thread_name_prefix="adapter-load", initializer=serial_torch_thread
        )
        if adapter_dir is not None:
            self.scan_adapter_dir()

    # registry
    def scan_adapter_dir(self) -> list[str]:
        """Register every subdirectory of --adapter-dir, named after it."""
        if self.adapter_dir is None or not self.adapter_dir.is_dir():
            return []
        found = []
        for sub in sorted(self.adapter_dir.iterdir()):
            if sub.is_dir() and (sub / "adapter_config.json").is_file() and sub.name not in self.records:
                self.register(sub.name, str(sub))
                found.append(sub.name)
        return found

    def register(self, adapter_id: str, source: str) -> AdapterRecord:
        parsed = parse_source(source)
        with self._lock:
            old = self.records.get(adapter_id)
            if old is not None and old.source.uri != parsed.uri:
                self._forget_host(adapter_id)
                self.disk.remove(adapter_id)
            if old is None or old.source.uri != parsed.uri:
                self.records[adapter_id] = AdapterRecord(adapter_id, parsed)
            return self.records[adapter_id]

    def lookup(self, adapter_id: str) -> AdapterRecord | None:
        with self._lock:
            rec = self.records.get(adapter_id)
        if rec is None and self.adapter_dir is not None and _is_plain_name(adapter_id):
            sub = self.adapter_dir / adapter_id
            if (sub / "adapter_config.json").is_file():
                rec = self.register(adapter_id, str(sub))
        return rec

    # loading
    def request(self, adapter_id: str) -> bool:
        """A request wants this adapter: True if it is in host memory, else start a load (False)."""
        rec = self.lookup(adapter_id)
        if rec is None:
            raise UnknownAdapterError(adapter_id, "register it first (POST /v1/adapters)")
        with self._lock:
            rec.last_used = time.time()
            if adapter_id in self.host:
                self.host.move_to_end(adapter_id)
                rec.hits += 1
                self.stats.hits["host"] += 1
                return True
            self.stats.misses["host"] += 1
            self._start_load(rec)
            return False

    def is_ready(self, adapter_id: str) -> bool:
        with self._lock:
            return adapter_id in self.host

    def is_loading(self, adapter_id: str) -> bool:
        with self._lock:
            rec = self.records.get(adapter_id)
            return rec is not None and rec.state == AdapterState.LOADING

    def was_evicted(self, adapter_id: str) -> bool:
        """Loaded once, then dropped from host memory: its waiting requests need a reload."""
        with self._lock:
            rec = self.records.get(adapter_id)
            return rec is not None and rec.state == AdapterState.READY and adapter_id not in self.host

    def _start_load(self, rec: AdapterRecord, tier: str = "host") -> None:
        if rec.state == AdapterState.LOADING:
            return
        rec.state = AdapterState.LOADING
        self._pool.submit(self._load, rec.adapter_id, tier)

    def _load(self, adapter_id: str, tier: str) -> None:
        start = time.monotonic()
        error: str | None = None
        transient: bool | None = None
        try:
            if tier == "disk":
                self._materialise(adapter_id)
            else:
                self._put_host(adapter_id, self._read_weights(adapter_id))
        except AdapterSourceError as exc:
            error, transient = str(exc), exc.transient
        except OSError as exc:  # the server's own disk (full, I/O): may pass
            error, transient = str(exc), True
        except (AdapterError, ValueError) as exc:  # the adapter itself: only a new adapter helps
            error, transient = str(exc), False
        except Exception as exc:  # noqa: BLE001 - a hostile adapter must not kill the loader
            error, transient = f"{type(exc).__name__}: {exc}", False
        with self._lock:
            rec = self.records.get(adapter_id)
            if rec is not None:
                rec.state = AdapterState.FAILED if error else AdapterState.READY
                rec.last_error, rec.error_transient = error, transient
                rec.load_seconds = time.monotonic() - start
                if not error:
                    rec.loads += 1
                    self.stats.load_seconds.append(rec.load_seconds)
                else:
                    self.stats.load_failures["transient" if transient else "permanent"] += 1
            self.completions.put((adapter_id, error))
            self._completed.set()

    def _materialise(self, adapter_id: str) -> Path:
        """The adapter's files on local disk: a local source as is, others through the disk cache."""
        with self._lock:
            rec = self.records[adapter_id]
        if rec.source.kind == "local" and rec.source.path is not None:
            read_adapter_config(rec.source.path)
            return rec.source.path
        cached = self.disk.get(adapter_id)
        if cached is not None:
            self.stats.hits["disk"] += 1
            return cached
        self.stats.misses["disk"] += 1

        def fill(dest: Path) -> None:
            fetch(rec.source, dest, max_bytes=self.disk.room_for(adapter_id), allow=self.source_allow)

        path = self.disk.put(adapter_id, fill)
        if rec.pinned:
            self.disk.pin(adapter_id)
        self.stats.loads["disk"] += 1
        return path

    def _put_host(self, adapter_id: str, weights: LoRAWeights) -> None:
        with self._lock:
            rec = self.records.get(adapter_id)
            if rec is None:
                return  # unregistered while loading
            self._forget_host(adapter_id)
            rec.rank, rec.size_bytes, rec.target_modules = weights.rank, weights.nbytes, weights.target_modules
            # room first, then the new weights: host_bytes, which callers read without the lock, never
            # passes the budget on the way, as adding first and evicting after let it for a moment
            for victim in [a for a in self.host if not self.records[a].pinned]:
                if self.host_bytes + weights.nbytes <= self.host_max_bytes:
                    break
                self._forget_host(victim)
                self.stats.evictions["host"] += 1
            self.host[adapter_id] = weights
            self.host_bytes += weights.nbytes
            self.stats.loads["host"] += 1

    def _forget_host(self, adapter_id: str) -> None:
        weights = self.host.pop(adapter_id, None)
        if weights is not None:
            self.host_bytes -= weights.nbytes

    def weights(self, adapter_id: str) -> LoRAWeights:
        """Host weights for a device-slot copy; reloaded from disk synchronously if evicted meanwhile."""
        with self._lock:
            w = self.host.get(adapter_id)
            if w is not None:
                self.host.move_to_end(adapter_id)
                return w
        w = self._read_weights(adapter_id)
        self._put_host(adapter_id, w)
        return w

    def _read_weights(self, adapter_id: str) -> LoRAWeights:
        """Materialise on disk and read; a disk-cache entry is pinned while its files are read."""
        path = self._materialise(adapter_id)
        with self._lock:
            remote = self.records[adapter_id].source.kind != "local"
        if not remote:
            return load_lora(path, adapter_id, self.model_args, self.max_rank, self.dtype, self.pin_host)
        try:
            self.disk.pin(adapter_id)
        except KeyError:  # evicted between fetch and read: fetch again
            path = self._materialise(adapter_id)
            self.disk.pin(adapter_id)
        try:
            return load_lora(path, adapter_id, self.model_args, self.max_rank, self.dtype, self.pin_host)
        finally:
            self.disk.unpin(adapter_id)

    def wait_for_completion(self, timeout: float) -> bool:
        """Block until some load finishes (or timeout); for a stepping loop with nothing to run."""
        hit = self._completed.wait(timeout)
        self._completed.clear()
        return hit

    def drain_completions(self) -> list[tuple[str, str | None]]:
        done = []
        while True:
            try:
                done.append(self.completions.get_nowait())
            except queue.Empty:
                return done

    # admin
    def prewarm(self, adapter_id: str, tier: str) -> AdapterRecord:
        """Start moving an adapter to the host or disk tier (device is the engine's job)."""
        rec = self.lookup(adapter_id)
        if rec is None:
            raise UnknownAdapterError(adapter_id)
        with self._lock:
            if tier in ("host", "device") and adapter_id not in self.host:
                self._start_load(rec, "host")
            elif tier == "disk" and self.tier_of(adapter_id) == "source":
                self._start_load(rec, "disk")
        return rec

    def settle(self, adapter_id: str, tier: str) -> bool:
        """Move an adapter that holds no device slot to exactly `tier`; True once it is there. host: loaded
        into host memory if missing; disk: the host copy dropped, fetched to the disk cache if missing."""
        rec = self.lookup(adapter_id)
        if rec is None:
            raise UnknownAdapterError(adapter_id)
        if tier not in ("host", "disk"):
            raise InvalidRequestError(f"tier {tier!r}: expected host or disk", param="tier")
        with self._lock:
            if rec.state == AdapterState.LOADING:
                return False  # a load in flight would put it back into host memory: act once it is done
            if tier == "host" and adapter_id not in self.host:
                self._start_load(rec, "host")
                return False
            if tier == "disk" and adapter_id in self.host:
                self._forget_host(adapter_id)
                self.stats.evictions["host"] += 1
            if tier == "disk" and self.tier_of(adapter_id) == "source":
                self._start_load(rec, "disk")  # evicted from the disk cache too: fetch it back
                return False
            return True

    def set_pinned(self, adapter_id: str, pinned: bool) -> None:
        with self._lock:
            rec = self.records[adapter_id]
            if rec.pinned != pinned and rec.source.kind != "local":
                with contextlib.suppress(KeyError):  # not fetched yet: pinned once it is
                    self.disk.pin(adapter_id) if pinned else self.disk.unpin(adapter_id)
            rec.pinned = pinned

    def unregister(self, adapter_id: str) -> bool:
        with self._lock:
            rec = self.records.pop(adapter_id, None)
            self._forget_host(adapter_id)
        if rec is not None and rec.source.kind != "local":
            self.disk.remove(adapter_id)
        return rec is not None

    def tier_of(self, adapter_id: str) -> str:
        with self._lock:
            rec = self.records.get(adapter_id)
            if adapter_id in self.host:
                return "host"
        if rec is not None and (rec.source.kind == "local" or self.disk.size_of(adapter_id) is not None):
            return "disk"
        return "source"

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _is_plain_name(adapter_id: str) -> bool:
    return bool(adapter_id) and "/" not in adapter_id and "\\" not in adapter_id and adapter_id not in (".", "..")
