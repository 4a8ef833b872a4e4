"""Where models and adapters come from: sources/ (local, file://, hf://, s3://, http(s) archives, the
allowlist), models/ (the model cache: a `--model` URI to a verified directory), gguf_models.py (GGUF files
converted) and builtin.py (the built-in model).

May import: executor, kernels, platforms.
"""
