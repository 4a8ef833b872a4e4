"""Sources of adapters and models: parse a URI, check it against an allowlist, pick the files a load needs.

Kinds: a local directory (or file://), hf://org/repo[@revision][/subfolder] (huggingface_hub, offline from
its cache when HF_HUB_OFFLINE is set), s3://bucket/prefix (boto3, honours AWS_ENDPOINT_URL) and, for
adapters, http(s)://... archives (.tar.gz, .tgz, .tar, .zip), unpacked with strict checks. A `FileSet`
says which files a load takes (ADAPTER_FILESET, MODEL_FILESET): only safetensors weights, never pickle; a
source with only pickle weights is refused. model_store/ fetches models through the same parse, file
selection, clients and error texts (list_s3_files, s3_reason, hf_reason); `fetch` materialises adapters.

One byte budget bounds everything an adapter fetch writes (a downloaded archive and the files taken from it
together), counted before each chunk is written; decompressed archive data never touches the disk.
An http(s) source follows at most MAX_REDIRECTS redirects, each checked against the allowlist given.

Modules: base (Source, errors, FileSet), parse (URIs, allowlist), budget (the byte budget and counted copies),
adapter_fetch (`fetch`), hf, s3, http (one kind each), archive (unpacking). A test that patches a name
patches it in the module that looks it up, not here.

May import: nothing but the shared vocabulary.
"""

from loraplane_server.store.sources.adapter_fetch import fetch
from loraplane_server.store.sources.archive import MAX_ARCHIVE_MEMBERS
from loraplane_server.store.sources.base import (
    ADAPTER_FILES,
    ADAPTER_FILESET,
    CONFIG_FILE,
    MODEL_FILESET,
    PICKLE_FILE,
    README_FILE,
    REQUIRED_FILES,
    WEIGHTS_FILE,
    AdapterSource,
    AdapterSourceError,
    FileSet,
    ModelSourceError,
    Source,
    SourceError,
    scrub_secrets,
)
from loraplane_server.store.sources.hf import hf_endpoint, hf_offline, hf_reason, hf_token
from loraplane_server.store.sources.http import MAX_REDIRECTS
from loraplane_server.store.sources.parse import ARCHIVE_SUFFIXES, is_allowed, parse_source
from loraplane_server.store.sources.s3 import S3Object, list_s3_files, s3_client, s3_endpoint, s3_reason

__all__ = [
    "ADAPTER_FILES",
    "ADAPTER_FILESET",
    "ARCHIVE_SUFFIXES",
    "CONFIG_FILE",
    "MAX_ARCHIVE_MEMBERS",
    "MAX_REDIRECTS",
    "MODEL_FILESET",
    "PICKLE_FILE",
    "README_FILE",
    "REQUIRED_FILES",
    "WEIGHTS_FILE",
    "AdapterSource",
    "AdapterSourceError",
    "FileSet",
    "ModelSourceError",
    "S3Object",
    "Source",
    "SourceError",
    "fetch",
    "hf_endpoint",
    "hf_offline",
    "hf_reason",
    "hf_token",
    "is_allowed",
    "list_s3_files",
    "parse_source",
    "s3_client",
    "s3_endpoint",
    "s3_reason",
    "scrub_secrets",
]
