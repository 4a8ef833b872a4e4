"""`fetch`: materialise an adapter's files from any kind of source, within one byte budget."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from loraplane_server.store.sources.base import AdapterSourceError, Source
from loraplane_server.store.sources.budget import Budget, Limits, copy_local_tree, require_files
from loraplane_server.store.sources.hf import fetch_hf
from loraplane_server.store.sources.http import fetch_http
from loraplane_server.store.sources.s3 import fetch_s3


def fetch(
    source: Source,
    dest: Path,
    max_bytes: int = 2 << 30,
    timeout_s: float = 60,
    allow: Sequence[str] | None = None,
) -> Path:
    """Materialise the adapter files into dest (created if missing, must be empty) and return dest.

    Writes only adapter_config.json, adapter_model.safetensors and README.md (if present); at most
    max_bytes are ever written, a downloaded archive and its files counted together. With `allow`, every
    redirect of an http(s) source must be admitted by it (see is_allowed). On failure dest is left empty
    and AdapterSourceError says why.
    """
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.iterdir()):
        raise AdapterSourceError(f"fetch destination {dest} is not empty")
    limits = Limits(Budget(max_bytes), timeout_s, None if allow is None else tuple(allow))
    fetchers = {"local": _fetch_local, "hf": fetch_hf, "s3": fetch_s3, "http": fetch_http}
    try:
        fetchers[source.kind](source, dest, limits)
        require_files({p.name for p in dest.iterdir()}, source.uri)
    except BaseException:
        _empty_dir(dest)
        raise
    return dest


def _empty_dir(path: Path) -> None:
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


# local


def _fetch_local(source: Source, dest: Path, limits: Limits) -> None:
    assert source.path is not None
    if not source.path.is_dir():
        raise AdapterSourceError(f"adapter directory {source.path} does not exist or is not a directory")
    copy_local_tree(source.path, dest, limits.budget, source.uri)
