"""The call record: one JSON line per request a caller placed, opt-in.

With ``router.record_dir`` set, every :class:`~cluster.dispatch.Dispatcher` (one per
``FleetClient``) appends to its own file in that folder,
``calls-{host}-{pid}-{n}.jsonl`` (``n`` counts the dispatchers of one process), one
line when a request's final answer is known. The files of a fleet's callers replay
together in the simulator: ``sim.workload.read_trace`` reads one file or a folder of
them, merged by ``at`` (``trace:`` in a workload file).

One line, one request (keys in this order; numbers are JSON numbers)::

    at              unix time the request reached the caller (float seconds)
    id              the request id
    model           the model name
    priority        0-10, higher runs first
    rows            rows on the batch axis (1 for a generation)
    deadline_s      the deadline, seconds after ``at`` (null: none; a deadline already
                    past on arrival is recorded as 1e-06)
    key             the dedup key, or null (generations have none)
    session         the chat session of a generation, or null
    prompt_tokens   prompt tokens of a generation (0 for an inference)
    max_new_tokens  tokens a generation asked for (0 for an inference)
    outcome         "completed", or the class name of the error the caller got,
                    lower-cased ("rejected", "evicted", "deadlineexceeded",
                    "nodelost", "cancelled", ...: the dispatcher's counter names); a
                    generation whose caller stopped reading it is "cancelled"
    latency_s       arrival at the caller to the final answer, on the dispatcher's clock
    node            the node that gave the final answer, or "" (none did)
    service_ms      engine time of the call that served the request, as its node
                    measured it (``Reply.service_s``; 0 when no call did, e.g. it
                    expired while queued); a generation's over all its engine calls
                    (``GenerationResult.engine_s``); null when no node answered
    queue_ms        time queued on the node, arrival to engine start (``queue_s`` of
                    the answer; a generation's to its first engine step); null when no
                    node answered
    batch           requests in the call that served it (``Reply.batch_size``; 0 when
                    no call did); null for a generation, and when no node answered
    call_rows       rows in that call (``Reply.call_rows``): the call's size, by which
                    the simulator draws engine times; null as batch is
    handoff_ms      the last part of queue_ms: from the node's engine being ready for
                    that call (the call before it ended, or it was planned) to its
                    start (``Reply.handoff_s``); null as service_ms is
    abort_ms        also within queue_ms: how long the call its node's engine aborted
                    just before that call (preempted, or cancelled) took to stop, from
                    the abort to the end of its run (``Reply.abort_s``); 0 when the call
                    before was not aborted; null as service_ms is
    new_tokens      tokens a generation made (``GenerationResult.tokens``); null for an
                    inference, and when no node answered
    fed_tokens      tokens a generation ran through the model: its prompt, what it
                    prefilled again after a pause or a loss, and one a step
                    (``GenerationResult.fed_tokens``); null as new_tokens is

For example::

    {"at": 1767268800.123, "id": "9f3c...", "model": "classifier", "priority": 10,
     "rows": 1, "deadline_s": 0.2, "key": null, "session": null, "prompt_tokens": 0,
     "max_new_tokens": 0, "outcome": "completed", "latency_s": 0.0012, "node": "edge-0",
     "service_ms": 0.731, "queue_ms": 0.052, "batch": 1, "call_rows": 1,
     "handoff_ms": 0.041, "abort_ms": 0.0, "new_tokens": null, "fed_tokens": null}

Readers take lines without the last eight keys too (their figures then unknown): the
simulator replays such files, and draws engine times only from lines that have them
(``sim.workload.read_engine_times``, and for generations
``sim.workload.read_generation_times``).

Lines are buffered and flushed at least once a second while requests are answered
(and on every fleet view a ``FleetClient`` fetches), and when the dispatcher closes; a
process that is killed loses the lines not flushed yet, and a reader skips a last line
cut short. Requests answered after the dispatcher closed are not recorded. Recording
never fails a request: the first error writing the file (a folder that cannot be
created, a full disk) is logged and turns recording off for that dispatcher; a request
no line can carry (an id that is not a string, say) costs its own line only: counted
(``CallRecord.skipped``), the first one logged.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import socket
import threading
import time
import weakref
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import IO

from edgefleet.messages import GenerationResult, Reply
from edgefleet.request import GenerateRequest, InferRequest

log = logging.getLogger(__name__)

FLUSH_EVERY_S = 1.0  # a line waits at most this long in the buffer while requests flow
PAST_DEADLINE_S = 1e-6  # deadline_s of a request whose deadline passed before it arrived

_numbers = itertools.count()  # distinguishes the dispatchers of one process


def record_path(directory: Path, host: str, pid: int, n: int) -> Path:
    """The file of one dispatcher."""
    return directory / f"calls-{host}-{pid}-{n}.jsonl"


def call_line(
    request: InferRequest | GenerateRequest,
    *,
    at: float,
    rows: int,
    outcome: str,
    latency_s: float,
    node: str,
    answer: Reply | GenerationResult | None = None,
) -> str:
    """One request's line, newline included; ``answer`` is the final answer, when the
    caller got one (its node's figures: see :func:`node_figures`).

    Formatted directly, strings escaped as ``json.dumps`` escapes them: about 3 µs,
    where ``json.dumps`` of the same dict takes 5 (this runs once per request).
    """
    if isinstance(request, GenerateRequest):
        key, session = None, request.session
        prompt_tokens, max_new_tokens = len(request.prompt_ids), request.max_new_tokens
    else:
        key, session, prompt_tokens, max_new_tokens = request.key, None, 0, 0
    deadline_s = _deadline_s(request.deadline_unix, at)
    service_ms, queue_ms, batch, call_rows, handoff_ms, abort_ms = node_figures(answer)
    made = fed = None
    if isinstance(answer, GenerationResult) and answer.node:
        made, fed = len(answer.tokens), answer.fed_tokens
    return (
        f'{{"at": {float(at)!r}, "id": {_text(request.id)}, "model": {_text(request.model)}, '
        f'"priority": {int(request.priority)}, "rows": {int(rows)}, '
        f'"deadline_s": {"null" if deadline_s is None else repr(deadline_s)}, '
        f'"key": {_maybe_text(key)}, "session": {_maybe_text(session)}, '
        f'"prompt_tokens": {int(prompt_tokens)}, "max_new_tokens": {int(max_new_tokens)}, '
        f'"outcome": {_text(outcome)}, "latency_s": {round(float(latency_s), 6)!r}, '
        f'"node": {_text(node)}, "service_ms": {_maybe_number(service_ms)}, '
        f'"queue_ms": {_maybe_number(queue_ms)}, '
        f'"batch": {"null" if batch is None else int(batch)}, '
        f'"call_rows": {"null" if call_rows is None else int(call_rows)}, '
        f'"handoff_ms": {_maybe_number(handoff_ms)}, "abort_ms": {_maybe_number(abort_ms)}, '
        f'"new_tokens": {"null" if made is None else int(made)}, '
        f'"fed_tokens": {"null" if fed is None else int(fed)}}}\n'
    )


def node_figures(
    answer: Reply | GenerationResult | None,
) -> tuple[float | None, float | None, int | None, int | None, float | None, float | None]:
    """``service_ms``, ``queue_ms``, ``batch``, ``call_rows``, ``handoff_ms`` and
    ``abort_ms`` of a request's line: what the node that gave the final ``answer``
    measured (ms rounded to the µs); None for a figure the answer does not carry, and
    for all six when no node answered."""
    if answer is None or not answer.node:
        return None, None, None, None, None, None
    queue_ms = round(float(answer.queue_s) * 1000, 3)
    if isinstance(answer, GenerationResult):
        return round(float(answer.engine_s) * 1000, 3), queue_ms, None, None, None, None
    return (
        round(float(answer.service_s) * 1000, 3),
        queue_ms,
        int(answer.batch_size),
        int(answer.call_rows),
        round(float(answer.handoff_s) * 1000, 3),
        round(float(answer.abort_s) * 1000, 3),
    )


_text = encode_basestring_ascii  # a JSON string; TypeError for anything but a str


def _maybe_text(value: str | None) -> str:
    return "null" if value is None else _text(value)


def _maybe_number(value: float | None) -> str:
    """A JSON number, or null for None or a value JSON cannot carry (NaN, infinity)."""
    return "null" if value is None or not math.isfinite(value) else repr(value)


def _deadline_s(deadline_unix: float | None, at: float) -> float | None:
    """Seconds from ``at`` to the deadline; None for none (or an infinite one)."""
    if deadline_unix is None or not math.isfinite(deadline_unix):
        return None
    return max(PAST_DEADLINE_S, round(float(deadline_unix) - at, 6))


class CallRecord:
    """Appends one dispatcher's lines to its file. Thread-safe: requests are answered
    on callers' threads, Ray's completion threads and the dispatcher's own."""

    def __init__(self, directory: Path) -> None:
        self.path = record_path(directory, socket.gethostname(), os.getpid(), next(_numbers))
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._off = False  # closed, or failed: lines are dropped
        self._flushed_at = time.monotonic()
        self._close: weakref.finalize[[], CallRecord] | None = None
        self.skipped = 0  # requests no line could carry

    def _open(self) -> IO[str] | None:
        """Open the file for the first line (a caller that sends nothing leaves none);
        None when recording is off (holding the lock)."""
        if self._off:
            return None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
        except OSError:
            self._fail()
            return None
        # Closes the file once: on close(), or when the process exits without it.
        self._close = weakref.finalize(self, file.close)
        self._file = file
        return file

    def answered(
        self,
        request: InferRequest | GenerateRequest,
        *,
        at: float,
        rows: int,
        outcome: str,
        latency_s: float,
        node: str,
        answer: Reply | GenerationResult | None = None,
    ) -> None:
        """Record a request's final answer (see :func:`call_line`)."""
        try:
            line = call_line(
                request,
                at=at,
                rows=rows,
                outcome=outcome,
                latency_s=latency_s,
                node=node,
                answer=answer,
            )
        except Exception:  # a request no JSON can carry (a caller's own id type)
            with self._lock:
                self.skipped += 1
                if self.skipped == 1:
                    log.warning(
                        "call record: request %r cannot be recorded; such requests are "
                        "left out of %s (counted)",
                        request.id,
                        self.path,
                        exc_info=True,
                    )
            return
        self.write(line)

    def write(self, line: str) -> None:
        """Append ``line``; flush when the last flush is a second old."""
        with self._lock:
            file = self._file if self._file is not None else self._open()
            if file is None:
                return
            try:
                file.write(line)
                now = time.monotonic()
                if now - self._flushed_at >= FLUSH_EVERY_S:
                    self._flushed_at = now
                    file.flush()
            except Exception:
                self._fail()

    def flush(self) -> None:
        """Write out the lines buffered so far."""
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.flush()
                self._flushed_at = time.monotonic()
            except Exception:
                self._fail()

    def close(self) -> None:
        """Flush and close the file; later lines are dropped."""
        with self._lock:
            try:
                self._stop()
            except Exception:
                log.warning("call record: cannot write %s", self.path, exc_info=True)

    def _fail(self) -> None:
        """Log the error being handled and stop recording (holding the lock); once."""
        if self._off:
            return
        log.warning("call record off: cannot write %s", self.path, exc_info=True)
        with contextlib.suppress(Exception):  # the buffer cannot be written either: dropped
            self._stop()

    def _stop(self) -> None:
        """Close the file, flushing it (holding the lock)."""
        self._off = True
        self._file = None
        if self._close is not None:
            self._close()
