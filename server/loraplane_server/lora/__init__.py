"""Adapters: PEFT loading and validation, tiered cache, device slots, batched LoRA compute."""
