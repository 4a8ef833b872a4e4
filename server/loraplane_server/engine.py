"""The engine: add_request / step / abort, and a blocking generate() on top.

One step = schedule -> one forward pass over every scheduled token -> sample -> finish checks.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplane_server import cpu_features
from loraplane_server.block_manager import BlockManager
from loraplane_server.config import EngineConfig
from loraplane_server.detokenizer import IncrementalText
from loraplane_server.errors import (
    AdapterError,
    AdapterInUseError,
    AdapterLoadError,
    EmptyPromptError,
    InvalidPromptError,
    InvalidRequestError,
    InvalidTokenIdError,
    PromptTooLongError,
    RequestFailedError,
    UnknownAdapterError,
)
from loraplane_server.layers import cpu_kernels, triton_attention
from loraplane_server.lora import backends as lora_backends
from loraplane_server.lora.disk_cache import DiskCache
from loraplane_server.lora.manager import AdapterManager, AdapterState
from loraplane_server.lora.slot_table import SlotTable
from loraplane_server.lora.slots import LoRASlots
from loraplane_server.model_runner import ModelRunner, kv_block_bytes
from loraplane_server.model_store import resolve_model
from loraplane_server.models.loader import load_model, read_config
from loraplane_server.models.registry import max_context
from loraplane_server.sampler import make_generator
from loraplane_server.sampling_params import SamplingParams
from loraplane_server.scheduler import Scheduler
from loraplane_server.sequence import FinishReason, Sequence
from loraplane_server.user_cache import cache_root


@dataclass
class RequestOutput:
    """A request's state after a step: everything generated so far, and what is new."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    logprobs: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    adapter_id: str | None = None
    error: str | None = None  # why finish_reason is "error": str(failure)
    failure: RequestFailedError | None = None
    arrival_time: float = 0.0  # time.monotonic() at add_request
    first_scheduled_time: float | None = None
    first_token_time: float | None = None


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 on CUDA and on CPUs with bf16 dot products (AVX-512 BF16, AMX), fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_features.has_bf16_compute() else torch.float32
    return getattr(torch, name)


class LLMEngine:
    def __init__(self, config: EngineConfig, on_phase: Callable[[str], None] | None = None) -> None:
        """on_phase(name) is called as start-up moves on (the HTTP server's /ready reports it): resolving
        the model, building the CPU kernels (first start on a machine), loading the weights, the rest."""
        phase = on_phase or (lambda _name: None)
        self.config = config
        self.device = torch.device(config.device)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.dtype = resolve_dtype(config.dtype, self.device)
        phase("resolving the model")
        self.model_dir = resolve_model(config, on_phase)  # downloads into the model cache, with progress
        hf_config = read_config(self.model_dir)
        self.max_model_len = min(config.max_model_len or 1 << 30, max_context(hf_config))  # checks the type
        if self.device.type == "cpu" and {config.attention_backend, config.layer_backend} & {"auto", "cpu_kernel"}:
            phase("building the CPU kernels")  # a cache hit on every start but a machine's first
            cpu_kernels.load()
        phase("loading the weights")
        model = load_model(self.model_dir, self.dtype, self.device, self.max_model_len)
        phase("allocating the KV cache and adapter slots")
        num_blocks = config.num_kv_blocks or max(
            2, config.kv_cache_bytes // kv_block_bytes(model, config.block_size, self.dtype)
        )
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.adapters = AdapterManager(
            model.args,
            self.dtype,
            config.max_lora_rank,
            config.host_cache_bytes,
            DiskCache(Path(config.disk_cache_dir or cache_root() / "adapters"), config.disk_cache_bytes),
            Path(config.adapter_dir) if config.adapter_dir else None,
        )
        self.slots = SlotTable(config.max_loras)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, self.slots, self.adapters.is_ready
        )
        self.attention_backend = _attention_backend(config.attention_backend, self.device)
        self.layer_backend = _layer_backend(config.layer_backend, self.device, self.dtype)
        self.lora_backend = lora_backends.resolve(config.lora_backend, self.layer_backend, self.device)
        self.lora_slots = LoRASlots(
            model, config.max_loras, config.max_lora_rank, self.dtype, self.device, self.lora_backend.packed_slots
        )
        self.runner = ModelRunner(
            model,
            num_blocks,
            config.block_size,
            self.dtype,
            self.device,
            self.lora_slots,
            self.lora_backend,
            decode_attention=self.attention_backend,
            layer_kernels=self.layer_backend == "cpu_kernel",
        )
        self._device_prewarm: set[str] = set()
        self._tier_goals: dict[str, str] = {}  # adapter -> the exact tier set_tier asked for, until reached
        self._errors: dict[str, RequestFailedError] = {}
        phase("loading the tokenizer")
        self.tokenizer = _load_tokenizer(self.model_dir)
        self.eos_token_ids = _eos_ids(self.model_dir, hf_config)
        self.requests: dict[str, Sequence] = {}
        self._texts: dict[str, str] = {}
        self._detok: dict[str, IncrementalText] = {}
        self._aborted: list[RequestOutput] = []
        self._counter = itertools.count()
        self.num_steps = 0
        self.last_step_tokens = 0

    # requests
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        adapter_id: str | None = None,
    ) -> str:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidPromptError(f"{self.model_dir} has no tokenizer: send token ids", param="prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
        request_id = request_id or f"req-{next(self._counter)}"
        self._validate(request_id, ids, params)
        if adapter_id is not None:
            self.adapters.request(adapter_id)  # raises UnknownAdapterError
        seq = Sequence(request_id, ids, params, adapter_id)
        self.requests[request_id] = seq
        self._texts[request_id] = ""
        self._detok[request_id] = IncrementalText()
        self.runner.generators[seq.seq_id] = make_generator(params.seed, self.device)
        self.scheduler.add(seq)
        return request_id

    def _validate(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        self.check_prompt(ids)
        total = min(len(ids) + params.max_new_tokens, self.max_model_len)
        if self.block_manager.blocks_needed(total) > self.block_manager.num_blocks:
            raise InvalidPromptError(
                f"{total} tokens do not fit in the KV cache ({self.block_manager.num_blocks} "
                f"blocks of {self.block_manager.block_size})"
            )

    def check_prompt(self, ids: list[int]) -> None:
        """Every prompt's checks (add_request runs them; the HTTP API too, before it builds a request):
        EmptyPromptError, PromptTooLongError (no token left to generate), InvalidTokenIdError."""
        if not ids:
            raise EmptyPromptError()
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(len(ids), self.max_model_len)
        self.check_token_ids(ids)

    def check_token_ids(self, ids: list[int]) -> None:
        """InvalidTokenIdError naming the first id outside the model's vocabulary."""
        vocab = self.runner.model.args.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise InvalidTokenIdError(next(t for t in ids if not 0 <= t < vocab), vocab)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; its final output comes from the next step()."""
        seq = self.requests.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.finish(seq, FinishReason.ABORT)
        self._aborted.append(self._output(seq, []))
        self._release(seq)
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._aborted)

    # step
    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        outputs += self.poll_adapters()
        plan = self.scheduler.schedule()
        self.adapters.stats.hits["device"] += plan.slot_hits
        outputs += self._load_slots(plan.slot_loads)
        scheduled = [(s, n) for s, n in plan.scheduled if not s.is_finished]
        self.last_step_tokens = sum(n for _, n in scheduled)
        if not scheduled:
            if not outputs and self.scheduler.num_waiting:
                self.adapters.wait_for_completion(0.01)  # only adapter loads can unblock the queue
            return outputs
        samplers, tokens, logprobs = self.runner.run(scheduled)
        self.num_steps += 1
        now = time.monotonic()
        for seq, n in scheduled:
            seq.first_scheduled_time = seq.first_scheduled_time or now
            seq.num_computed_tokens += n
            self.block_manager.commit(seq)
        outputs += self._fail_nonfinite()
        now = time.monotonic()
        for seq, token, logprob in zip(samplers, tokens, logprobs, strict=True):
            seq.append_token(token, logprob if seq.params.logprobs else None)
            seq.first_token_time = seq.first_token_time or now
            reason = self._check_finish(seq, token)
            if reason is not None:
                self.scheduler.finish(seq, reason)
            outputs.append(self._output(seq, [token]))
            if reason is not None:
                self._release(seq)
        return outputs

    def _check_finish(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        text = self._detok[seq.request_id].update(self.decode, seq.output_token_ids)
        self._texts[seq.request_id] = text
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return FinishReason.STOP
        if p.stop:
            tail_from = max(0, seq.output_text_len - max(len(s) for s in p.stop))
            hits = [i for s in p.stop if (i := text.find(s, tail_from)) >= 0]
            seq.output_text_len = len(text)
            if hits:
                self._texts[seq.request_id] = text[: min(hits)]
                return FinishReason.STOP
        if seq.num_output_tokens >= p.max_new_tokens or len(seq) >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _output(self, seq: Sequence, new: list[int]) -> RequestOutput:
        failure = self._errors.get(seq.request_id)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            token_ids=seq.output_token_ids,
            new_token_ids=new,
            text=self._texts.get(seq.request_id, ""),
            finished=seq.is_finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            logprobs=list(seq.logprobs),
            num_cached_tokens=seq.num_cached_tokens,
            adapter_id=seq.adapter_id,
            error=None if failure is None else str(failure),
            failure=failure,
            arrival_time=seq.arrival_time,
            first_scheduled_time=seq.first_scheduled_time,
            first_token_time=seq.first_token_time,
        )

    def _release(self, seq: Sequence) -> None:
        self.requests.pop(seq.request_id, None)
        self._texts.pop(seq.request_id, None)
        self._detok.pop(seq.request_id, None)
        self._errors.pop(seq.request_id, None)
        self.runner.generators.pop(seq.seq_id, None)

    # adapters
    def poll_adapters(self) -> list[RequestOutput]:
        """Apply finished background loads: fail the waiting requests of adapters that failed."""
        outputs = []
        for adapter_id, error in self.adapters.drain_completions():
            if error is None or self.adapters.is_loading(adapter_id):
                continue  # fine, or superseded by a retry that is in flight
            self._device_prewarm.discard(adapter_id)
            for seq in self.scheduler.take_waiting(adapter_id):
                outputs.append(self._fail(seq, AdapterLoadError(adapter_id, error)))
        for adapter_id in [k for k in self.scheduler.rr if k is not None]:
            if self.adapters.was_evicted(adapter_id):
                self.adapters.request(adapter_id)  # evicted from host while its requests waited
        for adapter_id in list(self._device_prewarm):
            if self.adapters.is_ready(adapter_id) and self.slots.can_acquire(adapter_id):
                slot, needs_load = self.slots.acquire(adapter_id, ref=False)
                if needs_load:
                    self.lora_slots.load(slot, self.adapters.weights(adapter_id))
                self._device_prewarm.discard(adapter_id)
        self._advance_tier_goals()
        return outputs

    def _load_slots(self, slot_loads: list[tuple[int, str]]) -> list[RequestOutput]:
        outputs = []
        stats = self.adapters.stats
        for slot, adapter_id in slot_loads:
            stats.misses["device"] += 1
            stats.evictions["device"] += self.lora_slots.adapter_in[slot] is not None
            stats.loads["device"] += 1
            try:
                self.lora_slots.load(slot, self.adapters.weights(adapter_id))
            except (AdapterError, OSError, ValueError) as exc:
                self.lora_slots.clear(slot)
                for seq in [s for s in self.scheduler.running if s.adapter_id == adapter_id]:
                    outputs.append(self._fail(seq, AdapterLoadError(adapter_id, str(exc))))
                self.slots.evict(adapter_id)
        return outputs

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
        self._errors[seq.request_id] = error
        out = self._output(seq, [])
        self._release(seq)
        return out

    def prewarm(self, adapter_id: str, tier: str = "device", pinned: bool | None = None) -> None:
        """Move an adapter up to `tier` (device | host | disk) in the background; optionally pin it.

        A pin keeps the adapter on every tier it reaches, its device slot included, so at most
        max_loras - 1 adapters can be pinned: PinLimitError (before any change) beyond that."""
        if tier not in ("device", "host", "disk", "none"):
            raise InvalidRequestError(f"tier {tier!r}: expected device, host, disk or none", param="tier")
        if pinned:
            self.slots.check_pin(adapter_id)
        if tier != "none":
            self.adapters.prewarm(adapter_id, tier)
        if tier == "device":
            self._device_prewarm.add(adapter_id)
        if pinned is not None:
            self.adapters.set_pinned(adapter_id, pinned)
            (self.slots.pin if pinned else self.slots.unpin)(adapter_id)

    def unload(self, adapter_id: str) -> bool:
        """Forget an adapter on every tier. Refused (AdapterInUseError) while requests use or await it."""
        users = [s for s in self.requests.values() if s.adapter_id == adapter_id]
        if users:
            raise AdapterInUseError(adapter_id, len(users))
        slot = self.slots.lookup(adapter_id)
        if slot is not None:
            self.slots.evict(adapter_id)
            self.lora_slots.clear(slot)
        self.slots.unpin(adapter_id)  # also when it never reached a slot: a stale pin would count against the limit
        self._device_prewarm.discard(adapter_id)
        self._tier_goals.pop(adapter_id, None)
        return self.adapters.unregister(adapter_id)

    # exact tiers
    def set_tier(self, adapter_id: str, tier: str) -> dict:
        """Move a known adapter to exactly `tier` (device | host | disk) and return its residency row.

        Promotion loads it as prewarm does. Demotion frees: the device slot at once, or once the running
        requests that use it finish (the row's tier stays "device" meanwhile, "target_tier" says the goal);
        to disk also the host copy. Demoting below device clears a pin. Later requests may promote it again.
        UnknownAdapterError for an unknown adapter, InvalidRequestError for another tier."""
        if tier not in ("device", "host", "disk"):
            raise InvalidRequestError(f"tier {tier!r}: expected device, host or disk", param="tier")
        if self.adapters.lookup(adapter_id) is None:
            raise UnknownAdapterError(adapter_id)
        self._tier_goals[adapter_id] = tier
        if tier == "device":
            self.prewarm(adapter_id, "device")
        else:
            self._device_prewarm.discard(adapter_id)
            self.adapters.set_pinned(adapter_id, False)
            self.slots.unpin(adapter_id)
        self._advance_tier_goal(adapter_id, tier)
        return next(r for r in self.adapter_residency() if r["id"] == adapter_id)

    def _advance_tier_goals(self) -> None:
        for adapter_id, tier in list(self._tier_goals.items()):
            rec = self.adapters.records.get(adapter_id)
            if rec is None or rec.state == AdapterState.FAILED:
                del self._tier_goals[adapter_id]  # its load failed: the row's state and last_error say why
            else:
                self._advance_tier_goal(adapter_id, tier)

    def _advance_tier_goal(self, adapter_id: str, tier: str) -> None:
        if self._reach_tier(adapter_id, tier):
            del self._tier_goals[adapter_id]

    def _reach_tier(self, adapter_id: str, tier: str) -> bool:
        """One move towards `tier`; True once the adapter is there."""
        slot = self.slots.lookup(adapter_id)
        if tier == "device":
            return slot is not None
        if slot is not None:
            if not self.slots.evict(adapter_id):
                return False  # running requests use the slot: freed on a later step, after they finish
            self.lora_slots.clear(slot)
            self.adapters.stats.evictions["device"] += 1
        return self.adapters.settle(adapter_id, tier)

    def adapter_residency(self) -> list[dict]:
        """Every known adapter: tier, state, size, rank, errors, hits."""
        rows = []
        for rec in list(self.adapters.records.values()):
            slot = self.slots.lookup(rec.adapter_id)
            rows.append(
                {
                    "id": rec.adapter_id,
                    "source": rec.source.uri,
                    "state": rec.state.value,
                    "tier": "device" if slot is not None else self.adapters.tier_of(rec.adapter_id),
                    "slot": slot,
                    "rank": rec.rank,
                    "size_bytes": rec.size_bytes,
                    "target_modules": rec.target_modules,
                    "pinned": rec.pinned,
                    "last_error": rec.last_error,
                    "error_transient": rec.error_transient,  # a failed load: may trying again later succeed
                    "hits": rec.hits,
                    "loads": rec.loads,
                    "load_seconds": rec.load_seconds,
                    "running": 0 if slot is None else self.slots.refs[slot],
                    "target_tier": self._tier_goals.get(rec.adapter_id),
                }
            )
        return rows

    def decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

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


def _attention_backend(requested: str, device: torch.device) -> str:
    """auto: Triton on CUDA, the compiled CPU kernel on the CPU when it builds here, torch otherwise."""
    if requested == "triton" or (requested == "auto" and device.type == "cuda"):
        if triton_attention.triton_available():
            return "triton"
        if requested == "triton":
            raise RuntimeError("attention_backend=triton: triton is not usable here (needs CUDA or TRITON_INTERPRET=1)")
        return "torch"
    if requested == "cpu_kernel":
        if device.type != "cpu":
            raise ValueError("attention_backend=cpu_kernel runs on the CPU only")
        if not cpu_kernels.load():
            raise RuntimeError(f"attention_backend=cpu_kernel: the kernel did not build: {cpu_kernels.load_error()}")
        return "cpu_kernel"
    if requested == "auto" and device.type == "cpu" and cpu_kernels.load():
        return "cpu_kernel"
    return "torch"


def _layer_backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """auto: the compiled bf16 layer kernels (linear, fused norm/rotary/activation, BGMV, the one-call
    decoder layer) on the CPU in bf16 when the library holds them (built for AVX-512 BF16); torch
    otherwise. An explicit cpu_kernel that cannot run here fails now, not at the first step."""
    if requested == "cpu_kernel":
        if device.type != "cpu":
            raise ValueError("layer_backend=cpu_kernel runs on the CPU only")
        if dtype != torch.bfloat16:
            raise ValueError("layer_backend=cpu_kernel needs dtype bfloat16 (its kernels are bf16)")
        if not cpu_kernels.load():
            raise RuntimeError(f"layer_backend=cpu_kernel: the kernel did not build: {cpu_kernels.load_error()}")
        if not cpu_kernels.has_bf16_kernels():
            raise RuntimeError(
                f"layer_backend=cpu_kernel needs AVX-512 BF16; {cpu_kernels.missing_bf16_kernels()}. "
                "Use layer_backend auto or torch."
            )
        return "cpu_kernel"
    if requested == "auto" and device.type == "cpu" and dtype == torch.bfloat16 and cpu_kernels.has_bf16_kernels():
        return "cpu_kernel"
    return "torch"


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
