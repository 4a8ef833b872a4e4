"""The model families (llama.py and the families built on it: qwen3, phi3, gemma3), their shapes (args.py),
the registry of supported architectures (registry.py), the loader of safetensors checkpoints (loader.py) and
pre-quantized int8 checkpoints (quantized.py).

May import: executor.attention, executor.backends, executor.forward_batch, executor.layers, executor.lora, kernels.
"""
