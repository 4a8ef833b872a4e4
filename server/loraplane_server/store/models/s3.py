"""s3:// models: one listing, then each object into <cache>/s3/<bucket>/<prefix>.partial (resumed by ranged
GETs that hold the listed ETag), verified, renamed into place with a manifest."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from loraplane_server.store.models.entry import TIMEOUT_S, check_config, discard, find_damage, locked, verify
from loraplane_server.store.models.progress import Progress
from loraplane_server.store.sources import (
    MODEL_FILESET,
    ModelSourceError,
    S3Object,
    Source,
    list_s3_files,
    s3_client,
    s3_reason,
)

log = logging.getLogger("loraplane.model")
MANIFEST = ".loraplane-manifest.json"  # in a complete S3 entry: the ETag and size of each file
_STARTED = ".loraplane-etags.json"  # in a .partial S3 entry: the ETag each file was started from
_CHUNK = 1 << 20
# test-only: seconds to sleep after each chunk of an S3 download, so a test (or an e2e scenario) can kill a
# download halfway or watch its progress; read by nothing but _copy_body
_DELAY_ENV = "LORAPLANE_TEST_DOWNLOAD_DELAY_S"


def resolve_s3(source: Source, cache_dir: Path, offline: bool, progress: Progress) -> Path:
    assert source.bucket is not None
    entry = cache_dir / "s3" / source.bucket / (quote(source.prefix, safe="") or "%root")
    if offline:
        if not (entry / MANIFEST).is_file():
            raise ModelSourceError(
                f"{source.uri}: not in the model cache ({entry}) and the server is offline (--offline or "
                "HF_HUB_OFFLINE=1); start it once online, or point --model-cache at a cache that holds the model"
            )
        damage = find_damage(entry, source.uri, progress, "the server is offline: it cannot be fetched again")
        if damage is not None:
            raise ModelSourceError(f"{source.uri}: {damage}; start the server online to fetch it again")
        return entry
    client = s3_client(TIMEOUT_S, MODEL_FILESET)
    for attempt in range(3):
        objects = _s3_call(source.uri, _list_model, client, source)
        try:
            with locked(entry.with_name(entry.name + ".lock"), progress):
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
        if find_damage(entry, source.uri, progress, "downloading it again") is None:
            return
        discard(entry)  # all of it: a file damaged in place is not to be hard-linked into the new entry
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
            check_config(partial / name)  # an architecture the engine lacks fails before the shards download
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
