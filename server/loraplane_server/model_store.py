"""The model cache: a --model URI -> a local model directory, verified and ready to load.

Kinds (parsed by sources.py, which adapters share): a built-in name (converted once from its GGUF), a local
directory (used in place), a local .gguf file (dequantized once), hf://org/repo[@revision][/subfolder] and
s3://bucket/prefix. Whatever is downloaded or converted lives under one cache directory:

    <cache>/<built-in name>/            converted built-in models
    <cache>/gguf/<stem>-<key>/          converted GGUF files (key: absolute path, size, mtime)
    <cache>/hub/                        huggingface_hub's own cache layout
    <cache>/s3/<bucket>/<prefix>/       S3 models (the prefix quoted into one path component), with a manifest

Every entry appears atomically (a directory renamed into place), so a half-written model is never loaded,
and a file lock per entry makes a second process on a shared volume wait ("waiting") for the first one's
download rather than race it. Before a model is used its files are verified (see `verify`), under that lock;
a cached entry that fails is discarded (with a warning) and fetched or converted once more.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

from filelock import FileLock, Timeout

from loraplane_server.config import EngineConfig
from loraplane_server.gguf_models import BUILTIN_MODELS, convert_gguf, find_gguf
from loraplane_server.sources import (
    MODEL_FILESET,
    ModelSourceError,
    S3Object,
    Source,
    SourceError,
    hf_endpoint,
    hf_offline,
    hf_reason,
    hf_token,
    list_s3_files,
    parse_source,
    s3_client,
    s3_reason,
)
from loraplane_server.user_cache import cache_root

log = logging.getLogger("loraplane.model")

MANIFEST = ".loraplane-manifest.json"  # in a complete S3 entry: the ETag and size of each file
_STARTED = ".loraplane-etags.json"  # in a .partial S3 entry: the ETag each file was started from
_CHUNK = 1 << 20
_TIMEOUT_S = 60.0
# test-only: seconds to sleep after each chunk of an S3 download, so a test (or an e2e scenario) can kill a
# download halfway or watch its progress; read by nothing but _copy_body
_DELAY_ENV = "LORAPLANE_TEST_DOWNLOAD_DELAY_S"


def default_cache_dir() -> Path:
    return cache_root() / "models"


# progress


class Progress:
    """Where resolving one model stands: its phase and bytes, for /ready (read from another thread), a bar on
    a terminal, and log lines (logger "loraplane.model") at least every 10% or 10 s otherwise."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.phase = "resolving"  # resolving | waiting | downloading | verifying | converting | loading | ready
        self.bytes_done = 0  # bytes of this source's files on disk, resumed or cached ones included
        self.bytes_total: int | None = None
        self.bytes_fetched = 0  # bytes this process transferred
        self._lock = threading.Lock()
        self._bar: Any = None
        self._logged_at, self._logged_tenth = 0.0, -1

    def set_phase(self, phase: str) -> None:
        if phase != self.phase:
            log.info("model %s: %s", self.source, phase)
        with self._lock:
            self.phase = phase
            if self._bar is not None and phase != "downloading":
                self._bar.close()
                self._bar = None

    def start(self, total: int | None, done: int) -> None:
        """Downloading begins: `done` bytes of `total` are already here."""
        with self._lock:
            self.bytes_total, self.bytes_done = total, done
        self.set_phase("downloading")  # after the bytes: /ready never pairs this phase with the old ones
        with self._lock:
            if self._bar is None and sys.stderr.isatty():
                from tqdm import tqdm

                self._bar = tqdm(total=total, initial=done, unit="B", unit_scale=True, desc=self.source)
        self._log_now()

    def advance(self, nbytes: int, total: int | None = None) -> None:
        """nbytes more arrived (total: a new total, when the downloader learns it as it goes)."""
        with self._lock:
            self.bytes_done += nbytes
            self.bytes_fetched += nbytes
            self.bytes_total = total if total is not None else self.bytes_total
            if self._bar is not None:
                self._bar.total = self.bytes_total
                self._bar.update(nbytes)
        self._log_now()

    def forget(self, nbytes: int) -> None:
        """nbytes counted as done are to be fetched again (a resumed file that starts over)."""
        with self._lock:
            self.bytes_done -= nbytes
            if self._bar is not None:
                self._bar.update(-nbytes)

    def _log_now(self) -> None:
        if self._bar is not None:
            return
        tenth = self.bytes_done * 10 // self.bytes_total if self.bytes_total else -1
        if tenth > self._logged_tenth or time.monotonic() - self._logged_at >= 10:
            self._logged_at, self._logged_tenth = time.monotonic(), tenth
            log.info("model %s: %s", self.source, self.describe())

    def describe(self) -> str:
        done = f"{self.bytes_done / 2**20:.1f} MiB"
        if not self.bytes_total:
            return f"{self.phase} {done}"
        return f"{self.phase} {done}/{self.bytes_total / 2**20:.1f} MiB ({100 * self.bytes_done // self.bytes_total}%)"

    def as_dict(self) -> dict[str, object]:
        """/ready's "model" object."""
        return {
            "source": self.source,
            "phase": self.phase,
            "bytes_done": self.bytes_done,
            "bytes_total": self.bytes_total,
        }


class StartupListener:
    """An engine's on_phase callback that carries the model's Progress, so that the HTTP server's /ready
    sees the download that LLMEngine runs (LLMEngine(config, on_phase) is its only channel)."""

    def __init__(self, on_step: Callable[[str], None], progress: Progress) -> None:
        self.on_step = on_step
        self.progress = progress

    def __call__(self, step: str) -> None:
        self.on_step(step)


def resolve_model(config: EngineConfig, on_phase: Callable[[str], None] | None = None) -> Path:
    """The engine's entry: config.model -> a verified model directory (the Progress rides on a StartupListener)."""
    progress = on_phase.progress if isinstance(on_phase, StartupListener) else Progress(config.model)
    cache = Path(config.model_cache).expanduser() if config.model_cache else default_cache_dir()
    return resolve(config.model, cache, config.offline, progress)


def resolve(uri: str, cache_dir: Path, offline: bool = False, progress: Progress | None = None) -> Path:
    """A model URI -> a local directory ready to load; ModelSourceError says what to fix otherwise.

    offline (or HF_HUB_OFFLINE=1): only what the cache (or the local disk) holds, no network call."""
    progress = progress or Progress(uri)
    try:
        path = _resolve(uri.strip(), cache_dir, offline or hf_offline(), progress)
    except ModelSourceError:
        raise
    except SourceError as exc:  # the URI itself, in parse_source's words (shared with adapters)
        raise ModelSourceError(f"--model {uri.strip()}: {exc}") from exc
    progress.set_phase("loading")
    return path


def _resolve(uri: str, cache_dir: Path, offline: bool, progress: Progress) -> Path:
    if uri in BUILTIN_MODELS:
        return _convert_once(uri, lambda: find_gguf(uri), cache_dir / uri, progress)
    source = parse_source(uri)
    if source.kind == "hf":
        return _resolve_hf(source, cache_dir / "hub", offline, progress)
    if source.kind == "s3":
        return _resolve_s3(source, cache_dir, offline, progress)
    if source.kind == "local" and source.path is not None:
        return _resolve_local(uri, source.path, cache_dir, progress)
    raise ModelSourceError(f"{uri}: http(s) archives are for adapters; serve a model from a directory, hf:// or s3://")


def _resolve_local(uri: str, path: Path, cache_dir: Path, progress: Progress) -> Path:
    if path.is_file() and path.suffix.lower() == ".gguf":
        stat = path.stat()
        key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
        return _convert_once(uri, lambda: path, cache_dir / "gguf" / f"{path.stem}-{key}", progress)
    if path.is_dir():
        verify(path, progress)
        return path
    known = ", ".join(BUILTIN_MODELS)
    raise ModelSourceError(
        f"{uri!r} is neither a built-in model ({known}), a model directory, a .gguf file, hf://org/repo[@revision] "
        "nor s3://bucket/prefix"
    )


def _convert_once(uri: str, gguf: Callable[[], Path], out: Path, progress: Progress) -> Path:
    """A GGUF file dequantized into out, once (convert_gguf renames a finished directory into place); a
    converted directory that fails verification is converted again."""
    with _locked(out.with_name(out.name + ".lock"), progress):
        if out.exists():
            if _damage(out, uri, progress, "converting it again") is None:
                return out
            _discard(out)
        try:
            path = gguf()
        except FileNotFoundError as exc:
            raise ModelSourceError(str(exc)) from exc
        progress.set_phase("converting")
        try:
            convert_gguf(path, out)
        except (ValueError, OSError, KeyError, RuntimeError) as exc:
            raise ModelSourceError(f"{uri}: cannot convert the GGUF file ({type(exc).__name__}: {exc})") from exc
        verify(out, progress)
    return out


@contextlib.contextmanager
def _locked(path: Path, progress: Progress) -> Iterator[None]:
    """Hold the entry's file lock; while another process holds it, the phase is "waiting"."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        before = progress.phase
        progress.set_phase("waiting")
        lock.acquire()
        progress.set_phase(before)
    try:
        yield
    finally:
        lock.release()


# integrity


def verify(model_dir: Path, progress: Progress | None = None) -> None:
    """config.json parses and names its model_type; every *.safetensors shard opens (safe_open checks the
    header and that the data covers the file exactly); every file and tensor the index names is there."""
    if progress is not None:
        progress.set_phase("verifying")
    names = {p.name for p in model_dir.iterdir() if p.is_file()}
    MODEL_FILESET.check(names, str(model_dir))
    _check_config(model_dir / "config.json")
    shards = sorted(n for n in names if n.endswith(".safetensors") and MODEL_FILESET.wants(n))
    tensors = {name: _shard_keys(model_dir / name) for name in shards}
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        _check_index(index, tensors)


class _NotServable(ModelSourceError):
    """config.json parses but names a model this engine cannot serve: fetching it again would not help."""


def _damage(entry: Path, uri: str, progress: Progress, repair: str) -> ModelSourceError | None:
    """Verify an entry that an earlier run left in the cache: None when it is whole, else why not (logged with
    `repair`, what the caller does about it). A model this engine cannot serve raises: the entry is kept."""
    try:
        verify(entry, progress)
    except _NotServable:
        raise
    except ModelSourceError as exc:
        log.warning("model %s: the cached copy in %s is damaged (%s); %s", uri, entry, exc, repair)
        return exc
    return None


def _discard(entry: Path) -> None:
    """Remove a cache entry (the caller holds its lock): renamed away first, so it vanishes at once."""
    old = entry.with_name(f"{entry.name}.old-{os.getpid()}")
    os.replace(entry, old)
    shutil.rmtree(old, ignore_errors=True)


def _check_config(path: Path) -> None:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"config.json: not valid JSON ({exc})") from exc
    if not isinstance(config, dict) or not config.get("model_type"):
        raise _NotServable("config.json: no model_type (expected a Hugging Face transformers model config)")
    from loraplane_server.models.registry import UnsupportedModelError, family_of

    try:
        family_of(config)
    except UnsupportedModelError as exc:
        raise _NotServable(f"config.json: {exc}") from exc


def _shard_keys(path: Path) -> set[str]:
    """The tensor names of a safetensors shard."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return set(f.keys())
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error type and OSError alike
        raise ModelSourceError(f"{path}: corrupt safetensors file ({exc})") from exc


def _check_index(index: Path, tensors: dict[str, set[str]]) -> None:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        pairs = [(str(k), str(v)) for k, v in weight_map.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelSourceError(f"{index.name}: not a safetensors index ({type(exc).__name__}: {exc})") from exc
    for tensor, shard in pairs:
        if shard not in tensors:
            raise ModelSourceError(f"{index.name}: names shard {shard}, which is missing")
        if tensor not in tensors[shard]:
            raise ModelSourceError(f"{index.name}: names tensor {tensor} in {shard}, which does not hold it")


# hf


def _resolve_hf(source: Source, hub: Path, offline: bool, progress: Progress) -> Path:
    """huggingface_hub's snapshot_download into <cache>/hub. It writes each blob to a temporary file that it
    renames into place, resumes interrupted downloads and locks per file; our lock around the whole snapshot
    only makes a second process wait instead of fetching the same files alongside. A snapshot that fails
    verification is downloaded once more with force_download (a blob damaged in the cache is never refetched
    otherwise)."""
    assert source.repo_id is not None
    key = f"{source.repo_id.replace('/', '--')}@{source.revision or 'main'}"
    lock = hub / ".locks" / "loraplane" / f"{key}.lock"
    with contextlib.nullcontext() if offline else _locked(lock, progress):
        if not offline:
            progress.start(None, 0)  # a bar on a terminal; the Hub's bytes bar sets the total
        _check_hf_config(source, hub, offline, progress)
        model_dir = _hf_snapshot(source, hub, offline, progress, force=False)
        repair = "the server is offline: it cannot be fetched again" if offline else "downloading it again"
        damage = _damage(model_dir, source.uri, progress, repair)
        if damage is not None and offline:
            raise ModelSourceError(f"{source.uri}: {damage}; start the server online to fetch it again")
        if damage is not None:
            progress.start(None, 0)
            model_dir = _hf_snapshot(source, hub, offline, progress, force=True)
            verify(model_dir, progress)
    return model_dir


def _hf_snapshot(source: Source, hub: Path, offline: bool, progress: Progress, force: bool) -> Path:
    from huggingface_hub import snapshot_download

    try:
        snapshot = snapshot_download(
            source.repo_id or "",
            revision=source.revision,
            cache_dir=str(hub),
            allow_patterns=MODEL_FILESET.allow_patterns(source.subfolder),
            ignore_patterns=MODEL_FILESET.ignore_patterns(source.subfolder),
            local_files_only=offline,
            force_download=force,
            endpoint=hf_endpoint(),
            token=hf_token(),
            etag_timeout=_TIMEOUT_S,
            tqdm_class=_hub_bar(progress),
        )
    except Exception as exc:  # noqa: BLE001 - huggingface_hub's errors are mapped to reasons, the rest named
        not_cached = (
            f"not in the model cache ({hub}) and the server is offline (--offline or HF_HUB_OFFLINE=1); "
            "start it once online, or point --model-cache at a cache that holds the model"
        )
        reason, transient = hf_reason(exc, source, offline, not_cached)
        raise ModelSourceError(reason, transient=transient) from exc
    model_dir = Path(str(snapshot)) / source.subfolder
    if not (model_dir / "config.json").is_file() or not any(model_dir.glob("*.safetensors")):
        _refuse_hf_listing(source, offline)
    size = sum(p.stat().st_size for p in model_dir.iterdir() if p.is_file())
    progress.bytes_done, progress.bytes_total = size, size
    return model_dir


def _check_hf_config(source: Source, hub: Path, offline: bool, progress: Progress) -> None:
    """Fetch config.json alone first (into the same cache), so an architecture the engine lacks fails before
    gigabytes of shards download; fetch errors are left to snapshot_download, which names them, and a damaged
    config.json to verify, which has it fetched again."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    name = f"{source.subfolder}/config.json" if source.subfolder else "config.json"
    cached = try_to_load_from_cache(source.repo_id or "", name, cache_dir=str(hub), revision=source.revision)
    try:
        path = hf_hub_download(
            source.repo_id or "",
            name,
            revision=source.revision,
            cache_dir=str(hub),
            local_files_only=offline,
            endpoint=hf_endpoint(),
            token=hf_token(),
            etag_timeout=_TIMEOUT_S,
        )
    except Exception:  # noqa: BLE001 - reported by snapshot_download's attempt, with its reason
        return
    if not isinstance(cached, str):
        progress.advance(Path(path).stat().st_size)  # fetched now, outside snapshot_download's bar
    try:
        _check_config(Path(path))
    except _NotServable:
        raise
    except ModelSourceError:
        return  # damaged in the cache: verify names it, and the snapshot is fetched again


def _hub_bar(progress: Progress) -> type:
    """A tqdm class for snapshot_download that feeds its bytes bar into progress and shows nothing itself."""
    from huggingface_hub.utils import tqdm as hf_tqdm

    class HubBar(hf_tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._is_bytes = kwargs.get("name") == "huggingface_hub.snapshot_download"
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            if self._is_bytes and n:
                progress.advance(int(n), total=int(self.total) if self.total else None)
            return super().update(n)

    return HubBar


def _refuse_hf_listing(source: Source, offline: bool) -> None:
    """The snapshot lacks config.json or weights: say which, and whether the repo holds only pickle weights."""
    names: set[str] = set()
    if not offline:
        from huggingface_hub import HfApi

        sub = f"{source.subfolder}/" if source.subfolder else ""
        with contextlib.suppress(Exception):
            files = HfApi(endpoint=hf_endpoint(), token=hf_token()).list_repo_files(
                source.repo_id or "", revision=source.revision
            )
            names = {f[len(sub) :] for f in files if f.startswith(sub) and "/" not in f[len(sub) :]}
    MODEL_FILESET.check(names, source.uri)
    raise ModelSourceError(f"{source.uri}: no config.json and *.safetensors at the top of the repo")


# s3


def _resolve_s3(source: Source, cache_dir: Path, offline: bool, progress: Progress) -> Path:
    assert source.bucket is not None
    entry = cache_dir / "s3" / source.bucket / (quote(source.prefix, safe="") or "%root")
    if offline:
        if not (entry / MANIFEST).is_file():
            raise ModelSourceError(
                f"{source.uri}: not in the model cache ({entry}) and the server is offline (--offline or "
                "HF_HUB_OFFLINE=1); start it once online, or point --model-cache at a cache that holds the model"
            )
        damage = _damage(entry, source.uri, progress, "the server is offline: it cannot be fetched again")
        if damage is not None:
            raise ModelSourceError(f"{source.uri}: {damage}; start the server online to fetch it again")
        return entry
    client = s3_client(_TIMEOUT_S, MODEL_FILESET)
    for attempt in range(3):
        objects = _s3_call(source.uri, _list_model, client, source)
        try:
            with _locked(entry.with_name(entry.name + ".lock"), progress):
                _fill_s3_entry(client, source, objects, entry, progress)
            break
        except _ObjectChanged as exc:  # listed, then replaced: list again; the changed file starts over
            log.warning("model %s: %s changed during the download; listing again", source.uri, exc)
            if attempt == 2:
                raise ModelSourceError(f"{source.uri}: {exc} kept changing during the download") from exc
    progress.bytes_done = progress.bytes_total = sum(o.size for o in objects.values())
    return entry


def _fill_s3_entry(client: Any, source: Source, objects: dict[str, S3Object], entry: Path, progress: Progress) -> None:
    """Under the entry's lock: keep a cached entry that matches the listing and verifies, else download it."""
    if _read_manifest(entry) == _manifest_of(objects):
        progress.bytes_done = progress.bytes_total = sum(o.size for o in objects.values())
        if _damage(entry, source.uri, progress, "downloading it again") is None:
            return
        _discard(entry)  # all of it: a file damaged in place is not to be hard-linked into the new entry
    _s3_call(source.uri, _download_s3, client, source, objects, entry, progress)


class _ObjectChanged(Exception):
    """An object's ETag no longer matches the listing (If-Match failed)."""


def _s3_call(uri: str, fn: Callable[..., Any], *args: Any) -> Any:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return fn(*args)
    except (BotoCoreError, ClientError) as exc:
        reason, transient = s3_reason(exc, uri)
        raise ModelSourceError(reason, transient=transient) from exc


def _list_model(client: Any, source: Source) -> dict[str, S3Object]:
    objects = list_s3_files(client, source, MODEL_FILESET)
    if not objects:
        raise ModelSourceError(f"{source.uri}: no objects under this prefix (expected {MODEL_FILESET.expected()})")
    MODEL_FILESET.check(set(objects), source.uri)
    return {name: obj for name, obj in objects.items() if MODEL_FILESET.wants(name)}


def _manifest_of(objects: dict[str, S3Object]) -> dict[str, dict[str, object]]:
    return {name: {"etag": obj.etag, "size": obj.size} for name, obj in sorted(objects.items())}


def _read_manifest(entry: Path) -> dict[str, Any] | None:
    try:
        return json.loads((entry / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _download_s3(client: Any, source: Source, objects: dict[str, S3Object], entry: Path, progress: Progress) -> None:
    """Fetch into <entry>.partial (resuming what an earlier, killed download left), verify, then rename it to
    the entry with its manifest: an entry without a manifest is never complete."""
    partial = entry.with_name(entry.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    started = _forget_changed(partial, objects)
    started.update(_link_unchanged(entry, partial, objects))
    progress.start(sum(o.size for o in objects.values()), _bytes_present(partial, objects))
    for name, obj in sorted(objects.items(), key=lambda item: item[0] != "config.json"):
        if not (partial / name).is_file():  # else whole, from the same ETag
            started[name] = obj.etag
            _write_json(partial / _STARTED, started)
            _download_object(client, source.bucket or "", obj, partial / name, progress)
        if name == "config.json":
            _check_config(partial / name)  # an architecture the engine lacks fails before the shards download
    verify(partial, progress)
    _write_json(partial / MANIFEST, {"source": source.uri, "files": _manifest_of(objects)})
    old = entry.with_name(f"{entry.name}.old-{os.getpid()}")
    if entry.exists():
        os.replace(entry, old)  # a stale entry (the objects changed): out of the way, then gone
    os.replace(partial, entry)  # _STARTED goes only now: a run killed before resumes with every file kept
    (entry / _STARTED).unlink(missing_ok=True)
    shutil.rmtree(old, ignore_errors=True)


def _forget_changed(partial: Path, objects: dict[str, S3Object]) -> dict[str, str]:
    """Drop from partial every file (whole or .part) that was not started from its object's current ETag."""
    try:
        started = {k: v for k, v in json.loads((partial / _STARTED).read_text()).items() if isinstance(v, str)}
    except (OSError, ValueError, AttributeError):
        started = {}
    for path in partial.iterdir():
        name = path.name.removesuffix(".part")
        if path.name == _STARTED:
            continue
        obj = objects.get(name)
        if obj is None or started.get(name) != obj.etag or path.is_dir():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            started.pop(name, None)
    return started


def _link_unchanged(entry: Path, partial: Path, objects: dict[str, S3Object]) -> dict[str, str]:
    """Hard-link into partial the files of a stale entry whose objects did not change (a file in the cache
    is only ever replaced, never written in place, so sharing it is safe); return their ETags."""
    linked = {}
    for name, info in (_read_manifest(entry) or {}).items():
        obj, dest = objects.get(name), partial / name
        if obj is None or info != {"etag": obj.etag, "size": obj.size} or dest.exists():
            continue
        try:
            os.link(entry / name, dest)
        except OSError:
            continue  # a volume without hard links: downloaded again
        linked[name] = obj.etag
    return linked


def _bytes_present(partial: Path, objects: dict[str, S3Object]) -> int:
    total = 0
    for name, obj in objects.items():
        for path in (partial / name, partial / f"{name}.part"):
            if path.is_file():
                total += min(path.stat().st_size, obj.size)
    return total


def _download_object(client: Any, bucket: str, obj: S3Object, dest: Path, progress: Progress) -> None:
    """One object into dest via dest.part, resumed from the .part's size with a ranged GET that holds the
    listed ETag (If-Match): if the object changed since the listing, _ObjectChanged (the caller lists again);
    if the store ignored the Range and sent the whole object, the .part starts over."""
    from botocore.exceptions import ClientError

    part = dest.with_name(dest.name + ".part")
    offset = part.stat().st_size if part.is_file() else 0
    if offset > obj.size:
        part.unlink()
        offset = 0
    if offset < obj.size:
        ranged = {"Range": f"bytes={offset}-"} if offset else {}
        try:
            response = client.get_object(Bucket=bucket, Key=obj.key, IfMatch=obj.etag, **ranged)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
                raise _ObjectChanged(dest.name) from exc
            raise
        resumed = offset == 0 or _honours_range(response, offset)
        if not resumed:
            log.warning("s3 object %s: the store ignored the Range request; downloading it from the start", obj.key)
            progress.forget(offset)
        with response["Body"] as body, open(part, "ab" if resumed else "wb") as out:
            _copy_body(body, out, progress)
    size = part.stat().st_size if part.is_file() else 0
    if size != obj.size:
        raise ModelSourceError(f"{dest.name}: got {size} of {obj.size} bytes; start again to resume")
    _fsync(part)  # on disk before it counts as whole: a node crash must not leave a zero-filled tail
    os.replace(part, dest)


def _honours_range(response: dict[str, Any], offset: int) -> bool:
    """Whether a ranged GET's response starts at offset (Content-Range), or at least says so (HTTP 206)."""
    content_range = response.get("ContentRange")
    if content_range:
        return str(content_range).startswith(f"bytes {offset}-")
    return response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 206


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_body(body: Any, out: Any, progress: Progress) -> None:
    delay = float(os.environ.get(_DELAY_ENV) or 0)
    while chunk := body.read(_CHUNK):
        out.write(chunk)
        out.flush()  # the .part's size is what a resumed download starts from
        progress.advance(len(chunk))
        if delay:
            time.sleep(delay)


def _write_json(path: Path, data: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
