"""One engine step on the device: the model runner (model_runner.py: a step's tensors, the forward, sampling),
its batch record (forward_batch.py), the backends chosen at start (backends.py), sampling and speculative
verification (sampler.py, verifier.py), CUDA graphs and the GPU memory profile, and what the forward is made
of: models/, layers/, attention/ and lora/ (the batched LoRA compute and its device slots).

May import: kernels, platforms.
"""
