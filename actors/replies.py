"""Answers a node keeps so that a retry under a known request id gets the same answer.

Only answers of requests that ran are kept (outputs, or an engine failure): a refusal
(rejected, evicted, superseded, expired, cancelled, invalid) is not, so a retry of a
refused request is a new attempt. See ``NodeRuntime.infer`` for the whole contract.
"""

from __future__ import annotations

from collections import OrderedDict

from edgefleet.messages import Reply

RECENT_REPLIES = 1024  # answers kept to serve retries of the same request id...
RECENT_BYTES = 32 * 1024 * 1024  # ...within this many bytes of outputs


def _size(reply: Reply) -> int:
    return sum(a.nbytes for a in (reply.outputs or {}).values())


class RecentReplies:
    """The last ``max_replies`` answers within ``max_bytes`` of outputs, oldest out first."""

    def __init__(self, max_replies: int = RECENT_REPLIES, max_bytes: int = RECENT_BYTES) -> None:
        self._max_replies = max_replies
        self._max_bytes = max_bytes
        self._replies: OrderedDict[str, Reply] = OrderedDict()
        self._bytes = 0

    def get(self, request_id: str) -> Reply | None:
        return self._replies.get(request_id)

    def remember(self, reply: Reply) -> None:
        size = _size(reply)
        if size > self._max_bytes // 4:
            return  # too large to keep: a retry of it would run again (inference is idempotent)
        self._replies[reply.request_id] = reply
        self._bytes += size
        while len(self._replies) > self._max_replies or self._bytes > self._max_bytes:
            _, old = self._replies.popitem(last=False)
            self._bytes -= _size(old)
