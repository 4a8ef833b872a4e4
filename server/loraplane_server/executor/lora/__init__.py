"""Batched LoRA on the device: what it knows of a model and of an adapter (layout.py), the slot tensors
(slots.py) and the backends that apply every row's own adapter in one batch (backends/: torch, the CPU
kernel, Triton SGMV).

May import: kernels.
"""
