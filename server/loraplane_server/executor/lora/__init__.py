"""Batched LoRA on the device: the stacked slot tensors (slots.py) and the backends that apply every row's
own adapter in one batch (backends/: torch, the CPU kernel, Triton SGMV)."""
