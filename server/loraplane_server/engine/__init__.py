"""The engine core: `LLMEngine` (llm_engine.py: add_request / step / abort), `AsyncEngine` (its stepping
thread and asyncio streams), the scheduler (continuous batching, chunked prefill, per-adapter fairness) and
the block manager (paged KV bookkeeping, prefix cache). It decides what runs; executor/ runs it.

May import: spec, adapters, store, executor, kernels, platforms.
"""
