"""The model cache: a --model URI -> a local model directory, verified and ready to load.

Kinds (parsed by sources/, which adapters share): a built-in name (converted once from its GGUF), a local
directory (used in place), a local .gguf file (dequantized once), hf://org/repo[@revision][/subfolder] and
s3://bucket/prefix. What is converted or fetched from S3 lives under one cache directory (--model-cache):

    <cache>/<built-in name>/            converted built-in models
    <cache>/gguf/<stem>-<key>/          converted GGUF files (key: absolute path, size, mtime)
    <cache>/s3/<bucket>/<prefix>/       S3 models (the prefix quoted into one path component), with a manifest
    <cache>/served/<name>               links `loraplane pull --link` leaves (a vLLM pod's stable model path)

hf:// models live in the standard Hugging Face hub cache (huggingface_hub's own layout), the one vLLM,
transformers and huggingface-cli read and write, so each engine finds what another downloaded: HF_HUB_CACHE,
else $HF_HOME/hub, else <cache>/hub when --model-cache is given (a shared volume holds them too), else
huggingface_hub's default (~/.cache/huggingface/hub); see hf.hub_cache.

Every entry appears atomically (a directory renamed into place), so a half-written model is never loaded,
and a file lock per entry makes a second process on a shared volume wait ("waiting") for the first one's
download rather than race it. Before a model is used its files are verified (see `verify`), under that lock;
a cached entry that fails is discarded (with a warning) and fetched or converted once more.

Modules: resolver (the entry point; built-ins, directories, .gguf), entry (lock, verification), hf, s3 (one
kind each), progress (`Progress` for /ready). A test that patches a name patches it in the module that looks
it up, not here.

May import: store.gguf_models, store.sources, executor.models, platforms.
"""

from loraplane_server.store.models.entry import verify
from loraplane_server.store.models.hf import HubCache, hub_cache
from loraplane_server.store.models.progress import Progress, StartupListener
from loraplane_server.store.models.resolver import default_cache_dir, resolve, resolve_model
from loraplane_server.store.models.s3 import MANIFEST

__all__ = [
    "MANIFEST",
    "HubCache",
    "Progress",
    "StartupListener",
    "default_cache_dir",
    "hub_cache",
    "resolve",
    "resolve_model",
    "verify",
]
