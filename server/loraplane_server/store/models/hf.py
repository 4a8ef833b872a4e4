"""hf:// models: huggingface_hub's snapshot_download into the standard Hugging Face hub cache (`hub_cache`:
HF_HUB_CACHE, $HF_HOME/hub, <--model-cache>/hub or huggingface_hub's default), so a model that vLLM,
transformers or huggingface-cli downloaded is used as it is, and one this server downloads serves them too;
config.json checked before the shards."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraplane_server.store.models.entry import TIMEOUT_S, NotServable, check_config, find_damage, locked, verify
from loraplane_server.store.models.progress import Progress
from loraplane_server.store.sources import MODEL_FILESET, ModelSourceError, Source, hf_endpoint, hf_reason, hf_token


@dataclass(frozen=True)
class HubCache:
    """Where hf:// models live, and what chose that place (an offline miss names both, so the fix is plain)."""

    path: Path
    origin: str  # "set by HF_HUB_CACHE" | "set by HF_HOME" | "under --model-cache" | "huggingface_hub's default"


def hub_cache(model_cache: Path | None) -> HubCache:
    """The hub cache huggingface_hub itself would use, so every engine on the machine (or pod) shares one copy:
    HF_HUB_CACHE, else $HF_HOME/hub, else <model_cache>/hub when a model cache was given explicitly (a shared
    volume keeps its documented layout), else $XDG_CACHE_HOME/huggingface/hub or ~/.cache/huggingface/hub.
    Read at each call: huggingface_hub reads these once, at its import."""
    env = {name: os.path.expandvars(os.environ.get(name, "").strip()) for name in ("HF_HUB_CACHE", "HF_HOME")}
    if env["HF_HUB_CACHE"]:
        return HubCache(Path(env["HF_HUB_CACHE"]).expanduser(), "set by HF_HUB_CACHE")
    if env["HF_HOME"]:
        return HubCache(Path(env["HF_HOME"]).expanduser() / "hub", "set by HF_HOME")
    if model_cache is not None:
        return HubCache(model_cache / "hub", "under --model-cache")
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip() or "~/.cache"
    return HubCache(Path(xdg).expanduser() / "huggingface" / "hub", "huggingface_hub's default")


def resolve_hf(source: Source, cache: HubCache, offline: bool, progress: Progress) -> Path:
    """huggingface_hub's snapshot_download into the hub cache. It writes each blob to a temporary file that it
    renames into place, resumes interrupted downloads and locks per file; our lock around the whole snapshot
    only makes a second process wait instead of fetching the same files alongside. A snapshot that fails
    verification is downloaded once more with force_download (a blob damaged in the cache is never refetched
    otherwise)."""
    assert source.repo_id is not None
    hub = cache.path
    key = f"{source.repo_id.replace('/', '--')}@{source.revision or 'main'}"
    lock = hub / ".locks" / "loraplane" / f"{key}.lock"
    with contextlib.nullcontext() if offline else locked(lock, progress):
        if not offline:
            progress.start(None, 0)  # a bar on a terminal; the Hub's bytes bar sets the total
        _check_hf_config(source, hub, offline, progress)
        model_dir = _hf_snapshot(source, cache, offline, progress, force=False)
        repair = "the server is offline: it cannot be fetched again" if offline else "downloading it again"
        damage = find_damage(model_dir, source.uri, progress, repair)
        if damage is not None and offline:
            raise ModelSourceError(f"{source.uri}: {damage}; start the server online to fetch it again")
        if damage is not None:
            progress.start(None, 0)
            model_dir = _hf_snapshot(source, cache, offline, progress, force=True)
            verify(model_dir, progress)
    return model_dir


def _hf_snapshot(source: Source, cache: HubCache, offline: bool, progress: Progress, force: bool) -> Path:
    from huggingface_hub import snapshot_download

    try:
        snapshot = snapshot_download(
            source.repo_id or "",
            revision=source.revision,
            cache_dir=str(cache.path),
            allow_patterns=MODEL_FILESET.allow_patterns(source.subfolder),
            ignore_patterns=MODEL_FILESET.ignore_patterns(source.subfolder),
            local_files_only=offline,
            force_download=force,
            endpoint=hf_endpoint(),
            token=hf_token(),
            etag_timeout=TIMEOUT_S,
            tqdm_class=_hub_bar(progress),
        )
    except Exception as exc:  # noqa: BLE001 - huggingface_hub's errors are mapped to reasons, the rest named
        not_cached = (
            f"not in the model cache ({cache.path}: the Hugging Face hub cache, {cache.origin}) and the server is "
            "offline (--offline or HF_HUB_OFFLINE=1); start it once online, or point HF_HUB_CACHE (or HF_HOME, or "
            "--model-cache when neither is set) at a hub cache that holds the model"
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
            etag_timeout=TIMEOUT_S,
        )
    except Exception:  # noqa: BLE001 - reported by snapshot_download's attempt, with its reason
        return
    if not isinstance(cached, str):
        progress.advance(Path(path).stat().st_size)  # fetched now, outside snapshot_download's bar
    try:
        check_config(Path(path))
    except NotServable:
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
