"""A node's generations and their KV memory.

What a generation may still produce (the token budget governor, moved by lifecycle
events), which KV it starts from (a chat session's or a shared prefix's), what is
kept when it ends, and which caches to trim or drop when KV memory is over budget
(the decision is ``policies.kv``'s).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from actors.decoder import Generation, check_generation, common_prefix
from actors.kvstore import KVStore, prefix_key, session_key
from actors.models import ModelInfo
from edgefleet.clock import Clock
from edgefleet.config import MiB, NodeSpec
from edgefleet.errors import InvalidInput
from edgefleet.priorities import check_priority
from edgefleet.request import GenerateRequest, Request
from policies.budget import LIFECYCLE_STATES, TokenBudgets, token_limit
from policies.kv import CacheView, KVAction, plan_kv_release


class NodeGenerations:
    """The live generations of one node (by request id) and the KV it keeps."""

    def __init__(self, spec: NodeSpec, clock: Clock, counters: Counter[str]) -> None:
        self._clock = clock
        self._counters = counters
        self.live: dict[str, Generation] = {}
        self.kv = KVStore()
        self._kv_budget = int(spec.kv_budget_mb * MiB)
        self._token_bytes: dict[str, int] = {}  # KV bytes a token, by model (seen so far)
        # Decoders whose outputs depend on how tokens are grouped into calls (dynamically
        # quantized): a cache another request built would change the output, so their
        # generations never reuse one, and none is kept for them.
        self.exact_models: set[str] = set()
        self.lifecycle: str = spec.lifecycle
        self._budgets = TokenBudgets.of_classes(spec.token_budget, spec.priorities)

    # ------------------------------------------------------------------ intake

    def make(
        self, request: GenerateRequest, info: ModelInfo, emit: Callable[[int], None]
    ) -> tuple[Request, Generation]:
        """The scheduler's request and the generation's state; InvalidInput, naming the
        problem, for a request the model cannot run."""
        if info.config.kind != "decoder":
            raise InvalidInput(f"model {request.model!r} is not a decoder: use infer()")
        check_priority(request.priority)
        settings = info.config.generation
        check_generation(
            request,
            vocab=info.vocab,
            max_context=info.max_context,
            max_new_tokens=settings.max_new_tokens,
        )
        if not request.stop_ids and info.stop_ids:  # a request's own stop ids replace them
            request = replace(request, stop_ids=info.stop_ids)
        now = self._clock.now()
        deadline = None
        if request.deadline_unix is not None:
            deadline = now + (request.deadline_unix - time.time())
        req = Request.generation(request, now, deadline)
        gen = Generation(
            request, limit=self.limit(request), emit=emit, max_context=info.max_context
        )
        return req, gen

    def limit(self, request: GenerateRequest) -> int:
        """New tokens ``request`` may still produce here: its budget in the current
        lifecycle state, less what an earlier attempt generated."""
        budget = token_limit(
            request.max_new_tokens, request.priority, self.lifecycle, self._budgets
        )
        return max(0, budget - request.continued)

    def set_lifecycle(self, state: str) -> bool:
        """Move to lifecycle ``state`` (True when it changed): budgets of running and
        paused generations change at their next token."""
        if state not in LIFECYCLE_STATES:
            raise InvalidInput(
                f"lifecycle state must be one of {', '.join(LIFECYCLE_STATES)}, got {state!r}"
            )
        if state == self.lifecycle:
            return False
        self.lifecycle = state
        for gen in self.live.values():
            gen.limit = self.limit(gen.request)
        return True

    # --------------------------------------------------------------- KV memory

    def attach_cache(self, gen: Generation) -> None:
        """Before a generation's first step: start from a cached session or prefix."""
        if gen.fed == 0 and gen.cache is None and gen.request.model not in self.exact_models:
            r = gen.request
            cache, n = self.kv.lookup(
                r.model,
                r.prompt_ids,
                session=r.session,
                prefix_len=r.prefix_len,
                now=self._clock.now(),
            )
            gen.cache, gen.reused = cache, n

    def keep(self, gen: Generation) -> None:
        """Keep a finished generation's KV for its session, and its shared prefix (the
        caller then brings the KV under budget with :meth:`release`)."""
        r, cache, now = gen.request, gen.cache, self._clock.now()
        if cache is None or r.model in self.exact_models:
            gen.cache = None
            return
        if r.prefix_len > 0 and not self.kv.has(
            key := prefix_key(r.model, r.prompt_ids[: r.prefix_len])
        ):
            prefix = cache.prefix(r.prefix_len)
            if prefix is not None:
                self.kv.put(key, r.model, gen.tokens, prefix, now)
        if r.session is not None:
            self.kv.put(session_key(r.model, r.session), r.model, gen.tokens, cache, now)
        gen.cache = None

    def release(self, paused: Iterable[Request], running: Iterable[Generation] = ()) -> None:
        """Bring paused and cached KV under the node's KV budget (see policies.kv). The
        caches of ``running`` generations cannot give way, so they count against the
        budget at the size they may still grow to."""
        budget = self._kv_budget - sum(self._projected(g) for g in running)
        paused_by_id = {r.id: r for r in paused}
        views = self.kv.views()
        for rid, r in paused_by_id.items():
            cache = self.live[rid].cache
            if cache is not None:
                keep = cache.bytes_for(self._trim_len(self.live[rid]))
                views.append(CacheView(rid, cache.nbytes, keep, True, r.priority, seq=r.seq))
        for key, action in plan_kv_release(views, budget):
            gen = self.live.get(key) if key in paused_by_id else None
            if gen is None:
                self.kv.drop(key)
                self._counters["kv_dropped"] += 1
            elif action is KVAction.TRIM and gen.cache is not None:
                gen.cache = gen.cache.prefix(self._trim_len(gen))
                self._counters["kv_trimmed"] += 1
            else:
                gen.cache = None
                self._counters["kv_dropped"] += 1

    def _trim_len(self, gen: Generation) -> int:
        """What a trim keeps of ``gen``'s cache: its shared start, cut back to where its
        model can rebuild the rest with the same output."""
        return gen.aligned(self._shared_len(gen))

    def _shared_len(self, gen: Generation) -> int:
        """Tokens of ``gen``'s cache worth keeping in a trim: its declared prefix, else
        the longest start it shares with another cache of the same model."""
        if gen.request.prefix_len > 0:
            return gen.request.prefix_len
        others: list[Sequence[int]] = [e.tokens for e in self.kv.entries(gen.request.model)]
        others += [
            g.tokens
            for g in self.live.values()
            if g is not gen and g.cache is not None and g.request.model == gen.request.model
        ]
        return max((common_prefix(gen.tokens, t) for t in others), default=0)

    def _projected(self, gen: Generation) -> int:
        """Bytes of ``gen``'s cache once it has made every token it may still make."""
        cache = gen.cache
        if cache is not None and cache.length:
            self._token_bytes[gen.request.model] = cache.nbytes // cache.length
        per_token = self._token_bytes.get(gen.request.model, 0)
        made = len(gen.generated)
        left = max(0, min(gen.limit, gen.request.max_new_tokens - gen.request.continued) - made)
        tokens = len(gen.tokens) + left
        if gen.max_context is not None:
            tokens = min(tokens, gen.max_context)
        return per_token * tokens

    def kv_bytes(
        self, paused: Iterable[Request], running: Iterable[Generation] = ()
    ) -> dict[str, int]:
        held = sum(c.nbytes for r in paused if (c := self.live[r.id].cache) is not None)
        busy = sum(g.cache.nbytes for g in running if g.cache is not None)
        return {"running": busy, "paused": held, "cached": self.kv.nbytes}
