"""The engine: add_request / step / abort, and a blocking generate() on top.

One step = schedule -> one forward pass over every scheduled token -> sample -> finish checks.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraplane_server.block_manager import BlockManager
from loraplane_server.builtin import resolve_model
from loraplane_server.config import EngineConfig
from loraplane_server.model_runner import ModelRunner, kv_block_bytes
from loraplane_server.models.loader import load_model, read_config
from loraplane_server.sampler import make_generator
from loraplane_server.sampling_params import SamplingParams
from loraplane_server.scheduler import Scheduler
from loraplane_server.sequence import FinishReason, Sequence


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
    error: str | None = None


def cpu_has_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_bf16() else torch.float32
    return getattr(torch, name)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_dir = resolve_model(config.model)
        hf_config = read_config(self.model_dir)
        self.max_model_len = min(config.max_model_len or 1 << 30, hf_config.get("max_position_embeddings", 4096))
        model = load_model(self.model_dir, self.dtype, self.device, self.max_model_len)
        num_blocks = config.num_kv_blocks or max(
            2, config.kv_cache_bytes // kv_block_bytes(model, config.block_size, self.dtype)
        )
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, num_blocks, config.block_size, self.dtype, self.device)
        self.tokenizer = _load_tokenizer(self.model_dir)
        self.eos_token_ids = _eos_ids(self.model_dir, hf_config)
        self.requests: dict[str, Sequence] = {}
        self._texts: dict[str, str] = {}
        self._aborted: list[RequestOutput] = []
        self._counter = itertools.count()
        self.num_steps = 0

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
                raise ValueError(f"{self.model_dir} has no tokenizer: send token ids")
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
        request_id = request_id or f"req-{next(self._counter)}"
        self._validate(request_id, ids, params)
        seq = Sequence(request_id, ids, params, adapter_id)
        self.requests[request_id] = seq
        self._texts[request_id] = ""
        self.runner.generators[seq.seq_id] = make_generator(params.seed, self.device)
        self.scheduler.add(seq)
        return request_id

    def _validate(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} "
                "tokens, and at least one must be left to generate"
            )
        vocab = self.runner.model.args.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        total = min(len(ids) + params.max_new_tokens, self.max_model_len)
        if self.block_manager.blocks_needed(total) > self.block_manager.num_blocks:
            raise ValueError(
                f"{total} tokens do not fit in the KV cache ({self.block_manager.num_blocks} "
                f"blocks of {self.block_manager.block_size})"
            )

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
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return outputs
        samplers, tokens, logprobs = self.runner.run(plan.scheduled)
        self.num_steps += 1
        for seq, n in plan.scheduled:
            seq.num_computed_tokens += n
            self.block_manager.commit(seq)
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
        text = self.decode(seq.output_token_ids)
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
        )

    def _release(self, seq: Sequence) -> None:
        self.requests.pop(seq.request_id, None)
        self._texts.pop(seq.request_id, None)
        self.runner.generators.pop(seq.seq_id, None)

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
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]


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
