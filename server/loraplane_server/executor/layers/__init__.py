"""The model's building blocks: projections that adapters target (linear.py), int8 weights (quant.py),
RMSNorm (norm.py) and rotary embeddings (rotary.py); each runs its CPU kernel or Triton kernel where one applies.

May import: executor.forward_batch, executor.lora.layout, kernels.
"""
