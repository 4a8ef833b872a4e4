"""Sources of adapters and models: parse a URI, check it against an allowlist, pick the files a load needs.

Kinds: a local directory (or file://), hf://org/repo[@revision][/subfolder] (huggingface_hub, offline from
its cache when HF_HUB_OFFLINE is set), s3://bucket/prefix (boto3, honours AWS_ENDPOINT_URL) and, for
adapters, http(s)://... archives (.tar.gz, .tgz, .tar, .zip), unpacked with strict checks. A `FileSet`
says which files a load takes (ADAPTER_FILESET, MODEL_FILESET): only safetensors weights, never pickle; a
source with only pickle weights is refused. model_store.py fetches models through the same parse, file
selection, clients and error texts (list_s3_files, s3_reason, hf_reason); `fetch` below materialises adapters.

One byte budget bounds everything an adapter fetch writes (a downloaded archive and the files taken from it
together), counted before each chunk is written; decompressed archive data never touches the disk.
An http(s) source follows at most MAX_REDIRECTS redirects, each checked against the allowlist given.
"""

from __future__ import annotations

import contextlib
import fnmatch
import gzip
import http.client
import io
import os
import posixpath
import re
import shutil
import stat
import tarfile
import urllib.error
import urllib.request
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import unquote, urlsplit

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
README_FILE = "README.md"
REQUIRED_FILES = (CONFIG_FILE, WEIGHTS_FILE)
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE, README_FILE)
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
MAX_ARCHIVE_MEMBERS = 10_000
MAX_REDIRECTS = 5
_TAR_OVERHEAD = 2048  # bytes of headers and padding allowed per tar member, beyond the file data
_CHUNK = 1 << 20
_MAX_REASON = 300  # characters of an unexpected error's message kept in a reason

_HF_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_TRUE = {"1", "on", "yes", "true"}


class SourceError(Exception):
    """A source that cannot be used; the message says what to fix.

    str(error) is for admins and logs (it may name URLs and paths, never credentials); `public` says the same
    without them, for clients that may not see the server's sources.
    """

    def __init__(self, message: str, public: str | None = None, transient: bool = False) -> None:
        super().__init__(message)
        self.public = public or "the source could not be used; an admin can see why in the server's log"
        # True when trying again later may succeed (a connection failure, a timeout, a 5xx or 429 from the
        # store); False when only a change of the source or of the server's settings can (missing, refused,
        # malformed): the operator retries the first kind with backoff and fails the second at once
        self.transient = transient


class AdapterSourceError(SourceError):
    """An adapter source that cannot be used."""

    def __init__(self, message: str, public: str | None = None, transient: bool = False) -> None:
        super().__init__(
            message,
            public or "the adapter source could not be used; an admin can see why in the adapter list",
            transient,
        )


class ModelSourceError(SourceError):
    """A base model source that cannot be used (the server does not start; the message is its reason)."""


@dataclass(frozen=True)
class Source:
    """A parsed, validated URI; `uri` is its canonical form (for allowlists and cache keys)."""

    kind: str  # "local" | "hf" | "s3" | "http"
    uri: str
    path: Path | None = None  # local: absolute, symlinks kept
    repo_id: str | None = None  # hf: org/repo
    revision: str | None = None  # hf: None for the default branch
    subfolder: str = ""  # hf
    bucket: str | None = None  # s3
    prefix: str = ""  # s3: no leading or trailing "/"
    url: str | None = None  # http and https


AdapterSource = Source  # the name the adapter code has always used


# which files a load takes


@dataclass(frozen=True)
class FileSet:
    """The files of a source that a load takes (top level only); nothing else is ever fetched."""

    what: str  # "adapter" | "model"
    names: tuple[str, ...]  # taken by exact name
    patterns: tuple[str, ...]  # taken by glob (model shards)
    ignored: tuple[str, ...]  # globs never taken though a pattern matches (Mistral's consolidated.safetensors)
    required: str  # the config file without which the source is not one
    weights_glob: str  # at least one file must match
    pickle_patterns: tuple[str, ...]  # pickle weights: never taken; a source with only these is refused
    pickle_hint: str

    def wants(self, name: str) -> bool:
        if any(fnmatch.fnmatchcase(name, p) for p in self.ignored):
            return False
        return name in self.names or any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def allow_patterns(self, subfolder: str = "") -> list[str]:
        """huggingface_hub's allow_patterns for these files."""
        sub = f"{subfolder}/" if subfolder else ""
        return [sub + n for n in (*self.names, *self.patterns)]

    def ignore_patterns(self, subfolder: str = "") -> list[str]:
        """huggingface_hub's ignore_patterns: its fnmatch lets "*" match "/" too, so nested files go here."""
        sub = f"{subfolder}/" if subfolder else ""
        return [f"{sub}*/*", *(sub + n for n in self.ignored)]

    def error(self, message: str) -> SourceError:
        return AdapterSourceError(message) if self.what == "adapter" else ModelSourceError(message)

    def check(self, names: set[str], where: str) -> None:
        """Refuse (with what to fix) a set of top-level file names that a load cannot use."""
        if self.required not in names:
            raise self.error(f"{where} has no {self.required} (expected {self.expected()})")
        if any(fnmatch.fnmatchcase(n, self.weights_glob) and self.wants(n) for n in names):
            return
        pickled = sorted(n for n in names if any(fnmatch.fnmatchcase(n, p) for p in self.pickle_patterns))
        if pickled:
            shown = ", ".join(pickled[:4])
            raise self.error(f"{where} has only pickle weights ({shown}), which are never loaded; {self.pickle_hint}")
        raise self.error(f"{where} has no {self.weights_glob}")

    def expected(self) -> str:
        return "a PEFT LoRA adapter" if self.what == "adapter" else f"{self.required} and *.safetensors"


ADAPTER_FILESET = FileSet(
    what="adapter",
    names=ADAPTER_FILES,
    patterns=(),
    ignored=(),
    required=CONFIG_FILE,
    weights_glob=WEIGHTS_FILE,
    pickle_patterns=(PICKLE_FILE,),
    pickle_hint=f"save the adapter as {WEIGHTS_FILE} instead (PeftModel.save_pretrained(..., safe_serialization=True))",
)
MODEL_FILESET = FileSet(
    what="model",
    names=(
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "added_tokens.json",
        "chat_template.jinja",
        "chat_template.json",
        "model.safetensors.index.json",
    ),
    patterns=("*.safetensors",),
    ignored=("consolidated*.safetensors",),  # the same weights again in Mistral's own format
    required="config.json",
    weights_glob="*.safetensors",
    pickle_patterns=("*.bin", "*.pt", "*.pth"),
    pickle_hint="convert the weights to safetensors (model.save_pretrained(..., safe_serialization=True))",
)


# parse


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
    canonical = _canonical_http(uri)
    if not _archive_suffix(urlsplit(canonical).path):
        raise AdapterSourceError(f"URL {uri!r} must name an archive ending in {', '.join(ARCHIVE_SUFFIXES)}")
    return Source(kind="http", uri=canonical, url=canonical)


def _canonical_http(uri: str) -> str:
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


def _archive_suffix(path: str) -> str | None:
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


# fetch


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
    limits = _Limits(_Budget(max_bytes), timeout_s, None if allow is None else tuple(allow))
    fetchers = {"local": _fetch_local, "hf": _fetch_hf, "s3": _fetch_s3, "http": _fetch_http}
    try:
        fetchers[source.kind](source, dest, limits)
        _require_files({p.name for p in dest.iterdir()}, source.uri)
    except BaseException:
        _empty_dir(dest)
        raise
    return dest


class _Budget:
    """The bytes one fetch may still write; each write is counted before it happens."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit

    def check(self, nbytes: int, message: str) -> None:
        """Refuse (AdapterSourceError with message) if nbytes would not fit."""
        if nbytes > self.left:
            public = f"the adapter source is larger than the {self.limit} bytes this server allows for an adapter"
            raise AdapterSourceError(message, public=public)

    def take(self, nbytes: int, message: str) -> None:
        """Count nbytes about to be written, or refuse them if they would not fit."""
        self.check(nbytes, message)
        self.left -= nbytes


@dataclass(frozen=True)
class _Limits:
    budget: _Budget
    timeout_s: float
    allow: tuple[str, ...] | None  # None: redirects are checked for their scheme only


def _empty_dir(path: Path) -> None:
    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def _require_files(names: set[str], where: str) -> None:
    ADAPTER_FILESET.check(names, where)


def _check_total(sizes: list[int], budget: _Budget, where: str) -> None:
    total = sum(sizes)
    budget.check(total, f"{where} holds {total} bytes of adapter files, over the {budget.left} allowed")


class _Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


def _copy_stream(src: _Readable, dst: Path, budget: _Budget, where: str) -> None:
    """Copy src into the new file dst, each chunk counted against budget before it is written."""
    with open(dst, "xb") as out:
        while chunk := src.read(_CHUNK):
            budget.take(len(chunk), f"{where} is larger than the {budget.limit} bytes allowed")
            out.write(chunk)


def _copy_local_tree(src: Path, dest: Path, budget: _Budget, where: str) -> None:
    present = [n for n in ADAPTER_FILES if (src / n).is_file()]
    _require_files(set(present) | ({PICKLE_FILE} if (src / PICKLE_FILE).exists() else set()), where)
    _check_total([(src / n).stat().st_size for n in present], budget, where)
    for name in present:
        with open(src / name, "rb") as f:
            _copy_stream(f, dest / name, budget, where)  # counted: a file may grow after its stat


# local


def _fetch_local(source: Source, dest: Path, limits: _Limits) -> None:
    assert source.path is not None
    if not source.path.is_dir():
        raise AdapterSourceError(f"adapter directory {source.path} does not exist or is not a directory")
    _copy_local_tree(source.path, dest, limits.budget, source.uri)


# hf: huggingface_hub follows only the Hub's own redirects (renamed repos, its file CDN), which an adapter's
# owner cannot point elsewhere, so the allowlist entry that admitted hf://org/repo covers them


def hf_offline() -> bool:
    """HF_HUB_OFFLINE, read now (huggingface_hub reads it once, at its import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def hf_endpoint() -> str | None:
    """HF_ENDPOINT, read now for the same reason; None: the Hub."""
    return os.environ.get("HF_ENDPOINT", "").strip() or None


def hf_token() -> str | None:
    """HF_TOKEN, read now; None lets huggingface_hub use a token saved by `hf auth login`."""
    return os.environ.get("HF_TOKEN", "").strip() or None


_SECRET_ENV = ("HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "LORAPLANE_ADMIN_TOKEN")


def scrub_secrets(text: str) -> str:
    """text with the values of the credential variables masked: an error from a library we do not control
    (a start-up failure's reason or traceback) must not carry one to /ready, a log or a pod's status."""
    for name in _SECRET_ENV:
        value = os.environ.get(name, "")
        if len(value) >= 4:
            text = text.replace(value, f"<{name}>")
    return text


def _fetch_hf(source: Source, dest: Path, limits: _Limits) -> None:
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
    _copy_local_tree(Path(str(snapshot)) / source.subfolder, dest, limits.budget, source.uri)


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
        return f"{uri}: the Hub answered HTTP {status}", _transient_status(int(status))
    message = scrub_secrets(" ".join(str(exc).split()))  # scrubbed before it is cut: no secret's prefix left
    if len(message) > _MAX_REASON:
        message = message[: _MAX_REASON - 3] + "..."
    transient = status is None or _transient_status(int(status))  # no answer (connection, timeout): may pass
    return f"{uri}: download failed ({type(exc).__name__}{': ' if message else ''}{message})", transient


def _transient_status(status: int) -> bool:
    return status >= 500 or status in (408, 429)


# s3: botocore follows no redirect out of the configured endpoint (only S3's own region redirects)


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
    return f"{uri}: S3 error {code or 'unknown'}", _transient_status(status)


def _without_userinfo(url: str) -> str:
    parts = urlsplit(url)
    if not (parts.username or parts.password):
        return url
    return parts._replace(netloc=(parts.hostname or "") + (f":{parts.port}" if parts.port else "")).geturl()


def _fetch_s3(source: Source, dest: Path, limits: _Limits) -> None:
    """One listing (sizes included), the budget checked against it, then one GET per adapter file."""
    client = s3_client(limits.timeout_s)
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        objects = list_s3_files(client, source, ADAPTER_FILESET)
        _require_files(set(objects), source.uri)
        wanted = {name: obj for name, obj in objects.items() if ADAPTER_FILESET.wants(name)}
        _check_total([obj.size for obj in wanted.values()], limits.budget, source.uri)
        for name, obj in wanted.items():
            with client.get_object(Bucket=source.bucket, Key=obj.key)["Body"] as body:
                _copy_stream(body, dest / name, limits.budget, source.uri)  # counted: it may have grown
    except (BotoCoreError, ClientError) as exc:
        reason, transient = s3_reason(exc, source.uri)
        raise AdapterSourceError(reason, transient=transient) from exc


# http


def _fetch_http(source: Source, dest: Path, limits: _Limits) -> None:
    assert source.url is not None
    archive = dest / f".download{_archive_suffix(urlsplit(source.url).path)}"
    try:
        _download(source.url, archive, limits)
        _extract_adapter(archive, dest, limits.budget, source.uri)
    finally:
        for leftover in dest.glob(".download*"):
            leftover.unlink()


class _SafeRedirect(urllib.request.HTTPRedirectHandler):
    """Follows at most MAX_REDIRECTS redirects, to http(s) only, never from https down to http, and, given
    an allowlist, only to URLs it admits: the rule that admitted a source binds every hop of its download."""

    def __init__(self, allow: tuple[str, ...] | None) -> None:
        super().__init__()
        self.allow = allow
        self.num_redirects = 0

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, ANN202
        self.check_hop(req.full_url, newurl)
        return super().redirect_request(req, fp, code, msg, headers, newurl)

    def check_hop(self, old: str, new: str) -> None:
        self.num_redirects += 1
        if self.num_redirects > MAX_REDIRECTS:
            raise AdapterSourceError(
                f"{old} redirected more than {MAX_REDIRECTS} times (next to {new})",
                public=f"the adapter source redirected more than {MAX_REDIRECTS} times",
            )
        old_scheme, new_scheme = urlsplit(old).scheme, urlsplit(new).scheme
        if new_scheme not in ("http", "https") or (old_scheme == "https" and new_scheme != "https"):
            raise AdapterSourceError(
                f"refusing the redirect from {old} to {new}: only http(s), never from https to http",
                public="the adapter source redirected to a URL that is not http(s), or from https to http",
            )
        if self.allow is not None and not _is_allowed_url(new, self.allow):
            raise AdapterSourceError(
                f"refusing the redirect from {old} to {new}: every redirect must stay within "
                f"--adapter-source-allow ({', '.join(self.allow)})",
                public="the adapter source redirected outside the allowed sources; every redirect must stay "
                "within --adapter-source-allow",
            )


def _is_allowed_url(url: str, allow: tuple[str, ...]) -> bool:
    """Whether the allowlist admits an http(s) URL; a redirect target need not name an archive."""
    try:
        canonical = _canonical_http(url)
    except AdapterSourceError:
        return False
    return is_allowed(Source(kind="http", uri=canonical, url=canonical), list(allow))


def _download(url: str, dest: Path, limits: _Limits) -> None:
    opener = urllib.request.build_opener(_SafeRedirect(limits.allow))
    request = urllib.request.Request(url, headers={"User-Agent": "loraplane"})
    budget = limits.budget
    try:
        with opener.open(request, timeout=limits.timeout_s) as resp:
            length = resp.headers.get("Content-Length", "")
            if length.isdigit():  # refused before reading a byte; the body is counted as it is written
                budget.check(int(length), f"{url} is {length} bytes, more than the {budget.left} allowed")
            _copy_stream(resp, dest, budget, url)
    except urllib.error.HTTPError as exc:
        raise AdapterSourceError(
            f"cannot download {url}: HTTP {exc.code} {exc.reason}", transient=_transient_status(exc.code)
        ) from exc
    except (urllib.error.URLError, TimeoutError, OSError, http.client.HTTPException) as exc:
        raise AdapterSourceError(f"cannot download {url}: {type(exc).__name__}: {exc}", transient=True) from exc


# archives


@dataclass(frozen=True)
class _Member:
    name: str  # normalised, relative
    size: int
    is_dir: bool
    ref: tarfile.TarInfo | zipfile.ZipInfo


def _extract_adapter(archive: Path, dest: Path, budget: _Budget, where: str) -> None:
    """Check every member of the archive, then write only the adapter files into dest, within budget."""
    try:
        if archive.name.endswith(".zip"):
            with zipfile.ZipFile(archive) as zf:
                files = _checked_members(_zip_members(zf, where), budget, where)
                _write_files(files, zf.open, dest, budget, where)  # type: ignore[arg-type]
        else:
            with _open_tar(archive, budget.limit, where) as tf:
                files = _checked_members(_tar_members(tf, where), budget, where)
                _write_files(files, tf.extractfile, dest, budget, where)  # type: ignore[arg-type]
    except (tarfile.TarError, zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError) as exc:
        raise AdapterSourceError(f"{where}: cannot unpack the archive ({type(exc).__name__}: {exc})") from exc


@contextlib.contextmanager
def _open_tar(archive: Path, max_bytes: int, where: str) -> Iterator[tarfile.TarFile]:
    """A plain tar, or a .tar.gz decompressed as it is read (never to disk), capped so that neither data
    nor tar headers (a GNU long name is read into memory whole) can blow up."""
    if archive.name.endswith(".tar"):
        with tarfile.open(archive, "r:") as tf:  # "r:": no decompression without a cap
            yield tf
        return
    cap = max_bytes + _TAR_OVERHEAD * (MAX_ARCHIVE_MEMBERS + 2)
    with gzip.GzipFile(archive, "rb") as gz:
        capped = _CappedReader(gz, cap, where)
        with tarfile.open(fileobj=capped, mode="r:") as tf:  # type: ignore[call-overload]
            yield tf


class _CappedReader:
    """A seekable view of a decompressing stream that refuses to read or seek past `cap` bytes."""

    def __init__(self, raw: gzip.GzipFile, cap: int, where: str) -> None:
        self._raw, self._cap, self._where = raw, cap, where

    def _check(self, end: int) -> None:
        if end > self._cap:
            raise AdapterSourceError(
                f"{self._where} (unpacked) is larger than the {self._cap} bytes allowed",
                public=f"the adapter archive unpacks to more than the {self._cap} bytes allowed",
            )

    def read(self, size: int = -1, /) -> bytes:
        self._check(self._raw.tell() + (size if size >= 0 else self._cap + 1))
        return self._raw.read(size)

    def seek(self, offset: int, whence: int = os.SEEK_SET, /) -> int:
        if whence not in (os.SEEK_SET, os.SEEK_CUR):
            raise io.UnsupportedOperation("seek from the end of a compressed stream")
        target = offset + (self._raw.tell() if whence == os.SEEK_CUR else 0)
        self._check(target)
        return self._raw.seek(target)

    def tell(self) -> int:
        return self._raw.tell()


def _safe_name(raw: str, where: str) -> str:
    name = raw.replace("\\", "/")
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name):
        raise AdapterSourceError(f"{where}: archive member {raw!r} has an absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise AdapterSourceError(f"{where}: archive member {raw!r} has a '..' path component")
    return "/".join(parts)


def _refuse_type(raw: str, is_link: bool, where: str) -> None:
    what = "link" if is_link else "special file"
    raise AdapterSourceError(
        f"{where}: archive member {raw!r} is a {what}; only plain files and directories are allowed"
    )


def _tar_members(tf: tarfile.TarFile, where: str) -> Iterator[_Member]:
    for info in tf:
        if not (info.isreg() or info.isdir()):
            _refuse_type(info.name, info.issym() or info.islnk(), where)
        yield _Member(_safe_name(info.name, where), info.size, info.isdir(), info)


def _zip_members(zf: zipfile.ZipFile, where: str) -> Iterator[_Member]:
    for info in zf.infolist():
        kind = stat.S_IFMT(info.external_attr >> 16)  # 0 when the writer recorded no file type
        if info.create_system == 3 and kind not in (0, stat.S_IFREG, stat.S_IFDIR):
            _refuse_type(info.filename, kind == stat.S_IFLNK, where)
        if info.flag_bits & 0x1:
            raise AdapterSourceError(f"{where}: archive member {info.filename!r} is encrypted")
        yield _Member(_safe_name(info.filename, where), info.file_size, info.is_dir(), info)


def _checked_members(members: Iterator[_Member], budget: _Budget, where: str) -> dict[str, _Member]:
    """Check every member (count, declared sizes against what budget has left, names, types) before
    anything is written; return the plain files by name."""
    files: dict[str, _Member] = {}
    total = 0
    for count, member in enumerate(members, start=1):
        if count > MAX_ARCHIVE_MEMBERS:
            raise AdapterSourceError(f"{where}: archive has more than {MAX_ARCHIVE_MEMBERS} members")
        total += member.size
        budget.check(total, f"{where}: archive unpacks to more than the {budget.left} bytes left of {budget.limit}")
        if member.is_dir or not member.name:
            continue
        if member.name in files:
            raise AdapterSourceError(f"{where}: archive holds {member.name!r} more than once")
        files[member.name] = member
    return files


def _adapter_base(names: set[str], where: str) -> str:
    """The folder inside the archive that holds the adapter: the root, or its single top-level directory."""
    if CONFIG_FILE in names:
        return ""
    visible = {n for n in names if not n.startswith("__MACOSX/") and not posixpath.basename(n).startswith("._")}
    tops = {n.split("/", 1)[0] for n in visible}
    if len(tops) == 1 and all("/" in n for n in visible):
        return f"{tops.pop()}/"
    shown = ", ".join(sorted(names)[:8]) or "nothing"
    raise AdapterSourceError(
        f"{where}: expected {CONFIG_FILE} at the archive root or in one top-level directory; found {shown}"
    )


def _write_files(
    files: dict[str, _Member],
    open_member: Callable[[tarfile.TarInfo | zipfile.ZipInfo], IO[bytes]],
    dest: Path,
    budget: _Budget,
    where: str,
) -> None:
    base = _adapter_base(set(files), where)
    inside = {n[len(base) :] for n in files if n.startswith(base) and "/" not in n[len(base) :]}
    _require_files(inside, where)
    for name in ADAPTER_FILES:
        if name in inside:
            with open_member(files[base + name].ref) as src:
                _copy_stream(src, dest / name, budget, where)
