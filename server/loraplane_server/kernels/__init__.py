"""The compiled kernels: the C++ CPU kernels (csrc/) with their build and loader (cpu_kernels.py), and the
Triton kernels for CUDA (triton_attention.py, triton_int8.py, triton_lora.py). executor/ wraps them.

May import: platforms.
"""
