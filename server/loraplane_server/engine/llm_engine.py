"""The engine: add_request / step / abort, and a blocking generate() on top.

One step = schedule -> one forward pass over every scheduled token -> sample -> finish checks.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from loraplane_server.adapters.disk_cache import DiskCache
from loraplane_server.adapters.manager import AdapterManager
from loraplane_server.adapters.orchestrator import AdapterOrchestrator
from loraplane_server.adapters.slot_table import SlotTable
from loraplane_server.config import CPU_KV_CACHE_BYTES, EngineConfig
from loraplane_server.detokenizer import decoder_for
from loraplane_server.engine.block_manager import BlockManager, peak_blocks
from loraplane_server.engine.input_processor import CheckedPrompt, InputProcessor
from loraplane_server.engine.kv_groups import HybridBlocks
from loraplane_server.engine.scheduler import Scheduler
from loraplane_server.engine.snapshot import EngineSnapshot, take_snapshot
from loraplane_server.errors import (
    InvalidRequestError,
    RequestFailedError,
)
from loraplane_server.executor.backends import resolve_backends
from loraplane_server.executor.memory_profile import measure_peak_step, profile_blocks, profile_chunks, profile_step
from loraplane_server.executor.model_runner import ModelRunner, kv_block_bytes
from loraplane_server.executor.models.args import ModelArgs
from loraplane_server.executor.models.llama import LlamaForCausalLM
from loraplane_server.executor.models.loader import checkpoint_bytes, load_model, read_config
from loraplane_server.executor.models.registry import max_context, model_args
from loraplane_server.executor.sampler import make_generator
from loraplane_server.executor.structured import GrammarRejectedError, Grammars
from loraplane_server.kernels import cpu_kernels
from loraplane_server.platforms import cpu_features
from loraplane_server.platforms.device import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DeviceError,
    MemoryPlan,
    check_weights_fit,
    device_info,
    plan_gpu_memory,
    resolve_device,
)
from loraplane_server.platforms.user_cache import cache_root
from loraplane_server.request_output import RequestOutput as RequestOutput  # its home before; importers keep it
from loraplane_server.sampling_params import SamplingParams
from loraplane_server.sequence import FinishReason, Sequence
from loraplane_server.spec.draft import DraftModel, check_vocabulary, weight_bytes
from loraplane_server.spec.speculator import Speculator
from loraplane_server.store.models import resolve_model

log = logging.getLogger("loraplane.engine")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA (fp16 on a GPU older than Ampere, which has no bf16), on CPUs with bf16 dot products
    (AVX-512 BF16, AMX) and where the CPU kernels have their bf16 paths (AVX2: half the bytes of fp32 per weight
    and KV row); fp32 elsewhere (torch's own bf16 kernels without either are slower than its fp32 ones)."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
        fast_bf16 = cpu_features.has_bf16_compute() or cpu_kernels.has_bf16_kernels()
        return torch.bfloat16 if fast_bf16 else torch.float32
    return getattr(torch, name)


class LLMEngine:
    def __init__(self, config: EngineConfig, on_phase: Callable[[str], None] | None = None) -> None:
        """on_phase(name) is called as start-up moves on (the HTTP server's /ready reports it): resolving
        the model, building the CPU kernels (first start on a machine), loading the weights, the rest."""
        phase = on_phase or (lambda _name: None)
        self.config = config
        self.device = resolve_device(config.device)  # an explicit CUDA device that cannot serve raises here
        gpu_free = self._claim_gpu(config)  # (total, free) bytes before this engine takes any; None on the CPU
        self.device_info = device_info(self.device, cpu_features.describe())
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.dtype = resolve_dtype(config.dtype, self.device)
        phase("resolving the model")
        self.model_dir = resolve_model(config, on_phase)  # downloads into the model cache, with progress
        hf_config = read_config(self.model_dir)
        self.model_context = max_context(hf_config)  # checks the type
        self.max_model_len = min(config.max_model_len or 1 << 30, self.model_context)
        tokenizer: Any = None  # the model's (a transformers tokenizer), loaded early to check a draft's against
        draft_dir: Path | None = None
        draft_args: ModelArgs | None = None
        draft_max_len = self.max_model_len
        if config.draft_model:  # resolved and checked against the model's tokenizer before any weight loads
            phase("resolving the draft model")
            draft_dir = resolve_model(replace(config, model=config.draft_model), on_phase, flag="--draft-model")
            draft_config = read_config(draft_dir)
            draft_args = model_args(draft_config)
            draft_max_len = min(self.max_model_len, max_context(draft_config))
            tokenizer = _load_tokenizer(self.model_dir)
            check_vocabulary(tokenizer, _load_tokenizer(draft_dir), model_args(hf_config), draft_args)
        if self.device.type == "cpu" and {config.attention_backend, config.layer_backend} & {"auto", "cpu_kernel"}:
            phase("building the CPU kernels")  # a cache hit on every start but a machine's first
            cpu_kernels.load()
        if gpu_free is not None:
            int8 = config.quantization == "int8"
            need = checkpoint_bytes(self.model_dir, self.dtype, int8)
            need += checkpoint_bytes(draft_dir, self.dtype, int8) if draft_dir is not None else 0
            check_weights_fit(need, *gpu_free, self.gpu_memory_utilization)
        phase("loading the weights")
        model = load_model(self.model_dir, self.dtype, self.device, self.max_model_len)
        if config.quantization == "int8":
            phase("quantizing the weights to int8")
            model.quantize_int8()
        draft_weights = None
        if draft_dir is not None:  # before the KV cache: on CUDA its weights come off the budget first
            phase("loading the draft model")
            draft_weights = load_model(draft_dir, self.dtype, self.device, draft_max_len)
            if config.quantization == "int8":
                draft_weights.quantize_int8()
        phase("allocating the KV cache and adapter slots")
        block_bytes = kv_block_bytes(model.args, config.block_size, self.dtype)
        if draft_args is not None:  # the draft's K/V lives in the same blocks: each block holds both
            block_bytes += kv_block_bytes(draft_args, config.block_size, self.dtype)
        self.backends = resolve_backends(config, self.device, self.dtype)
        self.attention_backend = self.backends.attention.name
        self.layer_backend = self.backends.layer_backend
        self.lora_backend = self.backends.lora
        self.lora_slots = self.lora_backend.make_slots(
            model.lora_shapes(), model.args.num_layers, config.max_loras, config.max_lora_rank, self.dtype
        )
        self.memory_plan: MemoryPlan | None = None
        if gpu_free is not None and config.num_kv_blocks is None and config.kv_cache_bytes is None:
            phase("profiling a step for the GPU memory budget")
            self.memory_plan = self._plan_gpu_memory(model, draft_args, block_bytes, gpu_free)
            log.info("%s; %d adapter slots", self.memory_plan.describe(), config.max_loras)
        graphs = self._graphs_mode()
        num_blocks = self._num_blocks(block_bytes) - (graphs is not None)  # the plan's last block: graphs' scratch
        window_blocks = 0  # a model with global and sliding layers: the sliding layers' pool (kv_groups.py)
        if self._is_hybrid(model.args):
            num_blocks, window_blocks = self._split_pools(num_blocks, model.args, draft_args)
            self.block_manager: BlockManager = HybridBlocks(
                num_blocks,
                window_blocks,
                config.block_size,
                max(model.args.sliding_windows),
                config.enable_prefix_caching,
                config.max_num_batched_tokens,
            )
        else:
            self.block_manager = BlockManager(
                num_blocks,
                config.block_size,
                config.enable_prefix_caching,
                window=self._kv_window(model.args, draft_args),
                step_tokens=config.max_num_batched_tokens,
            )
        self._log_context()
        manager = AdapterManager(
            model.args,
            self.dtype,
            config.max_lora_rank,
            config.host_cache_bytes,
            DiskCache(Path(config.disk_cache_dir or cache_root() / "adapters"), config.disk_cache_bytes),
            Path(config.adapter_dir) if config.adapter_dir else None,
            pin_host=self.device.type == "cuda",
        )
        self.slots = SlotTable(config.max_loras)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, self.slots, manager.is_ready
        )
        self.runner = ModelRunner(
            model,
            num_blocks,
            config.block_size,
            self.dtype,
            self.device,
            self.backends,
            self.lora_slots,
            scratch_block=graphs is not None,
            window_blocks=window_blocks,
        )
        if graphs is not None:
            phase("capturing CUDA graphs" if graphs == "capture" else "decode graph buffers")
            self.runner.use_graphs(config.max_num_seqs, self.max_model_len, capture=graphs == "capture")
        draft = None
        if draft_dir is not None and draft_weights is not None:
            draft = DraftModel(
                draft_weights,
                draft_dir,
                draft_max_len,
                num_blocks,
                config.block_size,
                self.dtype,
                self.device,
                self.backends,
                model.args.vocab_size,
            )
        ratio = draft.weight_bytes / weight_bytes(model) if draft is not None else 0.0
        self.speculator = Speculator(config, self.max_model_len, draft, ratio)
        log.info("engine: %s", self.describe())
        phase("loading the tokenizer")
        self.tokenizer = tokenizer if draft_dir is not None else _load_tokenizer(self.model_dir)
        self._decode = decoder_for(self.tokenizer) if self.tokenizer is not None else None
        self.eos_token_ids = _eos_ids(self.model_dir, hf_config)
        # structured output: one compiler per engine, over the logits' width (the lm_head's, maybe past the tokenizer)
        self.grammars = None
        if self.tokenizer is not None:
            self.grammars = Grammars(self.tokenizer, model.args.vocab_size, self.eos_token_ids)
        self.inputs = InputProcessor(
            self.tokenizer,
            self.model_dir,
            self.max_model_len,
            model.args.vocab_size,
            self.block_manager,
            self.speculator.method,
            self.grammars,
        )
        self.requests: dict[str, Sequence] = {}  # unfinished requests; each holds its own state
        self.adapters = AdapterOrchestrator(  # the engine's one adapter API
            manager, self.slots, self.lora_slots, self.scheduler, self.requests, self._fail
        )
        self._aborted: list[RequestOutput] = []
        self._counter = itertools.count()
        self.num_steps = 0
        self.last_step_tokens = 0

    @property
    def gpu_memory_utilization(self) -> float:
        return self.config.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION

    def _claim_gpu(self, config: EngineConfig) -> tuple[int, int] | None:
        """On CUDA: make the device current and read (total, free) bytes before the engine takes any. On the
        CPU: refuse the GPU-only options rather than ignore them."""
        if self.device.type != "cuda":
            if config.gpu_memory_utilization is not None:
                raise DeviceError(
                    f"--gpu-memory-utilization applies to CUDA devices; this engine runs on the {self.device}"
                )
            return None
        torch.cuda.set_device(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return total, free

    def _plan_gpu_memory(
        self, model: LlamaForCausalLM, draft_args: ModelArgs | None, block_bytes: int, gpu_free: tuple[int, int]
    ) -> MemoryPlan:
        """Profile the largest step on a KV cache just big enough for it, then give the KV cache what the budget
        leaves (device.py); a model that does not fit raises GPUMemoryError with the bytes."""
        config = self.config
        chunks = profile_chunks(config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len)
        blocks = profile_blocks(chunks, config.block_size)
        runner = ModelRunner(model, blocks, config.block_size, self.dtype, self.device, self.backends, self.lora_slots)
        profile_kv = sum(p.numel() * p.element_size() for p in runner.kv_pools)
        peak, device_used = measure_peak_step(runner, profile_step(chunks, config.block_size))
        del runner
        torch.cuda.empty_cache()
        total, free_at_start = gpu_free
        # of what the device holds outside torch now, other processes (and our CUDA context) held it at start
        non_torch = max(0, device_used - (total - free_at_start))
        return plan_gpu_memory(
            total,
            free_at_start,
            self.gpu_memory_utilization,
            peak - profile_kv,
            non_torch,
            block_bytes,
            # one request of the longest context, + the decode graphs' scratch block
            min_blocks=peak_blocks(
                self.max_model_len,
                config.block_size,
                self._kv_window(model.args, draft_args),
                config.max_num_batched_tokens,
            )
            + 1,
        )

    def _log_context(self) -> None:
        """Which bound set the context (the model's, --max-model-len), and the KV cache's where it holds less."""
        why = "--max-model-len" if self.max_model_len < self.model_context else "the model's own"
        blocks = self.block_manager
        if blocks.fits(self.max_model_len):
            log.info("context: %d tokens (%s); one request of it fits the KV cache", self.max_model_len, why)
            return
        low, high = 1, self.max_model_len  # the longest request the KV cache holds: fits() is monotone
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if blocks.fits(mid) else (low, mid - 1)
        log.warning(
            "context: %d tokens (%s), but the KV cache (%d blocks of %d) holds one request of at most %d tokens: "
            "longer ones are refused (give the KV cache more memory)",
            self.max_model_len,
            why,
            blocks.num_blocks,
            blocks.block_size,
            low,
        )

    @staticmethod
    def _is_hybrid(args: ModelArgs) -> bool:
        """Global and sliding layers both (Gemma 3): the sliding layers' K/V gets a pool of its own."""
        windows = args.sliding_windows
        return any(windows) and not all(windows)

    def _split_pools(self, num_blocks: int, args: ModelArgs, draft_args: ModelArgs | None) -> tuple[int, int]:
        """num_blocks blocks of every layer's K/V (and the draft's) as the global layers' pool (the draft's K/V
        with it) and the sliding layers' pool: the latter as big as every running sequence's window and a step
        need at once, never more blocks than the global pool has; the global pool the rest of the bytes."""
        config, bs = self.config, self.config.block_size
        per_layer = kv_block_bytes(args, bs, self.dtype) // args.num_layers
        num_window_layers = sum(1 for w in args.sliding_windows if w)
        window_bytes = per_layer * num_window_layers
        global_bytes = per_layer * (args.num_layers - num_window_layers)
        if draft_args is not None:
            global_bytes += kv_block_bytes(draft_args, bs, self.dtype)
        budget = num_blocks * (window_bytes + global_bytes)
        held = -(-(max(args.sliding_windows) - 1) // bs) + 2  # a decoding sequence's window, block-aligned
        need = config.max_num_seqs * held + -(-config.max_num_batched_tokens // bs)
        num_window = max(2, min(need, num_blocks))
        num_global = max(2, (budget - num_window * window_bytes) // global_bytes)
        log.info(
            "KV cache: %d blocks for the %d global layers, %d for the %d sliding layers (window %d)",
            num_global,
            args.num_layers - num_window_layers,
            num_window,
            num_window_layers,
            max(args.sliding_windows),
        )
        return num_global, num_window

    @staticmethod
    def _kv_window(args: ModelArgs, draft_args: ModelArgs | None) -> int:
        """The window past which no layer reads a sequence's KV blocks (the block manager releases what lies
        before it), or 0: some layer attends everything (Gemma 3's global layers), or a draft model shares the
        blocks (its own positions may lag the target's)."""
        windows = args.sliding_windows
        return max(windows) if windows and all(windows) and draft_args is None else 0

    def _graphs_mode(self) -> str | None:
        """capture: decode steps as CUDA graphs (on CUDA, the Triton attention and LoRA backends, unless
        --enforce-eager); None: every step eager. (The tests set "eager": the graphs' static buffers without a
        capture, on the CPU.)"""
        eligible = (
            self.attention_backend == "triton"
            and self.lora_backend.name == "triton"
            and not self.backends.layer_kernels
        )
        return "capture" if self.device.type == "cuda" and not self.config.enforce_eager and eligible else None

    def _decode_mode(self) -> str:
        """How decode steps run, for describe()."""
        if self.runner.graphs is not None:
            return self.runner.graphs.describe()
        if self.config.enforce_eager:
            return "decode eager (--enforce-eager)"
        backends = f"{self.attention_backend} attention, {self.lora_backend.name} LoRA"
        return f"decode eager (CUDA graphs need the triton attention and LoRA backends, not {backends})"

    def _num_blocks(self, block_bytes: int) -> int:
        """KV blocks: the GPU plan's, else --num-kv-blocks, else what kv_cache_bytes buys (1 GiB on the CPU)."""
        if self.memory_plan is not None:
            return self.memory_plan.num_blocks
        kv_bytes = self.config.kv_cache_bytes or CPU_KV_CACHE_BYTES
        return self.config.num_kv_blocks or max(2, kv_bytes // block_bytes)

    def describe(self) -> str:
        """One line of what runs where: the CPU (or device), dtype, the kernels' ISA, every backend."""
        if self.device.type == "cpu":
            isa = cpu_kernels.loaded_isa()
            where = f"{cpu_features.describe()}, kernels built for {isa or 'none (torch only)'}"
        else:
            where = f"{self.device_info.describe()}, {self._decode_mode()}"
        dtype = str(self.dtype).removeprefix("torch.")
        if self.runner.model.int8:
            dtype += " (int8 weights)"
        return f"{where}; {dtype}; {self.backends.describe(self.runner.model.fused_layers)}{self.speculator.describe()}"

    # requests
    def add_request(
        self,
        prompt: str | list[int] | CheckedPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        adapter_id: str | None = None,
    ) -> str:
        """Queue a request; its id. Raises the request's typed error (an EngineError). The prompt's checks
        are the input processor's (`self.inputs`); a CheckedPrompt passed them already."""
        request = self.inputs.process(prompt, params or SamplingParams())
        request_id = request_id or f"req-{next(self._counter)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        if adapter_id is not None:
            self.adapters.request(adapter_id)  # raises UnknownAdapterError
        seq = Sequence(request_id, request.token_ids, request.params, adapter_id, self.runner.model.rotary.original)
        seq.generator = make_generator(request.params.seed, self.device)
        self.speculator.start(seq, request.spec_method)
        if request.grammar is not None:
            self.runner.matchers.start(seq, request.grammar)  # released with the request (_release)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; its final output comes from the next step()."""
        seq = self.requests.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT)
        self._aborted.append(self._output(seq))
        self._release(seq)
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._aborted)

    # step
    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        outputs += self.adapters.poll()
        proposals = self.speculator.propose(self.scheduler.running)
        plan = self.scheduler.schedule()
        self.adapters.manager.stats.hits["device"] += plan.slot_hits
        outputs += self.adapters.load_slots(plan.slot_loads)
        scheduled = [(s, n) for s, n in plan.scheduled if not s.is_finished]
        start = time.perf_counter()
        drafted = self.speculator.fill(scheduled, proposals)
        self.last_step_tokens = sum(n for _, n in scheduled)
        if not scheduled:
            self.speculator.drop(proposals)
            if not outputs and self.scheduler.num_waiting:
                self.adapters.manager.wait_for_completion(0.01)  # only adapter loads can unblock the queue
            return outputs
        run_start = time.perf_counter()
        samplers, tokens, logprobs = self.runner.run(scheduled)
        end = time.perf_counter()
        self.speculator.record_step(scheduled, drafted, end - run_start, sum(map(len, tokens)), end - start)
        self.num_steps += 1
        now = time.monotonic()
        for seq, n in scheduled:
            seq.first_scheduled_time = seq.first_scheduled_time or now
            if not seq.proposed:  # a speculative sequence's computed tokens are known once verified
                seq.num_computed_tokens += n
                self.block_manager.commit(seq)
        outputs += self._fail_nonfinite()
        now = time.monotonic()
        for seq, seq_tokens, seq_logprobs in zip(samplers, tokens, logprobs, strict=True):
            seq.first_token_time = seq.first_token_time or now
            if seq.proposed:
                outputs += self._accept(seq, seq_tokens, seq_logprobs)
            else:
                outputs += self._append(seq, seq_tokens[0], seq_logprobs[0])
        self.speculator.drop(proposals)
        return outputs

    def _append(self, seq: Sequence, token: int, logprob: float) -> list[RequestOutput]:
        """One new token through the finish checks; its output."""
        kept = [logprob] if seq.params.logprobs or seq.params.top_logprobs else []
        seq.append_token(token, logprob if kept else None)
        top: list[list[tuple[int, float]]] = []
        if seq.params.top_logprobs:
            top = [seq.step_top_logprobs or []]
            seq.top_logprobs += top
            seq.step_top_logprobs = None
        try:
            reason = self._check_finish(seq, token)
        except GrammarRejectedError as exc:  # a masked row sampled a token its grammar forbids: a bug, failed alone
            return [self._fail(seq, exc)]
        if reason is not None:
            self.scheduler.finish(seq, reason)
        out = self._output(seq, [token], kept)
        out.delta_top_logprobs = top
        if seq.params.prompt_logprobs is not None and seq.num_output_tokens == 1:
            out.prompt_logprobs = seq.prompt_logprobs
        if reason is not None:
            self._release(seq)
        return [out]

    def _accept(self, seq: Sequence, tokens: list[int], logprobs: list[float]) -> list[RequestOutput]:
        """A verified run: the accepted proposals and the model's own token, one by one through the finish
        checks (a stop, EOS or max_tokens inside the run ends it there); the rejected tokens' blocks back."""
        self.speculator.accept(seq, len(tokens))
        seq.num_computed_tokens += len(tokens)  # the last token and the accepted proposals now hold K/V
        outputs: list[RequestOutput] = []
        for token, logprob in zip(tokens, logprobs, strict=True):
            outputs += self._append(seq, token, logprob)
            if seq.is_finished:
                return outputs
        self.block_manager.commit(seq)
        self.block_manager.trim(seq)
        return outputs

    def _check_finish(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        seq.detok.update(self.decode, seq.token_ids)
        # each sampled token once through a constrained sequence's matcher (a recomputed sequence's accepted
        # its output before the preemption); a complete grammar's stop (an EOS) ends it, ignore_eos or not
        if self.runner.matchers.accept(seq, token):
            return FinishReason.STOP
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return FinishReason.STOP
        if p.stop and seq.detok.find_stop():
            return FinishReason.STOP
        if seq.num_output_tokens >= p.max_new_tokens or len(seq) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _output(
        self, seq: Sequence, delta_ids: list[int] | None = None, delta_logprobs: list[float] | None = None
    ) -> RequestOutput:
        """This step's deltas; the final output also the whole text, token ids and logprobs."""
        finished, failure = seq.is_finished, seq.failure
        out = RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            delta_token_ids=delta_ids or [],
            delta_text=seq.detok.delta(finished),
            finished=finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            delta_logprobs=delta_logprobs or [],
            num_cached_tokens=seq.num_cached_tokens,
            adapter_id=seq.adapter_id,
            error=None if failure is None else str(failure),
            failure=failure,
            arrival_time=seq.arrival_time,
            first_scheduled_time=seq.first_scheduled_time,
            first_token_time=seq.first_token_time,
        )
        if seq.spec is not None:
            out.num_spec_proposed, out.num_spec_accepted = seq.spec.num_proposed, seq.spec.num_accepted
            out.num_spec_steps = seq.spec.num_steps
        if finished:
            out.token_ids, out.text, out.logprobs = seq.output_token_ids, seq.detok.text, seq.logprobs
            out.top_logprobs = seq.top_logprobs
            if seq.params.prompt_logprobs is not None:
                out.prompt_logprobs = seq.prompt_logprobs
        return out

    def _release(self, seq: Sequence) -> None:
        self.requests.pop(seq.request_id, None)
        self.runner.matchers.release(seq)

    def _fail_nonfinite(self) -> list[RequestOutput]:
        """Requests whose logits came out NaN or inf this step (the runner set them aside): each fails alone."""
        return [
            self._fail(
                seq, RequestFailedError(f"the model produced NaN or infinite values for this request{_on_adapter(seq)}")
            )
            for seq in self.runner.take_nonfinite()
        ]

    def _fail(self, seq: Sequence, error: RequestFailedError) -> RequestOutput:
        self.scheduler.finish(seq, FinishReason.ERROR)
        seq.failure = error
        out = self._output(seq)
        self._release(seq)
        return out

    # between steps
    def poll_adapters(self) -> list[RequestOutput]:
        """An idle engine's step: finished background loads applied (the waiting requests of adapters that
        failed fail), device prewarms moved on."""
        return self.adapters.poll()

    def snapshot(self, loads_seen: int = 0) -> EngineSnapshot:
        """The engine's state for the metrics, in one record (call it on the engine thread); loads_seen:
        adapter loads the caller has seen, whose times it then leaves out."""
        return take_snapshot(
            self.scheduler, self.block_manager, self.slots, self.adapters, len(self.requests), loads_seen
        )

    def decode(self, token_ids: list[int]) -> str:
        return "" if self._decode is None else self._decode(token_ids)

    # blocking API
    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (alongside anything already queued); outputs in prompt order."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        prompt_list: list[str | list[int]] = list(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompt_list, plist, strict=True)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]


def _on_adapter(seq: Sequence) -> str:
    return "" if seq.adapter_id is None else f" on adapter {seq.adapter_id!r} (numerically unstable weights)"


def _load_tokenizer(model_dir: Path):  # noqa: ANN202 - a transformers tokenizer, or None
    """The model's tokenizer; None for a directory without one (token-id prompts only)."""
    from transformers import AutoTokenizer

    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    return AutoTokenizer.from_pretrained(str(model_dir))


def _eos_ids(model_dir: Path, hf_config: dict) -> set[int]:
    ids: set[int] = set()
    sources = [hf_config]
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        sources.append(json.loads(gen.read_text()))
    for src in sources:
        eos = src.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids
