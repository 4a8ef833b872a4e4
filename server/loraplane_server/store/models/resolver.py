"""The entry point: a --model URI -> a verified local directory; built-in names, local directories and .gguf
files here, hf:// (in the Hugging Face hub cache, `hub_cache`) and s3:// in their own modules."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from loraplane_server.config import EngineConfig
from loraplane_server.platforms.user_cache import cache_root
from loraplane_server.store.gguf_models import BUILTIN_MODELS, convert_gguf, find_gguf
from loraplane_server.store.models.entry import discard, find_damage, locked, verify
from loraplane_server.store.models.hf import HubCache, hub_cache, resolve_hf
from loraplane_server.store.models.progress import Progress, StartupListener
from loraplane_server.store.models.s3 import resolve_s3
from loraplane_server.store.sources import ModelSourceError, SourceError, hf_offline, parse_source


def default_cache_dir() -> Path:
    return cache_root() / "models"


def resolve_model(config: EngineConfig, on_phase: Callable[[str], None] | None = None, flag: str = "--model") -> Path:
    """The engine's entry: config.model -> a verified model directory (the Progress rides on a StartupListener).
    flag: the option errors name (the draft model comes through here too)."""
    listener = on_phase if isinstance(on_phase, StartupListener) else None
    progress = listener.progress_for(flag, config.model) if listener else Progress(config.model)
    if progress.phase == "pending":  # a draft model's, waiting until now
        progress.set_phase("resolving")
    explicit = Path(config.model_cache).expanduser() if config.model_cache else None
    cache = explicit or default_cache_dir()
    return resolve(config.model, cache, config.offline, progress, flag, hub=hub_cache(explicit))


def resolve(
    uri: str,
    cache_dir: Path,
    offline: bool = False,
    progress: Progress | None = None,
    flag: str = "--model",
    hub: HubCache | None = None,
) -> Path:
    """A model URI -> a local directory ready to load; ModelSourceError says what to fix otherwise.

    offline (or HF_HUB_OFFLINE=1): only what the cache (or the local disk) holds, no network call.
    hub: where hf:// models live; None: hub_cache(cache_dir), cache_dir counting as an explicit --model-cache
    (HF_HUB_CACHE and HF_HOME still come first)."""
    progress = progress or Progress(uri)
    try:
        path = _resolve(uri.strip(), cache_dir, hub or hub_cache(cache_dir), offline or hf_offline(), progress)
    except ModelSourceError:
        raise
    except SourceError as exc:  # the URI itself, in parse_source's words (shared with adapters)
        raise ModelSourceError(f"{flag} {uri.strip()}: {exc}") from exc
    progress.set_phase("loading")
    return path


def _resolve(uri: str, cache_dir: Path, hub: HubCache, offline: bool, progress: Progress) -> Path:
    if uri in BUILTIN_MODELS:
        return _convert_once(uri, lambda: find_gguf(uri), cache_dir / uri, progress)
    source = parse_source(uri)
    if source.kind == "hf":
        return resolve_hf(source, hub, offline, progress)
    if source.kind == "s3":
        return resolve_s3(source, cache_dir, offline, progress)
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
    with locked(out.with_name(out.name + ".lock"), progress):
        if out.exists():
            if find_damage(out, uri, progress, "converting it again") is None:
                return out
            discard(out)
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
