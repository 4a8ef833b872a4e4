"""hf://org/repo[@revision][/subfolder]: huggingface_hub's settings read now, adapter fetches, error reasons.

huggingface_hub follows only the Hub's own redirects (renamed repos, its file CDN), which an adapter's owner
cannot point elsewhere, so the allowlist entry that admitted hf://org/repo covers them.
"""

from __future__ import annotations

import os
from pathlib import Path

from loraplane_server.store.sources.base import (
    ADAPTER_FILESET,
    AdapterSourceError,
    Source,
    scrub_secrets,
    transient_status,
)
from loraplane_server.store.sources.budget import Limits, copy_local_tree

_TRUE = {"1", "on", "yes", "true"}
_MAX_REASON = 300  # characters of an unexpected error's message kept in a reason


def hf_offline() -> bool:
    """HF_HUB_OFFLINE, read now (huggingface_hub reads it once, at its import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hf_endpoint() -> str | None:
    """HF_ENDPOINT, read now for the same reason; None: the Hub."""
    return os.environ.get("HF_ENDPOINT", "").strip() or None


def hf_token() -> str | None:
    """HF_TOKEN, read now; None lets huggingface_hub use a token saved by `hf auth login`."""
    return os.environ.get("HF_TOKEN", "").strip() or None


def fetch_hf(source: Source, dest: Path, limits: Limits) -> None:
    from huggingface_hub import snapshot_download

    assert source.repo_id is not None
    offline = hf_offline()
    try:
        snapshot = snapshot_download(
            source.repo_id,
            revision=source.revision,
            allow_patterns=ADAPTER_FILESET.allow_patterns(source.subfolder),
            cache_dir=os.environ.get("HF_HUB_CACHE") or None,  # read now, not at huggingface_hub's import
            local_files_only=offline,
            etag_timeout=limits.timeout_s,
            endpoint=hf_endpoint(),
            token=hf_token(),
        )
    except Exception as exc:  # noqa: BLE001 - huggingface_hub's errors are mapped to reasons, the rest named
        not_cached = (
            "not in the local Hugging Face cache and HF_HUB_OFFLINE is set; download it once online, or point "
            "HF_HUB_CACHE at a cache that holds it"
        )
        reason, transient = hf_reason(exc, source, offline, not_cached)
        raise AdapterSourceError(reason, transient=transient) from exc
    copy_local_tree(Path(str(snapshot)) / source.subfolder, dest, limits.budget, source.uri)


def hf_reason(exc: Exception, source: Source, offline: bool, not_cached: str) -> tuple[str, bool]:
    """A huggingface_hub failure as what to fix (never the token), and whether trying again later may succeed
    (no answer, a timeout, a 5xx or 429). `not_cached`: what to do when offline and the cache lacks the source."""
    from huggingface_hub import errors

    uri = source.uri
    incomplete = getattr(errors, "IncompleteSnapshotError", errors.LocalEntryNotFoundError)  # huggingface_hub 1.x+
    if isinstance(exc, (errors.LocalEntryNotFoundError, incomplete, errors.OfflineModeIsEnabled)):
        if offline:
            return f"{uri}: {not_cached}", False
        return f"{uri}: cannot reach the Hub at {hf_endpoint() or 'https://huggingface.co'} (check the network)", True
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"{uri}: revision {source.revision or 'main'} not found", False
    if isinstance(exc, errors.GatedRepoError):
        return (
            f"{uri}: gated repository: accept its conditions on the Hub and set HF_TOKEN of an account with access",
            False,
        )
    if isinstance(exc, errors.RepositoryNotFoundError):
        if hf_token() is None:
            return f"{uri}: repository not found (check the repo id; a private repo needs HF_TOKEN)", False
        return f"{uri}: repository not found, or HF_TOKEN cannot read it (check the repo id and the token)", False
    if isinstance(exc, errors.EntryNotFoundError):
        return f"{uri}: a file of the repository could not be found on the Hub; try again or pin a revision", False
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, errors.HfHubHTTPError) and status is not None:
        if status in (401, 403):
            return f"{uri}: access denied (HTTP {status}); check HF_TOKEN", False
        return f"{uri}: the Hub answered HTTP {status}", transient_status(int(status))
    message = scrub_secrets(" ".join(str(exc).split()))  # scrubbed before it is cut: no secret's prefix left
    if len(message) > _MAX_REASON:
        message = message[: _MAX_REASON - 3] + "..."
    transient = status is None or transient_status(int(status))  # no answer (connection, timeout): may pass
    return f"{uri}: download failed ({type(exc).__name__}{': ' if message else ''}{message})", transient
