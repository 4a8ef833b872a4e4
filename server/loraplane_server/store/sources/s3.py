"""s3://bucket/prefix: the boto3 client, listing, error reasons and adapter fetches.

botocore follows no redirect out of the configured endpoint (only S3's own region redirects).
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from loraplane_server.store.sources.base import (
    ADAPTER_FILESET,
    AdapterSourceError,
    FileSet,
    Source,
    transient_status,
)
from loraplane_server.store.sources.budget import Limits, check_total, copy_stream, require_files


def s3_endpoint() -> str | None:
    """The endpoint the AWS SDK would use for S3 (None: AWS itself), read now."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def s3_client(timeout_s: float, fileset: FileSet = ADAPTER_FILESET) -> Any:
    """A boto3 S3 client; region, credentials and profiles as the AWS SDK reads them."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as exc:
        raise fileset.error(f"s3:// {fileset.what} sources need boto3: pip install 'loraplane[s3]'") from exc
    config = Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": 3})
    return boto3.session.Session().client("s3", endpoint_url=s3_endpoint(), config=config)  # env read now


@dataclass(frozen=True)
class S3Object:
    key: str
    size: int
    etag: str


def list_s3_files(client: Any, source: Source, fileset: FileSet) -> dict[str, S3Object]:
    """The objects directly under the source's prefix (a nested "sub/" is not looked at), by file name:
    the ones `fileset` takes, plus its pickle weights (so `fileset.check` can refuse a pickle-only source)."""
    assert source.bucket is not None
    prefix = f"{source.prefix}/" if source.prefix else ""
    found: dict[str, S3Object] = {}
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=source.bucket, Prefix=prefix, Delimiter="/")
    for page in pages:
        for obj in page.get("Contents", []):
            name = obj["Key"][len(prefix) :]
            pickled = any(fnmatch.fnmatchcase(name, p) for p in fileset.pickle_patterns)
            if name and (fileset.wants(name) or pickled):
                found[name] = S3Object(obj["Key"], int(obj["Size"]), obj["ETag"])
    return found


def s3_reason(exc: Exception, uri: str) -> tuple[str, bool]:
    """A botocore error as what to fix (never the credentials, a signature or a presigned URL), and whether
    trying again later may succeed (no answer, a timeout, a 5xx or 429)."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    if isinstance(exc, NoCredentialsError):
        return (
            f"{uri}: no S3 credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)",
            False,
        )
    if isinstance(exc, EndpointConnectionError):
        endpoint = _without_userinfo(s3_endpoint() or "of AWS")
        return f"{uri}: cannot reach the S3 endpoint {endpoint} (check AWS_ENDPOINT_URL)", True
    if not isinstance(exc, ClientError):
        return f"{uri}: S3 request failed ({type(exc).__name__})", True
    code = str(exc.response.get("Error", {}).get("Code", ""))
    if code in ("NoSuchBucket",):
        return f"{uri}: bucket does not exist at this endpoint", False
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"):
        return f"{uri}: access denied (check the S3 credentials)", False
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return f"{uri}: S3 error {code or 'unknown'}", transient_status(status)


def _without_userinfo(url: str) -> str:
    parts = urlsplit(url)
    if not (parts.username or parts.password):
        return url
    return parts._replace(netloc=(parts.hostname or "") + (f":{parts.port}" if parts.port else "")).geturl()


def fetch_s3(source: Source, dest: Path, limits: Limits) -> None:
    """One listing (sizes included), the budget checked against it, then one GET per adapter file."""
    client = s3_client(limits.timeout_s)
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        objects = list_s3_files(client, source, ADAPTER_FILESET)
        require_files(set(objects), source.uri)
        wanted = {name: obj for name, obj in objects.items() if ADAPTER_FILESET.wants(name)}
        check_total([obj.size for obj in wanted.values()], limits.budget, source.uri)
        for name, obj in wanted.items():
            with client.get_object(Bucket=source.bucket, Key=obj.key)["Body"] as body:
                copy_stream(body, dest / name, limits.budget, source.uri)  # counted: it may have grown
    except (BotoCoreError, ClientError) as exc:
        reason, transient = s3_reason(exc, source.uri)
        raise AdapterSourceError(reason, transient=transient) from exc
