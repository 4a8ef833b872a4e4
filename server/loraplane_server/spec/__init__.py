"""Speculative decoding: the `Speculator` the engine's step loop calls (speculator.py: propose, fill, accept,
drop), the decisions (policy.py: prompt lookup's n-gram index, each sequence's k, the draft's gate and plan)
and the draft model (draft.py). Verification is sampling and lives in executor/verifier.py.

May import: executor, kernels, platforms.
"""
