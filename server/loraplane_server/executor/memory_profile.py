"""The start-up profiling step of the GPU memory budget (device.py's plan_gpu_memory): the largest step the
scheduler can form, run once after the weights and adapter slots are in place, so the KV cache gets the
memory its activations leave. The step is built here as plain sequences and run through the model runner
like any other (its sampling included)."""

from __future__ import annotations

import torch

from loraplane_server.executor.model_runner import ModelRunner
from loraplane_server.sampling_params import SamplingParams
from loraplane_server.sequence import Sequence

# sampled rows sort their logits (top-p): the profile samples as the dearest request would
PROFILE_PARAMS = SamplingParams(max_new_tokens=1, temperature=1.0, top_p=0.9, top_k=50)


def profile_chunks(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[tuple[int, int]]:
    """The largest step, as (context tokens, chunk tokens) per sequence: the token budget spread over as many
    sequences as may run (each chunk within the context), the first chunk at the end of a full-length context,
    so the step also pays the prefill attention's widest read of the cache."""
    num_tokens = min(max_num_batched_tokens, max_num_seqs * max_model_len)
    num_seqs = max(1, min(max_num_seqs, num_tokens))
    base, extra = divmod(num_tokens, num_seqs)
    sizes = [base + (1 if i < extra else 0) for i in range(num_seqs)]
    return [(max_model_len - sizes[0], sizes[0])] + [(0, n) for n in sizes[1:]]


def profile_blocks(chunks: list[tuple[int, int]], block_size: int) -> int:
    """The KV blocks the profiling step's sequences hold."""
    return sum(-(-(ctx + n) // block_size) for ctx, n in chunks)


def profile_step(chunks: list[tuple[int, int]], block_size: int) -> list[tuple[Sequence, int]]:
    """The step as the scheduler would hand it to the runner: each sequence with its context computed already
    and its blocks laid out one after another from block 0."""
    scheduled = []
    next_block = 0
    for i, (ctx, n) in enumerate(chunks):
        seq = Sequence(f"profile-{i}", [0] * (ctx + n), PROFILE_PARAMS)
        seq.generator = None
        seq.num_computed_tokens = ctx
        num_blocks = -(-(ctx + n) // block_size)
        seq.block_table = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        scheduled.append((seq, n))
    return scheduled


def measure_peak_step(runner: ModelRunner, scheduled: list[tuple[Sequence, int]]) -> tuple[int, int]:
    """Run the step on the runner's CUDA device: (torch's peak allocated bytes, the device's bytes in use outside
    torch's allocator: other processes', and this one's CUDA context, cuBLAS and Triton workspaces)."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    runner.run(scheduled)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    return peak, max(0, total - free - torch.cuda.memory_reserved(device))
