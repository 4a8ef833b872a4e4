"""The built-in model by name (or any --model URI) -> a model directory, through the model cache in its
default place: what `make model`, the tests, the benches and the examples call (the server itself resolves
its --model with the configured cache, model_store.resolve_model)."""

from __future__ import annotations

from pathlib import Path

from loraplane_server.store import models as model_store
from loraplane_server.store.gguf_models import find_gguf

__all__ = ["find_gguf", "resolve_model"]  # find_gguf: the tests find the built-in GGUF here


def resolve_model(model: str) -> Path:
    """Any --model URI (a built-in name, a directory, a .gguf file, hf://, s3://) -> a model directory."""
    return model_store.resolve(model, model_store.default_cache_dir())
