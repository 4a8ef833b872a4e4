"""The machine the server runs on: the CPU's ISA (cpu_features.py), torch's threads (torch_threads.py), the
CUDA device and its memory budget (device.py), and the user cache directory (user_cache.py).

May import: nothing but the shared vocabulary.
"""
