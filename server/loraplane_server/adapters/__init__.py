"""Adapters made resident: PEFT files read and validated (weights.py), the registry with its background
loads and host tier (manager.py), the disk tier (disk_cache.py), which adapter holds which device slot
(slot_table.py), and the orchestrator between them and the engine (orchestrator.py). The LoRA compute
on the device is executor/lora/.

May import: store, executor, kernels, platforms.
"""
