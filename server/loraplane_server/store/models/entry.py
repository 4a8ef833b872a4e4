"""One cache entry: its file lock (a second process waits), its verification, and discarding a damaged one."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from loraplane_server.store.models.progress import Progress
from loraplane_server.store.sources import MODEL_FILESET, ModelSourceError

log = logging.getLogger("loraplane.model")
TIMEOUT_S = 60.0


@contextlib.contextmanager
def locked(path: Path, progress: Progress) -> Iterator[None]:
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
    check_config(model_dir / "config.json")
    shards = sorted(n for n in names if n.endswith(".safetensors") and MODEL_FILESET.wants(n))
    tensors = {name: _shard_keys(model_dir / name) for name in shards}
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        _check_index(index, tensors)


class NotServable(ModelSourceError):
    """config.json parses but names a model this engine cannot serve: fetching it again would not help."""


def find_damage(entry: Path, uri: str, progress: Progress, repair: str) -> ModelSourceError | None:
    """Verify an entry that an earlier run left in the cache: None when it is whole, else why not (logged with
    `repair`, what the caller does about it). A model this engine cannot serve raises: the entry is kept."""
    try:
        verify(entry, progress)
    except NotServable:
        raise
    except ModelSourceError as exc:
        log.warning("model %s: the cached copy in %s is damaged (%s); %s", uri, entry, exc, repair)
        return exc
    return None


def discard(entry: Path) -> None:
    """Remove a cache entry (the caller holds its lock): renamed away first, so it vanishes at once."""
    old = entry.with_name(f"{entry.name}.old-{os.getpid()}")
    os.replace(entry, old)
    shutil.rmtree(old, ignore_errors=True)


def check_config(path: Path) -> None:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelSourceError(f"config.json: not valid JSON ({exc})") from exc
    if not isinstance(config, dict) or not config.get("model_type"):
        raise NotServable("config.json: no model_type (expected a Hugging Face transformers model config)")
    from loraplane_server.executor.models.quantized import UnsupportedQuantizationError, checkpoint_quantization
    from loraplane_server.executor.models.registry import UnsupportedModelError, family_of

    try:
        family_of(config)
        checkpoint_quantization(config)
    except UnsupportedModelError as exc:
        raise NotServable(f"config.json: {exc}") from exc
    except UnsupportedQuantizationError as exc:
        raise NotServable(str(exc)) from exc


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
