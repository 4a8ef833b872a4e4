"""Structured output: a request's constraint (any JSON object, a JSON schema, a regex, a choice, an EBNF
grammar) compiled by xgrammar into a grammar over the model's vocabulary, and each constrained sequence's
matcher, which masks its logits row to the tokens the grammar allows next and accepts the token sampled.

xgrammar is what vLLM and SGLang constrain with: a compiled grammar precomputes which tokens most parser
states allow, so most rows' masks take microseconds; a row inside a string of bounded length (a schema's
maxLength) is checked token by token, milliseconds. So a step's masks are filled on a worker thread while the
forward pass runs (xgrammar releases the GIL), and the sampler waits for them only past the forward.

`Grammars` compiles, once per engine, on any thread (the input processor calls it when a request is added,
so a constraint that does not compile is the request's InvalidParameterError and nothing enters the batch);
compiled grammars are kept in a byte-bounded LRU by (kind, text). `Matchers` holds the matchers of the
running constrained sequences: `fill` before the forward, `mask` before sampling, `accept` after, `release`
when the sequence ends. A matcher lives as long as its sequence: a sequence preempted and recomputed keeps
the matcher that accepted its output so far, and only tokens sampled later are accepted. A constrained row's
logprobs are those of the masked row (over the tokens its grammar allows).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

try:
    import xgrammar as xgr
except ImportError:  # the GPU check's machine has neither xgrammar nor pydantic (which it imports): the engine
    # runs there without structured output, and a constrained request is refused with the reason
    xgr = None  # type: ignore[assignment]

from loraplane_server.errors import InvalidParameterError, RequestFailedError
from loraplane_server.sampling_params import StructuredOutput
from loraplane_server.sequence import Sequence

# consecutive whitespace characters a JSON output may hold at one place (between two tokens of JSON syntax):
# a newline and an indentation two levels deep (vLLM's default, any whitespace, leaves it unbounded), a bound on a
# small model that fills every such place with newlines: SmolLM2-135M on 24 generated schemas made 64 tokens on
# average (at most 184) with 16, 52 (115) with 4, and 36 (64) with none (compact JSON)
MAX_JSON_WHITESPACE = 8
COMPILE_THREADS = 8
APPLY_THREADS = 4  # threads applying a step's masks on the CPU, at most (`Matchers._apply`)
APPLY_ROWS_PER_THREAD = 4  # fewer rows are not worth a thread
GRAMMAR_CACHE_BYTES = 128 << 20  # compiled grammars kept (a JSON schema's: ~0.1-2 MB)
# JSON schema keywords whose constraint xgrammar 0.2 does not enforce (it ignores them): refused rather than
# served with outputs that may not validate against the schema the client sent
UNENFORCED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "multipleOf",
)
# where a schema holds subschemas: one or a list of them, or a map of names to them
_SUBSCHEMA = (
    *("items", "prefixItems", "additionalItems", "additionalProperties", "propertyNames", "unevaluatedItems"),
    *("unevaluatedProperties", "contains", "not", "if", "then", "else", "allOf", "anyOf", "oneOf"),
)
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# a string's length bounds served as a pattern up to this length (`fast_strings`)
MAX_PATTERN_LENGTH = 64
_JSON_CHAR = r'[^"\\\u0000-\u001f]'  # a character a JSON string holds unescaped
if TYPE_CHECKING:
    from xgrammar import CompiledGrammar  # what the input processor hands the engine for a constrained request
else:
    CompiledGrammar = Any
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class GrammarRejectedError(RequestFailedError):
    """The sampled token is not one the request's grammar allows (the mask makes this a bug, never a
    request's fault): the request fails alone."""


def grammar_key(structured: StructuredOutput) -> tuple[str, str]:
    """What a compiled grammar is cached by: the kind and the text it compiles."""
    if structured.kind == "choice":
        return structured.kind, json.dumps(list(structured.choices), ensure_ascii=False)
    return structured.kind, structured.spec


def choice_grammar(choices: Iterable[str]) -> str:
    """An EBNF grammar whose outputs are exactly the choices (JSON string literals are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def subschemas(schema: Any, path: str = "#") -> Iterator[tuple[str, dict]]:
    """Every schema object within a JSON schema (itself first), with its place ("#/properties/tags/items")."""
    if isinstance(schema, list):
        for i, sub in enumerate(schema):
            yield from subschemas(sub, f"{path}/{i}")
        return
    if not isinstance(schema, dict):
        return
    yield path, schema
    for key in _SUBSCHEMA:
        if key in schema:
            yield from subschemas(schema[key], f"{path}/{key}")
    for key in _SUBSCHEMA_MAPS:
        if isinstance(subs := schema.get(key), dict):
            for name, sub in subs.items():
                yield from subschemas(sub, f"{path}/{key}/{name}")


def unenforced_keyword(schema: Any) -> str | None:
    """The first keyword of UNENFORCED_KEYWORDS in a JSON schema, with its place ("uniqueItems at
    #/properties/tags"); a uniqueItems of true and an allOf of several schemas count too. None: none."""
    for path, sub in subschemas(schema):
        found = next((key for key in UNENFORCED_KEYWORDS if key in sub), None)
        if found is None and sub.get("uniqueItems") is True:
            found = "uniqueItems"
        if found is None and isinstance(sub.get("allOf"), list) and len(sub["allOf"]) > 1:
            found = f"allOf of {len(sub['allOf'])} schemas"
        if found is not None:
            return f"{found} at {path}"
    return None


def fast_strings(schema: Any) -> Any:
    """The schema with each string's length bounds (minLength, maxLength up to MAX_PATTERN_LENGTH, no pattern
    or format beside them) as a pattern of as many unescaped characters, changed in place: what xgrammar's own
    length grammar allows (no escapes either), less the raw tab it lets through, which JSON forbids. xgrammar 0.2
    compiles a length bound as a counted repetition whose masks it checks token by token, 1-20 ms a row on the
    built-in model's vocabulary (maxLength 4-16); the pattern's automaton is precomputed (~20 us a row, compiled
    as fast)."""
    for _, sub in subschemas(schema):
        if sub.get("type") != "string" or "pattern" in sub or "format" in sub:
            continue
        low, high = sub.get("minLength", 0), sub.get("maxLength")
        if ("minLength" in sub or "maxLength" in sub) and isinstance(low, int) and 0 <= low <= MAX_PATTERN_LENGTH:
            if high is not None and not (isinstance(high, int) and low <= high <= MAX_PATTERN_LENGTH):
                continue
            sub["pattern"] = f"^{_JSON_CHAR}{{{low},{'' if high is None else high}}}$"
            sub.pop("minLength", None)
            sub.pop("maxLength", None)
    return schema


def compile_reason(error: Exception) -> str:
    """xgrammar's error message without its log prefix (time, C++ file and line)."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return _LOG_PREFIX.sub("", lines[0]).strip()


class Grammars:
    """One GrammarCompiler over the model's tokenizer (built at the first constrained request) and the
    compiled grammars by (kind, text), least recently used dropped beyond `cache_bytes`. Thread-safe."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], cache_bytes: int = GRAMMAR_CACHE_BYTES
    ) -> None:
        """tokenizer: the model's (transformers); vocab_size: the width of the model's logits (the lm_head may
        be wider than the tokenizer: the ids past it are never allowed); stop_token_ids: the model's EOS ids,
        the stops a grammar allows once it is complete."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_bytes = cache_bytes
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def compiler(self) -> xgr.GrammarCompiler:
        if xgr is None:
            raise InvalidParameterError(
                "structured output needs the xgrammar package, which this installation does not have",
                param="structured",
            )
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                )
                # its own cache off: ours is bounded (xgrammar's is not by default) and keyed by the request's text;
                # threads: a grammar's token masks are precomputed in parallel (a compile holds up its caller)
                threads = min(COMPILE_THREADS, os.cpu_count() or 1)
                self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
            return self._compiler

    def compile(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of a constraint, from the cache when it was compiled before; a constraint that
        does not compile (invalid, or a schema feature xgrammar does not enforce) raises InvalidParameterError
        naming the problem."""
        key = grammar_key(structured)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return grammar
            self.misses += 1
        grammar = self._compile(structured)  # outside the lock: a large schema takes a while
        with self._lock:
            if key not in self._cache:
                self._cache[key] = grammar
                self._cached_bytes += grammar.memory_size_bytes
            while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
                _, dropped = self._cache.popitem(last=False)
                self._cached_bytes -= dropped.memory_size_bytes
        return grammar

    def _compile(self, structured: StructuredOutput) -> xgr.CompiledGrammar:
        kind, spec = structured.kind, structured.spec
        if kind == "json_schema":
            spec = check_schema(spec)
        compiler = self.compiler()
        try:
            if kind == "json_object":
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE
                )
            if kind == "json_schema":
                return compiler.compile_json_schema(spec, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(structured.choices))
            return compiler.compile_grammar(spec)
        except (RuntimeError, ValueError) as exc:
            raise InvalidParameterError(
                f"structured output {kind} does not compile: {compile_reason(exc)}", param="structured"
            ) from exc

    @property
    def num_cached(self) -> int:
        return len(self._cache)


def check_schema(spec: str) -> str:
    """A JSON schema's text checked (JSON, an object or a boolean, no keyword xgrammar leaves unenforced); the
    text to compile (`fast_strings`)."""
    try:
        schema = json.loads(spec)
        if not isinstance(schema, dict | bool):
            raise InvalidParameterError(
                f"structured output json_schema must be a JSON object, not {type(schema).__name__}",
                param="structured",
            )
        found = unenforced_keyword(schema)
        if found:
            raise InvalidParameterError(
                f"structured output json_schema uses a feature that is not supported: {found}", param="structured"
            )
        return json.dumps(fast_strings(schema))
    except json.JSONDecodeError as exc:
        raise InvalidParameterError(
            f"structured output json_schema is not valid JSON: {exc}", param="structured"
        ) from exc
    except RecursionError as exc:
        raise InvalidParameterError("structured output json_schema is nested too deeply", param="structured") from exc


@dataclass
class Fill:
    """One step's masks, filled on a worker thread while the forward runs: bitmask row `rows[seq_id]` is that
    sequence's (its logits row when the fill began)."""

    rows: dict[int, int]
    done: Future[None]


class Matchers:
    """The running constrained sequences' matchers (by seq_id), one reused bitmask and the worker threads that
    fill it (one job a step) and help apply it; the engine thread calls. Counters of the masks' cost (a bench reads
    them): fill_seconds (the worker's), wait_seconds (what the step waited for it past the forward),
    apply_seconds."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._matchers: dict[int, xgr.GrammarMatcher] = {}
        self._bitmask = torch.empty(0, 0, dtype=torch.int32)  # [rows, ceil(V / 32)] int32, grown on demand
        self._worker: ThreadPoolExecutor | None = None  # started at the first constrained step
        self.threads = min(APPLY_THREADS, os.cpu_count() or 1)  # this one and the workers, applying masks
        self._batch: xgr.BatchGrammarMatcher | None = None  # fills rows on C++ threads (half the cores)
        self.fill_seconds = 0.0
        self.wait_seconds = 0.0
        self.apply_seconds = 0.0
        self.fill_rows = 0
        self.fill_steps = 0

    def __len__(self) -> int:
        return len(self._matchers)

    def start(self, seq: Sequence, grammar: xgr.CompiledGrammar) -> None:
        """A new constrained sequence's matcher, at the grammar's start."""
        self._matchers[seq.seq_id] = xgr.GrammarMatcher(grammar)

    def release(self, seq: Sequence) -> None:
        """The sequence finished or was aborted: its matcher goes."""
        self._matchers.pop(seq.seq_id, None)

    def fill(self, rows: Iterable[tuple[int, Sequence]]) -> Fill | None:
        """Start filling the masks of the constrained sequences among a step's samplers on a worker thread, which
        the forward pass overlaps (xgrammar releases the GIL); rows: (logits row, its sequence), each mask filled
        into the bitmask's row of that index. None when no sampler is constrained. Each matcher is in the state its
        last accepted token left."""
        pairs = [(row, s) for row, s in rows if s.seq_id in self._matchers]
        if not pairs:
            return None
        height = max(row for row, _ in pairs) + 1
        if self._bitmask.shape[0] < height:
            self._bitmask = xgr.allocate_token_bitmask(max(height, 2 * self._bitmask.shape[0]), self.vocab_size)
        if self._worker is None or self._batch is None:
            self._worker = ThreadPoolExecutor(max(1, self.threads - 1), thread_name_prefix="grammar-masks")
            self._batch = xgr.BatchGrammarMatcher("auto")
        matchers = [self._matchers[s.seq_id] for _, s in pairs]
        indices = [row for row, _ in pairs]
        done = self._worker.submit(self._fill_rows, self._batch, matchers, self._bitmask, indices)
        return Fill({s.seq_id: row for row, s in pairs}, done)

    def _fill_rows(
        self, batch: xgr.BatchGrammarMatcher, matchers: list[xgr.GrammarMatcher], bitmask: Tensor, indices: list[int]
    ) -> None:
        start = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, bitmask, indices)
        self.fill_seconds += time.perf_counter() - start
        self.fill_rows += len(matchers)
        self.fill_steps += 1

    def mask(self, logits: Tensor, rows: Iterable[tuple[int, Sequence]], fill: Fill | None) -> None:
        """Set to -inf, in place, the logits the grammar forbids in each constrained sequence's row, once the
        step's fill is done; rows: (logits row, its sequence). Unconstrained rows are not touched."""
        if fill is None:
            return
        start = time.perf_counter()
        fill.done.result()
        waited = time.perf_counter()
        pairs = [(row, fill.rows[s.seq_id]) for row, s in rows if s.seq_id in fill.rows]
        bitmask = self._bitmask[: len(logits)]
        if any(row != filled for row, filled in pairs):  # rows set aside since the fill (non-finite logits)
            bitmask = torch.full_like(bitmask, -1)
            bitmask[[row for row, _ in pairs]] = self._bitmask[[filled for _, filled in pairs]]
        if pairs:
            self._apply(logits, bitmask.to(logits.device), [row for row, _ in pairs])
        self.wait_seconds += waited - start
        self.apply_seconds += time.perf_counter() - waited

    def _apply(self, logits: Tensor, bitmask: Tensor, rows: list[int]) -> None:
        """xgrammar's kernel over the rows; on the CPU, where it runs on one thread (~0.15 ms a row of 49,152
        logits), the rows split between this thread and the workers (the forward is done: the cores are free)."""
        apply = xgr.apply_token_bitmask_inplace
        parts = min(self.threads, -(-len(rows) // APPLY_ROWS_PER_THREAD))
        if logits.device.type != "cpu" or parts < 2 or self._worker is None:
            apply(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
            return
        chunks = [rows[i::parts] for i in range(parts)]  # disjoint rows: written apart
        futures = [
            self._worker.submit(apply, logits, bitmask, vocab_size=self.vocab_size, indices=c) for c in chunks[1:]
        ]
        apply(logits, bitmask, vocab_size=self.vocab_size, indices=chunks[0])
        for future in futures:
            future.result()

    def accept(self, seq: Sequence, token: int) -> bool:
        """The token sampled for a sequence, through its matcher; whether its grammar is complete now (it
        accepted its stop token). False for an unconstrained sequence."""
        matcher = self._matchers.get(seq.seq_id)
        if matcher is None:
            return False
        if not matcher.accept_token(token):
            raise GrammarRejectedError(f"token {token} is not one the request's structured output allows")
        return matcher.is_terminated()
