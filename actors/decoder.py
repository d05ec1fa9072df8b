"""The decoder engine: causal language models in ONNX with a KV cache.

Models follow the Hugging Face Optimum decoder layout: inputs ``input_ids``,
``attention_mask``, ``position_ids`` (when present) and ``past_key_values.{i}.key`` /
``.value``; outputs ``logits`` and ``present.{i}.key`` / ``.value``. Layers, heads,
head size and dtypes are read from the model, so a user's own export works unchanged.

A generation is prefilled (in chunks of ``prefill_chunk`` tokens when set), then
decoded one token per engine step. Between two steps it can stop: it is then *paused*
with its KV cache, and a later ``advance`` continues exactly where it stopped. A stop
that arrives during a prefill call aborts that call (ONNX Runtime's terminate flag);
the prefill runs again on resume, so urgent work never waits for a long prompt. A cache
trimmed to a prefix (or dropped) is rebuilt by prefilling the tokens it no longer
covers, so the output does not change.

A dynamically quantized model (``DynamicQuantizeLinear``: each call's activations share
one scale computed from the call's data) is the exception: its logits depend on how
tokens are grouped into calls, so a prefill of many tokens does not give the KV that one
call per token gave. ``DecoderEngine.exact_grouping`` marks such models; their caches
are rebuilt by replaying the generation's own calls (``Generation.aligned``), and a
cache built by another request's calls (a session or shared prefix) is not reused.

Generations of one model can also decode together (``advance_batch``): one call per
token feeds every row its last token, caches padded to a shared length, so the weights
are read once for all of them. A graph with ``position_ids`` takes the caches padded on
the left, each row with its own positions. A graph without them that attends with ONNX
Runtime's ``GroupQueryAttention`` (ONNX Runtime GenAI's builds: Phi-3, Llama, Qwen)
takes them padded on the right, as that op requires (see ``_Batch``). Logits match
decoding alone to float rounding (the padding changes the order of a few sums), so
tokens are those made alone unless two candidates tie that closely. A generation leaves
the group, with its own cache, at the token where it ends.

A decode step of a ``GroupQueryAttention`` graph alone writes the new token's keys and
values in place: past and present are bound (ONNX Runtime's IO binding) to one
preallocated buffer, as ONNX Runtime GenAI does with ``past_present_share_buffer``, so
no step copies the whole cache (see ``_decode_in_place``). A buffer has room for the
generation's token budget where that is small, and grows geometrically otherwise; the
engine hands caches back to the node in arrays of their own size.
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnxruntime as ort

from actors.engine import InputInfo, RunAborted, Signature, open_planned, session_signature
from edgefleet.errors import EngineError, InvalidInput
from edgefleet.providers import CPU, SessionPlan
from edgefleet.request import GenerateRequest

log = logging.getLogger(__name__)

PAST = "past_key_values."
PRESENT = "present."
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length")
WARMUP_PROMPT = 16
WARMUP_TOKENS = 32
# Op types that quantize activations with a scale taken from each call's data: ONNX's
# DynamicQuantizeLinear (what quantize_dynamic and Optimum's quantizer put before each
# MatMulInteger) and ONNX Runtime's DynamicQuantizeMatMul / DynamicQuantizeLSTM.
DYNAMIC_QUANTIZE = b"DynamicQuantize"
# ONNX Runtime's int4/int8 weight-only MatMul: with accuracy_level >= 2 it quantizes or
# converts the activations per call (level 4: int8 with a scale from each call's data).
MATMUL_NBITS = b"MatMulNBits"
NBITS_GROUPING_LEVEL = 2
# ONNX Runtime's attention op of GenAI builds: it finds each row's past from column 0.
GROUP_QUERY_ATTENTION = b"GroupQueryAttention"
# GroupQueryAttention's inputs seqlens_k and total_sequence_length, and the ops a graph
# may derive them from its attention mask with (see mask_only_counts).
GQA_COUNT_INPUTS = (5, 6)
COUNT_OPS = frozenset(
    {"Shape", "Gather", "Cast", "Squeeze", "Unsqueeze", "ReduceSum", "Sub", "Add", "Reshape"}
    | {"Identity", "Size"}
)
MASK_CHECK_MAX_BYTES = 256 << 20
# A decode buffer's columns: at least twice those needed when it is made (or this many
# more), so a generation's decode steps copy its cache O(log n) times, not once a
# token; and room for all the tokens the generation may still make (its budget) where
# that takes at most BUFFER_ROOM_BYTES, so a small model (where a copy costs as much as
# a few steps) makes one buffer per generation.
BUFFER_SLACK = 64
BUFFER_ROOM_BYTES = 64 << 20


@dataclass(eq=False)
class _KVBuffer:
    """Preallocated KV arrays (``[1, heads, capacity, head_dim]``, one per past input)
    that one engine's decode steps write in place (see ``DecoderEngine._decode_in_place``),
    with the IO binding that runs them: past and present inputs and outputs bound to the
    same arrays. Columns ``0 .. filled - 1`` hold keys and values. Only a cache that
    covers exactly those columns appends (writes column ``filled``), so every
    ``KVCache`` viewing the first ``n <= filled`` columns stays as it was: immutable."""

    arrays: tuple[np.ndarray, ...]
    filled: int
    binding: ort.IOBinding  # held with the buffer; bind and run below call into it
    session: ort.InferenceSession  # the binding's: a reloaded model makes its own buffers
    # Bind host memory to an input (name, element type, shape, address), and run the
    # binding: see _native_calls.
    bind: Callable[[str, Any, list[int], int], None]
    run: Callable[[], None]
    # The attention mask bound once at the buffer's full width, ones over the columns
    # filled (see DecoderEngine._wide_mask); None: bound at the row's width each step.
    mask: np.ndarray | None = None

    @property
    def capacity(self) -> int:
        return int(self.arrays[0].shape[2])


@dataclass(frozen=True)
class KVCache:
    """Keys and values of the first ``length`` tokens of a sequence, one array per
    past input of the model (``[1, heads, length, head_dim]``). Immutable: the engine
    makes a new cache each step, and a trim copies. A decode step in place makes one
    whose arrays view a decode buffer (``buffer``), whose later columns only the next
    steps write: the columns it views never change."""

    arrays: tuple[np.ndarray, ...]
    length: int
    # Set when ``arrays`` view the first ``length`` columns of a decode buffer.
    buffer: _KVBuffer | None = field(default=None, compare=False, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def compact(self) -> KVCache:
        """This cache in arrays of its own size (a copy) when it views a decode buffer,
        else itself: what a node keeps holds no spare columns, so its KV budget counts
        what is really held."""
        if self.buffer is None:
            return self
        return KVCache(tuple(np.ascontiguousarray(a) for a in self.arrays), self.length)

    def prefix(self, n: int) -> KVCache | None:
        """A copy that covers the first ``n`` tokens only (None for n == 0)."""
        if n <= 0:
            return None
        if n >= self.length:
            return self
        return KVCache(tuple(np.ascontiguousarray(a[:, :, :n]) for a in self.arrays), n)

    def bytes_for(self, n: int) -> int:
        return self.nbytes * min(n, self.length) // max(1, self.length)


@dataclass(eq=False)
class Generation:
    """One generation's state on a node: its tokens, its cache, where it stands."""

    request: GenerateRequest
    limit: int  # new tokens allowed now (the token budget governor moves it)
    emit: Callable[[int], None]  # called on the engine thread with each new token
    max_context: int | None = None
    cache: KVCache | None = None  # covers tokens[:cache.length]
    tokens: list[int] = field(default_factory=list)
    reused: int = 0  # prompt tokens whose KV came from a cached prefix or session
    fed: int = 0  # tokens run through the model (prefill, re-prefill and steps)
    engine_s: float = 0.0  # wall time in the engine
    engine_cpu_s: float = 0.0  # CPU time of the engine thread (no time lost to others)
    rng: np.random.Generator | None = None
    finish_reason: str | None = None
    # Set by the engine of an exact_grouping model: the prefill chunk its calls use
    # (0: the prompt in one call). None: any grouping of tokens into calls will do.
    exact_chunk: int | None = None

    def __post_init__(self) -> None:
        if not self.tokens:
            self.tokens = list(self.request.prompt_ids)
        self._stop_ids = frozenset(self.request.stop_ids)
        # Read each step: the request's numbers, once (it is immutable).
        self._prompt_len = len(self.request.prompt_ids)
        self._most = self.request.max_new_tokens - self.request.continued
        if self.rng is None and self.request.temperature > 0:
            self.rng = np.random.default_rng(self.request.seed)
            self.rng.random(self.request.continued)  # one draw per token already sampled

    @property
    def prompt_len(self) -> int:
        return self._prompt_len

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def original_prompt_len(self) -> int:
        """Prompt tokens of the first attempt (a continuation's prompt also holds the
        tokens an earlier attempt generated)."""
        return self.prompt_len - self.request.continued

    def aligned(self, n: int) -> int:
        """The longest cache length <= ``n`` this generation's cache can be trimmed to
        and still be rebuilt with the same output: ``n`` itself, unless its model is
        exact_grouping. Then only the ends of the calls an uninterrupted run makes
        qualify: the original prompt in chunks of ``exact_chunk`` tokens (one call for
        0), then every token. Callers that trim (``KVCache.prefix``) MUST pass a length
        this returns, or the engine drops the rest back to the boundary on resume."""
        if self.exact_chunk is None or n >= self.original_prompt_len:
            return n
        return n - n % self.exact_chunk if self.exact_chunk > 0 else 0

    def room(self) -> int:
        """New tokens this generation may still make (its length and budget allowing)."""
        return min(self._most, self.limit) - (len(self.tokens) - self._prompt_len)

    def end_reason(self) -> str | None:
        """Why the generation ends before another step, or None to go on."""
        n = len(self.tokens) - self._prompt_len
        if n and self.tokens[-1] in self._stop_ids:
            return "stop"
        if n >= self._most:
            return "length"
        if n >= self.limit:
            return "budget"
        if self.max_context is not None and len(self.tokens) >= self.max_context:
            return "length"
        return None


def check_generation(
    request: GenerateRequest,
    *,
    vocab: int | None,
    max_context: int | None,
    max_new_tokens: int,
) -> None:
    """Raise InvalidInput, naming the problem, for a request the model cannot run."""
    ids = request.prompt_ids
    name = request.model
    if not isinstance(ids, tuple | list) or not ids:
        raise InvalidInput("prompt_ids must be a non-empty list of int token ids")
    if any(not isinstance(t, int | np.integer) or isinstance(t, bool) for t in ids):
        raise InvalidInput("prompt_ids must be a list of int token ids")
    bad = [int(t) for t in ids if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        allowed = f"0..{vocab - 1}" if vocab is not None else ">= 0"
        raise InvalidInput(
            f"prompt_ids hold token ids outside the vocabulary ({allowed}): {bad[:5]}"
        )
    if max_context is not None and len(ids) >= max_context:
        raise InvalidInput(
            f"prompt of {len(ids)} tokens does not fit the context of model {name!r} "
            f"({max_context} tokens, with room for one new token)"
        )
    if not 1 <= request.max_new_tokens <= max_new_tokens:
        raise InvalidInput(
            f"max_new_tokens must be between 1 and {max_new_tokens}, got {request.max_new_tokens}"
        )
    if not 0 <= request.continued < len(ids):
        raise InvalidInput(f"continued {request.continued} must be below the prompt length")
    if not 0 <= request.prefix_len <= len(ids):
        raise InvalidInput(
            f"prefix_len {request.prefix_len} must be between 0 and the prompt length ({len(ids)})"
        )
    if not request.temperature >= 0 or request.top_k < 0:
        got = f"{request.temperature} and {request.top_k}"
        raise InvalidInput(f"temperature must be >= 0 and top_k >= 0, got {got}")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def sample(
    logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator | None
) -> int:
    """Greedy for temperature 0, else softmax sampling over the ``top_k`` best (0: all)."""
    if temperature <= 0 or rng is None:
        return int(logits.argmax())
    z = logits.astype(np.float64) / temperature
    ids = None
    if 0 < top_k < z.shape[0]:
        ids = np.argpartition(z, -top_k)[-top_k:]
        z = z[ids]
    cdf = np.cumsum(np.exp(z - z.max()))
    # Exactly one draw per token, so a continuation can skip the draws made before it.
    pick = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), len(cdf) - 1)
    return int(ids[pick]) if ids is not None else pick


class DecoderEngine:
    """An ONNX Runtime session of a causal LM, driven one token at a time."""

    generative = True

    def __init__(
        self,
        name: str,
        path: Path,
        *,
        threads: int = 1,
        max_context: int | None = None,
        stop_ids: Sequence[int] = (),
        prefill_chunk: int = 0,
        plan: SessionPlan | None = None,
    ) -> None:
        plan = plan or SessionPlan(path, (CPU,))
        path = plan.path
        # No arena: a decode step's tensors are small and many, and the system
        # allocator serves them faster than ONNX Runtime's arena (decode steps side by
        # side: 4-7 % more tokens per CPU-second on tiny GenAI builds, 5-8 % on a 40M
        # int4 one, within the noise on a 40M fp32 one), holding no peak-sized blocks
        # between calls either.
        self._session, self.providers = open_planned(name, plan, threads, arena=False)
        # Logits depend on how tokens are grouped into calls: caches are rebuilt by
        # replaying the original calls, never reused from other requests or batched.
        self.exact_grouping = dynamically_quantized(path)
        self.name = name
        self.path = path
        self.stop_ids = tuple(stop_ids)  # default: the model's own (see below)
        self.prefill_chunk = prefill_chunk
        self._lock = threading.Lock()
        self._prefilling: ort.RunOptions | None = None  # the prefill call in progress
        self._sig = session_signature(self._session)
        inputs = {s.name: s for s in self._sig.inputs}
        outputs = {s.name for s in self._sig.outputs}
        for required in ("input_ids", "attention_mask"):
            if required not in inputs:
                raise EngineError(
                    f"model {name!r} is not an Optimum-style decoder: no input {required!r} "
                    f"(it takes {self._sig.describe()})"
                )
        if "logits" not in outputs:
            raise EngineError(f"model {name!r} is not a decoder: no output 'logits'")
        self._past = [n for n in inputs if n.startswith(PAST)]
        if not self._past:
            raise EngineError(
                f"model {name!r} has no past_key_values.* inputs: export it with its KV "
                "cache (Optimum: --task text-generation-with-past)"
            )
        self._present = [PRESENT + n.removeprefix(PAST) for n in self._past]
        missing = [n for n in self._present if n not in outputs]
        if missing:
            raise EngineError(f"model {name!r}: outputs {missing} missing for its past inputs")
        self.layers = len(self._past) // 2
        meta = _metadata(self._session, path)
        self.max_context = max_context or _context_from(meta)
        self.stop_ids = self.stop_ids or _eos_ids(path, meta)
        first = inputs[self._past[0]]
        self._empty = tuple(
            np.zeros(self._kv_shape(inputs[n].shape, meta, n), dtype=inputs[n].dtype)
            for n in self._past
        )
        self._ids_dtype = inputs["input_ids"].dtype
        self._mask_dtype = inputs["attention_mask"].dtype
        self._has_positions = "position_ids" in inputs
        # How advance_batch pads caches to a shared length: "right" where the graph
        # attends with GroupQueryAttention (it reads a row's past from column 0 whatever
        # the mask says), "left" where each row's position_ids say where it stands,
        # None when a padded row cannot be told its positions (see batchable_decode).
        self.batch_layout: Literal["left", "right"] | None = (
            "right" if group_query_attention(path) else "left" if self._has_positions else None
        )
        self._cache_branch = "use_cache_branch" in inputs
        self._outputs = ["logits", *self._present]
        self.kv_dtype = first.dtype
        self.vocab: int | None = None
        dim = next(s for s in self._sig.outputs if s.name == "logits").shape[-1]
        if isinstance(dim, int):
            self.vocab = dim
        self._ones = np.ones((1, 0), dtype=self._mask_dtype)
        self._positions = np.arange(0, dtype=np.int64)[None]
        self._grow(self.max_context or 1024)
        # Decode steps of a GroupQueryAttention graph write the cache in place (see
        # _decode_in_place): the token and the logits go through these arrays. Only on
        # the CPU provider alone: the buffers are host memory, which another provider
        # would copy to its device and back, so past and present would not be shared.
        self._share_buffer = (
            self.batch_layout == "right"
            and not self._cache_branch
            and self._session.get_providers() == [CPU.ort_name]
        )
        # Whether a decode buffer's mask can be bound once, at the buffer's width.
        self._wide_mask = self._share_buffer and mask_only_counts(path)
        self._ids = np.zeros((1, 1), dtype=self._ids_dtype)
        self._logits_dtype = next(s for s in self._sig.outputs if s.name == "logits").dtype
        self._logits: np.ndarray | None = None  # [1, 1, vocab], once the vocabulary is known
        self._logits_row: np.ndarray | None = None  # its [vocab] view

    # --------------------------------------------------------------- Engine protocol

    @property
    def signature(self) -> Signature:
        return self._sig

    def check(self, inputs: Mapping[str, Any], max_bytes: int) -> InputInfo:
        raise InvalidInput(f"model {self.name!r} is a decoder: use generate(), not infer()")

    def run(
        self, batch: Sequence[Mapping[str, np.ndarray]], stop: threading.Event | None = None
    ) -> list[dict[str, np.ndarray]]:
        raise InvalidInput(f"model {self.name!r} is a decoder: use generate(), not infer()")

    def abort(self) -> None:
        """Abort a prefill in progress (a decode step is short and always completes;
        generations stop at the next token boundary through the call's stop event)."""
        with self._lock:
            if self._prefilling is not None:
                self._prefilling.terminate = True

    def close(self) -> None:
        del self._session

    # -------------------------------------------------------------------- generation

    def advance(self, gen: Generation, stop: threading.Event | None = None) -> str | None:
        """Decode until the generation ends (return its finish reason) or ``stop`` is
        set (return None: paused at a token boundary, cache kept)."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            while True:
                reason = gen.end_reason()
                if reason is not None:
                    return reason
                if stop is not None and stop.is_set():
                    return None
                if not (self._in_place(gen) and self._decode_in_place(gen, stop)):
                    self.step(gen, stop)
        except RunAborted:
            return None  # a prefill aborted for a pause: its cache is as it was
        finally:
            if gen.cache is not None:
                gen.cache = gen.cache.compact()
            gen.engine_s += time.perf_counter() - t0
            gen.engine_cpu_s += time.thread_time() - cpu0

    def step(self, gen: Generation, stop: threading.Event | None = None) -> int | None:
        """Feed the tokens the cache does not cover yet and produce the next token; a
        prompt longer than ``prefill_chunk`` is fed one chunk per step (None: no token
        yet). On an exact_grouping model each step is one call of the uninterrupted run
        (see ``_exact_call``), so a cache is rebuilt over several steps. Raises
        RunAborted when ``stop`` aborted a prefill."""
        if self._in_place(gen) and self._decode_in_place(gen, stop, most=1):
            return gen.tokens[-1]
        if self.exact_grouping:
            start, end = self._exact_call(gen)
        else:
            start = gen.cache.length if gen.cache is not None else 0
            end = len(gen.tokens)
            if 0 < self.prefill_chunk < end - start:
                end = start + self.prefill_chunk
        logits, gen.cache = self._extend(gen.tokens[start:end], start, gen.cache, stop)
        gen.fed += end - start
        if end < len(gen.tokens):
            return None  # a prefill chunk, or a call replayed to rebuild a cache
        token = sample(logits, gen.request.temperature, gen.request.top_k, gen.rng)
        gen.tokens.append(token)
        gen.emit(token)
        return token

    def _exact_call(self, gen: Generation) -> tuple[int, int]:
        """Tokens ``[start, end)`` of ``gen``'s next call on an exact_grouping model: the
        call its uninterrupted run makes where the cache ends. A cache trimmed between
        two such calls is first cut back to the earlier one's end; a cache another
        request's calls built (a reused session or prefix) is dropped."""
        gen.exact_chunk = self.prefill_chunk
        if gen.reused:
            gen.cache, gen.reused = None, 0
        start = gen.aligned(gen.cache.length if gen.cache is not None else 0)
        if gen.cache is not None:
            gen.cache = gen.cache.prefix(start)
        prompt = gen.original_prompt_len
        if start >= prompt:
            return start, start + 1  # decoding (or replaying) one token per call
        if self.prefill_chunk > 0:
            return start, min(start + self.prefill_chunk, prompt)
        return start, prompt

    def _extend(
        self,
        ids: Sequence[int],
        start: int,
        cache: KVCache | None,
        stop: threading.Event | None = None,
    ) -> tuple[np.ndarray, KVCache]:
        """``forward``, returning the cache that covers ``ids`` too."""
        logits, arrays = self.forward(ids, start, cache, stop)
        return logits, KVCache(arrays, start + len(ids))

    def _in_place(self, gen: Generation) -> bool:
        """Whether ``gen``'s next steps are decode steps ``_decode_in_place`` runs: one
        token to feed after its cache, on a graph that takes shared buffers (on an
        exact_grouping model, past its original prompt and on a cache of its own calls)."""
        cache = gen.cache
        return (
            self._share_buffer
            and self.vocab is not None
            and cache is not None
            and cache.length == len(gen.tokens) - 1
            and not (self.exact_grouping and (gen.reused or cache.length < gen.original_prompt_len))
        )

    def _decode_in_place(
        self, gen: Generation, stop: threading.Event | None = None, most: int = 0
    ) -> int:
        """Decode steps (``_in_place`` says when) that write each new token's keys and
        values into the cache's decode buffer in place, through ONNX Runtime's IO
        binding, until the generation ends, ``stop`` is set, ``most`` tokens are made
        (0: no limit) or the buffer is full. Returns the tokens made: 0 when the graph
        refused shared buffers (the engine then copies the cache each step).

        GroupQueryAttention takes past and present bound to one buffer wider than the
        mask (ONNX Runtime GenAI's ``past_present_share_buffer``): it then reads the
        row's past from its first ``seqlens_k`` columns, as it does from a past of their
        width, and writes the new token's column instead of copying the past to a new
        present. Logits are those of ``forward`` (the same kernels, the same columns
        attended to). A cache without a buffer it may append to is first copied into a
        new one. Between steps only the mask changes (bound again at the row's width, or
        one more column set in a wide mask), and the cache handed back is made once,
        when the steps stop."""
        cache = gen.cache
        assert cache is not None  # see _in_place
        n = cache.length
        buffer = cache.buffer
        if (
            buffer is None
            or buffer.session is not self._session
            or buffer.filled != n
            or n >= buffer.capacity
        ):
            try:
                buffer = self._buffer_for(cache, gen.room())
            except Exception as exc:  # ONNX Runtime's own error types
                self._refused(exc)
                return 0
        if buffer.capacity > self._ones.shape[1]:
            self._grow(buffer.capacity)
        if self.exact_grouping:
            gen.exact_chunk = self.prefill_chunk
        assert self._logits_row is not None  # made with the first buffer
        bind, run, wide = buffer.bind, buffer.run, buffer.mask
        ids, logits, tokens = self._ids.reshape(-1), self._logits_row, gen.tokens
        mask_type, ones_at, positions_at = self._mask_dtype.type, self._ones_at, self._positions_at
        greedy = gen.request.temperature <= 0 or gen.rng is None
        made = 0
        try:
            while n < buffer.capacity:
                ids[0] = tokens[-1]
                if wide is not None:
                    wide[0, n] = 1
                else:
                    bind("attention_mask", mask_type, [1, n + 1], ones_at)
                if self._has_positions:
                    bind("position_ids", np.int64, [1, 1], positions_at + 8 * n)
                try:
                    run()
                except Exception as exc:  # ONNX Runtime's own error types
                    self._refused(exc)
                    break
                n += 1
                buffer.filled = n
                if greedy:
                    token = int(logits.argmax())
                else:
                    token = sample(logits, gen.request.temperature, gen.request.top_k, gen.rng)
                tokens.append(token)
                gen.fed += 1
                made += 1
                gen.emit(token)
                if made == most or gen.end_reason() is not None or _is_set(stop):
                    break
        finally:
            if made:
                gen.cache = KVCache(tuple(a[:, :, :n] for a in buffer.arrays), n, buffer)
        return made

    def _refused(self, exc: Exception) -> None:
        """The graph runs, but not on shared buffers: decode with a copy per token."""
        self._share_buffer = False
        log.warning(
            "model %r: decoding in a shared KV buffer failed (%s); copying the cache "
            "each step instead",
            self.name,
            exc,
        )

    def _buffer_for(self, cache: KVCache, room: int = 0) -> _KVBuffer:
        """A new decode buffer holding ``cache`` in its first columns, with room to grow
        (for ``room`` more tokens where that is small: see BUFFER_SLACK), up to the
        model's context, and its IO binding."""
        need = cache.length + 1
        column = sum(a.shape[1] * a.shape[3] * a.itemsize for a in cache.arrays)
        affordable = BUFFER_ROOM_BYTES // max(1, column)
        capacity = max(min(cache.length + room, affordable), 2 * need, need + BUFFER_SLACK)
        if self.max_context is not None:
            capacity = max(need, min(capacity, self.max_context))
        arrays = []
        for a in cache.arrays:
            # Zeros, not garbage: the columns past the row are never attended to, but
            # keep NaNs out of any kernel that touches them.
            out = np.zeros((1, a.shape[1], capacity, a.shape[3]), a.dtype)
            out[:, :, : cache.length] = a
            arrays.append(out)
        if self._logits is None:  # once: every binding writes here (the vocabulary is fixed)
            self._logits = np.zeros((1, 1, int(self.vocab or 0)), self._logits_dtype)
            self._logits_row = self._logits[0, 0]
        binding = self._session.io_binding()
        for past, present, array in zip(self._past, self._present, arrays, strict=True):
            value = ort.OrtValue.ortvalue_from_numpy(array)
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        binding.bind_input(
            "input_ids", "cpu", 0, self._ids_dtype.type, [1, 1], self._ids.ctypes.data
        )
        binding.bind_output(
            "logits",
            "cpu",
            0,
            self._logits_dtype.type,
            list(self._logits.shape),
            self._logits.ctypes.data,
        )
        bind, run = _native_calls(self._session, binding)
        mask = None
        if self._wide_mask:
            mask = np.zeros((1, capacity), self._mask_dtype)
            mask[0, : cache.length] = 1
            bind("attention_mask", self._mask_dtype.type, [1, capacity], mask.ctypes.data)
        return _KVBuffer(tuple(arrays), cache.length, binding, self._session, bind, run, mask)

    def forward(
        self,
        ids: Sequence[int],
        start: int,
        cache: KVCache | None,
        stop: threading.Event | None = None,
    ) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """Logits of the last of ``ids`` (at positions ``start``...) and the new cache.
        A call of several tokens (a prefill) can be aborted through ``stop``."""
        end = start + len(ids)
        if end > self._ones.shape[1]:
            self._grow(2 * end)
        feed: dict[str, Any] = {
            "input_ids": np.asarray([ids], dtype=self._ids_dtype),
            "attention_mask": self._ones[:, :end],
        }
        if self._has_positions:
            feed["position_ids"] = self._positions[:, start:end]
        if self._cache_branch:
            feed["use_cache_branch"] = np.array([cache is not None])
        feed.update(
            zip(self._past, cache.arrays if cache is not None else self._empty, strict=True)
        )
        if len(ids) == 1 or stop is None:
            options = None
        else:
            options = ort.RunOptions()
            with self._lock:
                if stop.is_set():
                    raise RunAborted(self.name)
                self._prefilling = options
        try:
            out = self._session.run(self._outputs, feed, options)
        except Exception as exc:
            if options is not None and options.terminate:
                raise RunAborted(self.name) from None
            raise EngineError(f"model {self.name!r} failed: {exc}") from None
        finally:
            if options is not None:
                with self._lock:
                    self._prefilling = None
        return out[0][0, -1], tuple(out[1:])

    # ---------------------------------------------------------------- batched decode

    @property
    def batchable_decode(self) -> bool:
        """Whether ``advance_batch`` decodes its generations in one model call per token.
        That takes a shared dynamic batch axis, a ``batch_layout`` (per-row
        ``position_ids``, or GroupQueryAttention, which takes each row's positions from
        its mask; left padding would shift the positions any other model derives
        itself), a plain with-past graph (no ``use_cache_branch``) and numbers that do
        not depend on the rest of the call (not ``exact_grouping``). Otherwise the
        generations take turns, a token each."""
        return (
            self._sig.batchable
            and self.batch_layout is not None
            and not self._cache_branch
            and not self.exact_grouping
        )

    def advance_batch(
        self, gens: Sequence[Generation], stop: threading.Event | None = None
    ) -> dict[str, str | None]:
        """Decode several generations together until each ends or ``stop`` is set.
        Returns each one's finish reason by request id: None means paused at a token
        boundary with its cache kept, so a later ``advance`` or ``advance_batch`` (in any
        grouping) continues it exactly. Request ids MUST be distinct.

        A generation whose cache does not cover all but its last token is first brought
        up alone through ``step`` (prefill in chunks, rebuild after a trim), as
        ``advance`` would. Then the generations with one token to feed decode in one
        model call per token, caches padded to a shared length (on the side
        ``batch_layout`` says); a generation leaves the group at the token where it
        ends. On return every generation holds its own unpadded cache. Greedy and
        seeded outputs are those of each generation decoded alone (logits agree to float
        rounding), and a shared call's engine time is split evenly among its rows.
        Without ``batchable_decode`` the generations take turns through ``step``, a
        token each."""
        ids = [gen.request.id for gen in gens]
        if len(set(ids)) < len(ids):
            raise ValueError(f"advance_batch needs generations of distinct request ids: {ids}")
        try:
            ready = [gen for gen in gens if self._bring_up(gen, stop)]
            if self.batchable_decode and len(ready) > 1 and not _is_set(stop):
                ready = self._decode_together(ready, stop)
            self._decode_in_turn(ready, stop)
        except RunAborted:
            pass  # a prefill aborted for a pause: its cache is as it was
        finally:
            for gen in gens:
                if gen.cache is not None:
                    gen.cache = gen.cache.compact()
        return {gen.request.id: gen.end_reason() for gen in gens}

    def forward_rows(
        self,
        ids: Sequence[int],
        positions: np.ndarray,
        mask: np.ndarray,
        past: Sequence[np.ndarray],
    ) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """One token for each of several rows in one call: logits ``[rows, vocab]`` and
        the new cache arrays (``past`` with one more column). Row ``r`` feeds ``ids[r]``
        at position ``positions[r, 0]`` and attends to the columns ``mask[r]`` marks.
        Not abortable: a decode call is short."""
        feed: dict[str, Any] = {
            "input_ids": np.asarray(ids, dtype=self._ids_dtype).reshape(-1, 1),
            "attention_mask": mask,
        }
        if self._has_positions:
            feed["position_ids"] = positions
        feed.update(zip(self._past, past, strict=True))
        try:
            out = self._session.run(self._outputs, feed)
        except Exception as exc:
            raise EngineError(f"model {self.name!r} failed: {exc}") from None
        return out[0][:, -1], tuple(out[1:])

    def _bring_up(self, gen: Generation, stop: threading.Event | None) -> bool:
        """Step ``gen`` alone until its cache covers all but its last token (True), or
        it ends or ``stop`` is set first (False)."""
        while gen.end_reason() is None and not _is_set(stop):
            if gen.cache is not None and gen.cache.length == len(gen.tokens) - 1:
                return True
            self._timed_step(gen, stop)
        return False

    def _decode_in_turn(self, gens: Sequence[Generation], stop: threading.Event | None) -> None:
        """A step each in turn until every generation ends or ``stop`` is set."""
        live = list(gens)
        while live and not _is_set(stop):
            for gen in live:
                if _is_set(stop):
                    return
                if gen.end_reason() is None:  # the budget can shrink meanwhile
                    self._timed_step(gen, stop)
            live = [gen for gen in live if gen.end_reason() is None]

    def _decode_together(
        self, gens: Sequence[Generation], stop: threading.Event | None
    ) -> list[Generation]:
        """Decode ``gens`` (each with one token to feed) in one call per token while two
        or more go on and ``stop`` is not set; return those still going, each with its
        own cache again."""
        mark = time.perf_counter(), time.thread_time()
        batch = _Batch(gens, right=self.batch_layout == "right")
        try:
            while len(batch.gens) > 1 and not _is_set(stop):
                rows = list(batch.gens)
                logits, arrays = self.forward_rows(
                    [gen.tokens[-1] for gen in rows],
                    batch.positions(),
                    batch.mask(self._mask_dtype),
                    batch.arrays,
                )
                batch.grown(arrays)
                for row, gen in enumerate(rows):
                    token = sample(logits[row], gen.request.temperature, gen.request.top_k, gen.rng)
                    gen.tokens.append(token)
                    gen.fed += 1
                    gen.emit(token)
                batch.release([r for r, gen in enumerate(rows) if gen.end_reason() is not None])
                mark = _charge(rows, mark)
        finally:
            left = batch.release(range(len(batch.gens)))
            _charge(left, mark)
        return left

    def _timed_step(self, gen: Generation, stop: threading.Event | None) -> None:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            self.step(gen, stop)
        finally:
            gen.engine_s += time.perf_counter() - t0
            gen.engine_cpu_s += time.thread_time() - cpu0

    def warmup(self) -> dict[int, float]:
        """Run one short generation; learn the vocabulary size; return the engine
        seconds of a warm-up-sized generation (the node's cost table entry)."""
        prompt = tuple(range(1, WARMUP_PROMPT + 1))
        if self.vocab is None:
            logits, _ = self.forward(prompt[:1], 0, None)
            self.vocab = int(logits.shape[-1])
        prompt = tuple(t % self.vocab for t in prompt)
        tokens = WARMUP_TOKENS
        if self.max_context is not None:
            tokens = max(1, min(tokens, self.max_context - WARMUP_PROMPT - 1))
        request = GenerateRequest(self.name, prompt, max_new_tokens=tokens)
        self.advance(Generation(request, limit=tokens, emit=_ignore, max_context=self.max_context))
        gen = Generation(request, limit=tokens, emit=_ignore, max_context=self.max_context)
        self.advance(gen)
        return {1: gen.engine_s}

    def _grow(self, n: int) -> None:
        self._ones = np.ones((1, n), dtype=self._mask_dtype)
        self._positions = np.arange(n, dtype=np.int64)[None]
        # Their addresses, for decode steps that bind them (read once: ctypes is slow).
        self._ones_at = self._ones.ctypes.data
        self._positions_at = self._positions.ctypes.data

    def _kv_shape(
        self, shape: tuple[Any, ...], meta: Mapping[str, Any], name: str
    ) -> tuple[int, ...]:
        if len(shape) != 4:
            raise EngineError(f"model {self.name!r}: {name} has rank {len(shape)}, expected 4")
        heads, head_dim = shape[1], shape[3]
        if not isinstance(heads, int):
            heads = meta.get("num_key_value_heads") or meta.get("num_attention_heads")
        if not isinstance(head_dim, int):
            hidden, n_heads = meta.get("hidden_size"), meta.get("num_attention_heads")
            head_dim = meta.get("head_dim") or (hidden // n_heads if hidden and n_heads else None)
        if not isinstance(heads, int) or not isinstance(head_dim, int):
            raise EngineError(
                f"model {self.name!r}: cannot tell heads and head size of {name} {shape}; "
                "give them fixed sizes or put a config.json beside the model"
            )
        return (1, heads, 0, head_dim)


class _Batch:
    """Generations decoding together, one row each, their caches padded to one width.
    Left-padded (graphs with ``position_ids``), row ``r`` holds its own cache in the
    last ``lengths[r]`` columns of every array; right-padded, in the first. The arrays
    a call returns are the next call's past as they are (no copy per token); rows are
    copied out only when they leave, and the others re-packed then.

    Right padding is for graphs that attend with ONNX Runtime's ``GroupQueryAttention``
    (contrib op, CPU kernel as of 1.32). That op takes row ``b``'s total length from
    ``seqlens_k[b] + 1`` (the graph computes it as the attention mask's row sum) and
    assumes its past fills columns ``0 .. seqlens_k[b] - S`` of ``past_key`` (``S``:
    tokens fed): it copies those columns to ``present_key``, writes the new keys right
    after them, zeroes the columns past them, and attends to the first ``seqlens_k[b]
    + 1`` columns only, in the order decoding the row alone does; rotary positions are
    ``seqlens_k[b] - S + 1 ...``. ``present_key`` is as wide as the mask. So a row
    padded on the right, its mask 1 over its own columns and the new token, computes
    what it computes alone (on ONNX Runtime 1.32's CPU provider its cache comes back
    bit-identical to decoding alone, and so do its tokens), while a row padded on the
    left would attend to the padding and lose its last keys. The op takes one token
    per row when rows have a past (``S`` > 1 only for batch 1): a prefill stays a call
    of its own, as it is here."""

    def __init__(self, gens: Sequence[Generation], *, right: bool = False) -> None:
        caches: list[KVCache] = []
        for gen in gens:
            if gen.cache is None:
                raise ValueError(f"generation {gen.request.id} joins a batch without a cache")
            caches.append(gen.cache)
        self.gens = list(gens)
        self.right = right
        self.lengths = np.array([c.length for c in caches], dtype=np.int64)
        self.width = int(self.lengths.max())
        arrays = []
        for i, like in enumerate(caches[0].arrays):
            # Zeros, not garbage: padded keys are masked out, but NaN * 0 is still NaN.
            out = np.zeros((len(gens), like.shape[1], self.width, like.shape[3]), like.dtype)
            for row, cache in enumerate(caches):
                out[row, :, self._columns(row, cache.length)] = cache.arrays[i][0]
            arrays.append(out)
        self.arrays: tuple[np.ndarray, ...] = tuple(arrays)

    def _columns(self, row: int, n: int) -> slice:
        """The columns of the first ``n`` tokens of ``row``'s cache."""
        start = 0 if self.right else self.width - int(self.lengths[row])
        return slice(start, start + n)

    def positions(self) -> np.ndarray:
        """Each row's position of the token it feeds next: its own length, not the
        padded one."""
        return self.lengths[:, None]

    def mask(self, dtype: np.dtype[Any]) -> np.ndarray:
        """The attention mask of the next call: padding 0, the row's cache and its new
        token 1 (right-padded, the new token's column is the row's length)."""
        columns = np.arange(self.width + 1)
        if self.right:
            return (columns <= self.lengths[:, None]).astype(dtype)
        return (columns >= (self.width - self.lengths)[:, None]).astype(dtype)

    def grown(self, arrays: tuple[np.ndarray, ...]) -> None:
        """Take a call's present arrays (one column more) as the batch's cache."""
        self.arrays = arrays
        self.width += 1
        self.lengths = self.lengths + 1

    def release(self, rows: Iterable[int]) -> list[Generation]:
        """Give ``rows`` their own unpadded caches back and drop them from the batch;
        return their generations."""
        leaving = sorted(set(rows))
        if not leaving:
            return []
        released = []
        for row in leaving:
            gen = self.gens[row]
            # A row whose token was not sampled (an emit that raised) covers all its
            # tokens; it keeps all but the last so its next step has one to feed.
            n = min(int(self.lengths[row]), len(gen.tokens) - 1)
            columns = self._columns(row, n)
            gen.cache = KVCache(
                tuple(np.ascontiguousarray(a[row : row + 1, :, columns]) for a in self.arrays),
                n,
            )
            released.append(gen)
        keep = [r for r in range(len(self.gens)) if r not in leaving]
        self.gens = [self.gens[r] for r in keep]
        if keep:
            # Padding every row still has is dropped: attention over it is wasted work.
            self.lengths = self.lengths[keep]
            width = int(self.lengths.max())
            cut = slice(0, width) if self.right else slice(self.width - width, self.width)
            self.width = width
            self.arrays = tuple(np.ascontiguousarray(a[keep, :, cut]) for a in self.arrays)
        return released


def _is_set(stop: threading.Event | None) -> bool:
    return stop is not None and stop.is_set()


def _charge(gens: Sequence[Generation], since: tuple[float, float]) -> tuple[float, float]:
    """Split the engine time since ``since`` (wall, thread CPU) evenly among ``gens``;
    return the new mark."""
    now = time.perf_counter(), time.thread_time()
    for gen in gens:
        gen.engine_s += (now[0] - since[0]) / len(gens)
        gen.engine_cpu_s += (now[1] - since[1]) / len(gens)
    return now


def _ignore(token: int) -> None:
    pass


def _native_calls(
    session: ort.InferenceSession, binding: ort.IOBinding
) -> tuple[Callable[[str, Any, list[int], int], None], Callable[[], None]]:
    """Bind host memory to an input of ``binding`` (name, element type, shape, address),
    and run the binding: through ONNX Runtime's native objects where this version
    exposes them, else through its public calls. The public ones build the device
    again for each bind and check for graph capture on each run, a few microseconds a
    token, against about 100 for a decode step of a small model."""
    native, native_session = getattr(binding, "_iobinding", None), getattr(session, "_sess", None)
    try:
        device = ort.OrtDevice.make("cpu", 0)._get_c_device()
    except (AttributeError, TypeError):
        native = None
    if native is None or native_session is None or not hasattr(native, "bind_input"):
        return (
            lambda name, kind, shape, at: binding.bind_input(name, "cpu", 0, kind, shape, at),
            lambda: session.run_with_iobinding(binding),
        )
    return (
        lambda name, kind, shape, at: native.bind_input(name, device, kind, shape, at),
        lambda: native_session.run_with_iobinding(native, None),
    )


def mask_only_counts(path: Path) -> bool:
    """True when the graph at ``path`` reads its attention mask only as counts that
    GroupQueryAttention takes: its row sums (``seqlens_k``) and its width
    (``total_sequence_length``), through arithmetic, shape and cast ops. A decode step
    may then bind a mask wider than the row, zeros after it: the sums, and what the op
    computes, are the same. Not so for a graph that makes anything else of the width
    (the LongRoPE builds choose their rotary tables with an ``If`` on it), or that has
    subgraphs: those get a mask of the row's width. So does a model file over
    MASK_CHECK_MAX_BYTES (its weights inside it): parsing it would hold them all in
    memory once more, for a saving of a microsecond a step on a model whose steps take
    milliseconds."""
    import onnx

    if path.stat().st_size > MASK_CHECK_MAX_BYTES:
        return False
    graph = onnx.load(str(path), load_external_data=False).graph
    consumers: dict[str, list[tuple[Any, int]]] = {}
    for node in graph.node:
        if any(a.HasField("g") or a.graphs for a in node.attribute):
            return False
        for i, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, i))
    outputs = {o.name for o in graph.output}
    todo, seen = ["attention_mask"], {"attention_mask"}
    while todo:
        tensor = todo.pop()
        if tensor in outputs:
            return False
        for node, i in consumers.get(tensor, []):
            if node.op_type == "GroupQueryAttention" and i in GQA_COUNT_INPUTS:
                continue
            if node.op_type not in COUNT_OPS:
                return False
            fresh = [o for o in node.output if o not in seen]
            seen.update(fresh)
            todo += fresh
    return True


def dynamically_quantized(path: Path) -> bool:
    """True when the model at ``path`` quantizes activations with a scale computed from
    each call's data: a DynamicQuantize op (see DYNAMIC_QUANTIZE), or a MatMulNBits
    whose ``accuracy_level`` is 2 or more (its activations are converted to fp16, bf16
    or int8 at run time, per call: the int4 default of ONNX Runtime GenAI's builder is
    4). An op type is stored as plain text in the ONNX file, so a byte search finds it
    in the graph, its subgraphs and functions without parsing anything: onnx.load would
    read every embedded weight into memory (load_external_data=False skips only
    external files, which hold no ops). Only a file that holds a MatMulNBits is parsed,
    for its attributes."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data.find(DYNAMIC_QUANTIZE) >= 0:
            return True
        if data.find(MATMUL_NBITS) < 0:
            return False
    return _nbits_accuracy(path) >= NBITS_GROUPING_LEVEL


def group_query_attention(path: Path) -> bool:
    """True when the model at ``path`` attends with ONNX Runtime's GroupQueryAttention
    op (what ONNX Runtime GenAI's builder emits): its batched caches must be padded on
    the right (see ``_Batch``). Found by a byte search, as in ``dynamically_quantized``."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return data.find(GROUP_QUERY_ATTENTION) >= 0


def _nbits_accuracy(path: Path) -> int:
    """The highest ``accuracy_level`` of the model's MatMulNBits ops (0: unset)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    graphs = [model.graph]
    level = 0
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            for attr in node.attribute:
                if node.op_type == "MatMulNBits" and attr.name == "accuracy_level":
                    level = max(level, attr.i)
                graphs += [attr.g] if attr.HasField("g") else []
                graphs += list(attr.graphs)
    for function in model.functions:
        for node in function.node:
            if node.op_type == "MatMulNBits":
                level = max([level, *(a.i for a in node.attribute if a.name == "accuracy_level")])
    return level


def _metadata(session: ort.InferenceSession, path: Path) -> dict[str, Any]:
    """Model facts from the ONNX metadata, else from a config.json beside the model
    (where Optimum exports write it), else from a genai_config.json (ONNX Runtime
    GenAI's builder writes one; see :func:`genai_facts`)."""
    meta: dict[str, Any] = dict(genai_facts(path))
    config = path.parent / "config.json"
    if config.is_file():
        with contextlib.suppress(OSError, ValueError):
            meta.update(json.loads(config.read_text()))
    for key, value in session.get_modelmeta().custom_metadata_map.items():
        try:
            meta[key] = json.loads(value)
        except ValueError:
            meta[key] = value
    return meta


GENAI_CONFIG = "genai_config.json"
# What edgefleet reads of genai_config.json's "model" section, as the Optimum
# config.json keys the decoder knows: (key in "model" or in "model.decoder", its name).
_GENAI_KEYS = (
    ("context_length", "max_position_embeddings"),
    ("eos_token_id", "eos_token_id"),
    ("pad_token_id", "pad_token_id"),
    ("vocab_size", "vocab_size"),
    ("decoder.num_hidden_layers", "num_hidden_layers"),
    ("decoder.num_attention_heads", "num_attention_heads"),
    ("decoder.num_key_value_heads", "num_key_value_heads"),
    ("decoder.head_size", "head_dim"),
    ("decoder.hidden_size", "hidden_size"),
)
# The tensor names edgefleet runs a decoder by, as genai_config.json names them.
_GENAI_NAMES = {
    "inputs.input_ids": "input_ids",
    "inputs.attention_mask": "attention_mask",
    "inputs.position_ids": "position_ids",
    "inputs.past_key_names": "past_key_values.%d.key",
    "inputs.past_value_names": "past_key_values.%d.value",
    "outputs.logits": "logits",
    "outputs.present_key_names": "present.%d.key",
    "outputs.present_value_names": "present.%d.value",
}


def genai_facts(path: Path) -> dict[str, Any]:
    """What the genai_config.json beside ``path`` says of the model (context length,
    end-of-sequence and pad ids, layers, heads, head size), under the config.json names
    the decoder reads; {} without one. EngineError when it names the model's tensors
    otherwise than edgefleet runs them (``past_key_values.%d.key``, ...)."""
    file = path.parent / GENAI_CONFIG
    if not file.is_file():
        return {}
    try:
        model = json.loads(file.read_text()).get("model", {})
    except (OSError, ValueError, AttributeError) as exc:
        raise EngineError(f"{file}: not a readable genai_config.json ({exc})") from None
    decoder = model.get("decoder", {}) if isinstance(model, dict) else {}
    named = {f"{k}.{n}": v for k in ("inputs", "outputs") for n, v in decoder.get(k, {}).items()}
    other = {k: v for k, v in named.items() if k in _GENAI_NAMES and v != _GENAI_NAMES[k]}
    if other:
        said = ", ".join(f"{k}={v!r} (edgefleet: {_GENAI_NAMES[k]!r})" for k, v in other.items())
        raise EngineError(f"{file} names the model's tensors otherwise: {said}")
    facts = {}
    for key, name in _GENAI_KEYS:
        section, _, field = key.rpartition(".")
        value = (decoder if section else model).get(field)
        if value is not None:
            facts[name] = value
    return facts


def _eos_ids(path: Path, meta: Mapping[str, Any]) -> tuple[int, ...]:
    """The model's end-of-sequence token ids: ``eos_token_id`` (one id or a list) of a
    generation_config.json beside the model, else of its config.json or metadata."""
    sources: list[Mapping[str, Any]] = []
    generation = path.parent / "generation_config.json"
    if generation.is_file():
        with contextlib.suppress(OSError, ValueError):
            sources.append(json.loads(generation.read_text()))
    for source in (*sources, meta):
        eos = source.get("eos_token_id") if isinstance(source, Mapping) else None
        ids = [eos] if isinstance(eos, int) else eos
        if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
            return tuple(ids)
    return ()


def _context_from(meta: Mapping[str, Any]) -> int | None:
    for key in CONTEXT_KEYS:
        value = meta.get(key)
        if isinstance(value, int) and value > 1:
            return value
    return None
