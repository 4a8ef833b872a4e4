"""Parse a source URI (local path, file://, hf://, s3://, http(s):// archive) and check it against an allowlist."""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from loraplane_server.store.sources.base import ADAPTER_FILES, PICKLE_FILE, AdapterSourceError, Source

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def parse_source(uri: str) -> Source:
    """Parse a local path, file://, hf://, s3:// or http(s):// archive URI; AdapterSourceError if invalid."""
    uri = uri.strip()
    if not uri:
        raise AdapterSourceError("empty source")
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in uri):  # no path or URL holds them; a NUL breaks every syscall
        raise AdapterSourceError(f"source {uri!r} contains control characters")
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
    if scheme in ("", "file"):
        return _parse_local(uri)
    if scheme == "hf":
        return _parse_hf(uri[len("hf://") :])
    if scheme == "s3":
        return _parse_s3(uri[len("s3://") :])
    if scheme in ("http", "https"):
        return _parse_http(uri)
    raise AdapterSourceError(
        f"unsupported source scheme {scheme!r} in {uri!r}; use a local path, file://, hf://org/repo, "
        "s3://bucket/prefix or an http(s):// .tar.gz/.tgz/.tar/.zip archive"
    )


def _parse_local(uri: str) -> Source:
    if uri.lower().startswith("file://"):
        parts = urlsplit(uri)
        if parts.netloc not in ("", "localhost"):
            raise AdapterSourceError(f"file:// URI {uri!r} names a remote host; use file:///absolute/path")
        uri = unquote(parts.path)
    try:
        path = Path(uri).expanduser().absolute()
    except RuntimeError as exc:  # ~user of a user this system does not have
        raise AdapterSourceError(f"adapter source {uri!r}: {exc}") from exc
    return Source(kind="local", uri=str(path), path=path)


def _check_segments(text: str, what: str) -> None:
    if "\\" in text or any(seg in (".", "..") for seg in text.split("/")):
        raise AdapterSourceError(f"{what} {text!r} must not hold '.' or '..' segments or backslashes")


def _parse_hf(rest: str) -> Source:
    parts = rest.strip("/").split("/")
    if len(parts) < 2:
        raise AdapterSourceError(f"hf:// sources look like hf://org/repo[@revision][/subfolder], not hf://{rest}")
    name, at, revision = parts[1].partition("@")
    repo_id, subfolder = f"{parts[0]}/{name}", "/".join(p for p in parts[2:] if p)
    if not _HF_REPO.match(repo_id):
        raise AdapterSourceError(f"invalid Hugging Face repo id {repo_id!r} in hf://{rest}")
    if at and not revision:
        raise AdapterSourceError(f"empty revision after '@' in hf://{rest}")
    if subfolder:
        _check_segments(subfolder, "subfolder")
    uri = f"hf://{repo_id}" + (f"@{revision}" if revision else "") + (f"/{subfolder}" if subfolder else "")
    return Source(kind="hf", uri=uri, repo_id=repo_id, revision=revision or None, subfolder=subfolder)


def _parse_s3(rest: str) -> Source:
    bucket, _, prefix = rest.partition("/")
    prefix = prefix.strip("/")
    if not _S3_BUCKET.match(bucket):
        raise AdapterSourceError(f"invalid S3 bucket name {bucket!r} in s3://{rest}")
    if prefix:
        _check_segments(prefix, "S3 prefix")
    uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
    return Source(kind="s3", uri=uri, bucket=bucket, prefix=prefix)


def _parse_http(uri: str) -> Source:
    canonical = canonical_http(uri)
    if not archive_suffix(urlsplit(canonical).path):
        raise AdapterSourceError(f"URL {uri!r} must name an archive ending in {', '.join(ARCHIVE_SUFFIXES)}")
    return Source(kind="http", uri=canonical, url=canonical)


def canonical_http(uri: str) -> str:
    """The canonical form of an http(s) URL (lower-case scheme and host, no fragment); refused if unsafe."""
    parts = urlsplit(uri)
    try:
        port = parts.port
    except ValueError as exc:
        raise AdapterSourceError(f"URL {uri!r} has an invalid port") from exc
    if not parts.hostname:
        raise AdapterSourceError(f"URL {uri!r} has no host")
    if parts.username is not None or parts.password is not None:
        raise AdapterSourceError(f"URL {uri!r} embeds credentials; serve the archive without them in the URL")
    _check_segments(unquote(parts.path), "URL path")
    netloc = parts.hostname.lower() + (f":{port}" if port else "")
    return f"{parts.scheme.lower()}://{netloc}{parts.path}" + (f"?{parts.query}" if parts.query else "")


def archive_suffix(path: str) -> str | None:
    lower = path.lower()
    return next((s for s in ARCHIVE_SUFFIXES if lower.endswith(s)), None)


# allowlist


def is_allowed(source: Source, allow: list[str]) -> bool:
    """Whether an allowlist entry admits the source; an empty list admits nothing.

    Entries are URI prefixes ("hf://", "hf://org/", "s3://bucket/", "https://host/"), matched on whole
    segments ("s3://bucket" does not admit "s3://bucket-2/x"), or local directories: a local source is
    admitted when its real path (symlinks resolved), and that of each adapter file in it, lies inside.
    """
    return any(_entry_admits(entry.strip(), source) for entry in allow if entry.strip())


def _entry_admits(entry: str, source: Source) -> bool:
    if "://" not in entry or entry.lower().startswith("file://"):
        return source.kind == "local" and _local_inside(source, _parse_local(entry).path)
    scheme, _, rest = entry.partition("://")
    entry = f"{scheme.lower()}://{rest}"
    if source.kind == "local" or not source.uri.startswith(entry):
        return False
    if entry.endswith("/") or len(entry) == len(source.uri):
        return True
    return source.uri[len(entry)] in ("/@?" if source.kind == "hf" else "/?")


def _local_inside(source: Source, root: Path | None) -> bool:
    assert source.path is not None and root is not None
    real_root = Path(os.path.realpath(root))
    paths = [source.path] + [source.path / name for name in (*ADAPTER_FILES, PICKLE_FILE)]
    return all(
        Path(os.path.realpath(p)).is_relative_to(real_root) for p in paths if p == source.path or os.path.lexists(p)
    )
