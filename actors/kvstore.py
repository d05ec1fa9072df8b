"""KV caches a node keeps between generations: chat sessions and shared prefixes.

A session's entry holds the KV of its last turn, so the next turn prefills only what
is new. A prefix entry holds the KV of a shared prefix (a system prompt) that many
requests start with. Entries live within the node's KV budget, least recently used
out first (the node decides, with ``policies.kv``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from actors.decoder import KVCache, common_prefix
from policies.kv import CacheView


@dataclass
class CachedKV:
    key: str
    model: str
    tokens: tuple[int, ...]  # the tokens the cache covers
    cache: KVCache
    last_used: float


def session_key(model: str, session: str) -> str:
    return f"session:{model}:{session}"


def prefix_key(model: str, tokens: Sequence[int]) -> str:
    digest = hashlib.blake2b(repr(tuple(tokens)).encode(), digest_size=12).hexdigest()
    return f"prefix:{model}:{digest}"


class KVStore:
    """Session and prefix caches by key, in least-recently-used order."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, CachedKV] = OrderedDict()

    def lookup(
        self, model: str, prompt: Sequence[int], *, session: str | None, prefix_len: int, now: float
    ) -> tuple[KVCache | None, int]:
        """The longest cached start of ``prompt``: the session's last turn, or the
        shared prefix. At least one prompt token is left to feed (its logits are
        needed), so at most ``len(prompt) - 1`` tokens are reused."""
        keys = []
        if session is not None:
            keys.append(session_key(model, session))
        if prefix_len > 0:
            keys.append(prefix_key(model, prompt[:prefix_len]))
        best: tuple[CachedKV, int] | None = None
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                continue
            n = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
            if n > 0 and (best is None or n > best[1]):
                best = (entry, n)
        if best is None:
            return None, 0
        entry, n = best
        entry.last_used = now
        self._entries.move_to_end(entry.key)
        return entry.cache.prefix(n), n

    def put(self, key: str, model: str, tokens: Sequence[int], cache: KVCache, now: float) -> None:
        self._entries.pop(key, None)
        self._entries[key] = CachedKV(key, model, tuple(tokens[: cache.length]), cache, now)

    def has(self, key: str) -> bool:
        return key in self._entries

    def drop(self, key: str) -> None:
        self._entries.pop(key, None)

    def entries(self, model: str | None = None) -> list[CachedKV]:
        return [e for e in self._entries.values() if model is None or e.model == model]

    def views(self) -> list[CacheView]:
        return [
            CacheView(e.key, e.cache.nbytes, last_used=e.last_used) for e in self._entries.values()
        ]

    def sessions(self) -> list[str]:
        """Resident sessions, most recently used first."""
        return [
            e.key.split(":", 2)[2]
            for e in reversed(self._entries.values())
            if e.key.startswith("session:")
        ]

    @property
    def nbytes(self) -> int:
        return sum(e.cache.nbytes for e in self._entries.values())

    def clear(self) -> None:
        self._entries.clear()
