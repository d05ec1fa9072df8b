"""Requests and the request lifecycle, written down once (priorities: see
:mod:`edgefleet.priorities`)."""

from __future__ import annotations

import enum
import math
import time
import uuid
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from edgefleet.errors import InvalidInput

# Also importable from here, next to the requests that carry them.
from edgefleet.priorities import DEFAULT_PRIORITIES as DEFAULT_PRIORITIES
from edgefleet.priorities import priority_name as priority_name
from edgefleet.priorities import resolve_priority as resolve_priority


def check_text(value: object, what: str) -> str | None:
    """``value`` if it is None or a non-empty string (an id, a dedup key, a session)."""
    if value is None or (isinstance(value, str) and value):
        return value
    raise InvalidInput(f"{what} must be a non-empty string or None, got {value!r}")


def token_ids(values: Iterable[int], what: str) -> tuple[int, ...]:
    """Token ids as a tuple of ints; anything else is InvalidInput naming ``what``."""
    try:
        ids = tuple(values)
    except TypeError:
        raise InvalidInput(f"{what} must be a list of int token ids, got {values!r}") from None
    if not all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in ids):
        raise InvalidInput(f"{what} must be a list of int token ids, got {ids[:8]!r}")
    return tuple(int(t) for t in ids)


def input_rows(inputs: Mapping[str, object], batchable: bool) -> int:
    """The rows a request's inputs put on a node's batch axis, counted as the node
    counts them (the node is the authority; callers price requests and the simulator
    runs them by this same count): 1 for a model that cannot batch (it runs each
    request alone), else the size of axis 0, which every input of such a model has
    and shares (a node refuses inputs that disagree, or that have no row). Inputs with
    no shape at all count 1."""
    if batchable:
        for value in inputs.values():
            shape: tuple[int, ...] = tuple(getattr(value, "shape", ()))
            if shape:
                return int(shape[0])
    return 1


class RequestState(enum.Enum):
    NEW = "new"  # arrived, not yet admitted
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"
    FAILED = "failed"
    REJECTED = "rejected"
    EVICTED = "evicted"
    SUPERSEDED = "superseded"
    EXPIRED = "expired"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset(
    {
        RequestState.COMPLETED,
        RequestState.FAILED,
        RequestState.REJECTED,
        RequestState.EVICTED,
        RequestState.SUPERSEDED,
        RequestState.EXPIRED,
        RequestState.CANCELLED,
    }
)

S = RequestState
TRANSITIONS: Mapping[RequestState, frozenset[RequestState]] = {
    # FAILED from NEW: invalid input or unknown model, found before queueing.
    # EXPIRED from NEW: the deadline had already passed on arrival.
    S.NEW: frozenset({S.QUEUED, S.REJECTED, S.FAILED, S.EXPIRED, S.CANCELLED}),
    # FAILED from QUEUED: the model could not be loaded when the request came up.
    S.QUEUED: frozenset({S.RUNNING, S.EVICTED, S.SUPERSEDED, S.EXPIRED, S.CANCELLED, S.FAILED}),
    # QUEUED from RUNNING: a preempted single-shot run goes back to the head of its priority.
    # PAUSED from RUNNING: a preempted generation keeps its KV cache and waits to resume.
    S.RUNNING: frozenset({S.COMPLETED, S.FAILED, S.PAUSED, S.CANCELLED, S.QUEUED}),
    S.PAUSED: frozenset({S.RUNNING, S.CANCELLED}),
}
del S


class IllegalTransition(RuntimeError):
    """A bug: code tried to move a request (or a node: see ``NODE_MOVES``) along an
    edge its lifecycle does not have."""


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class InferRequest:
    """What a caller sends to a node: one inference, fully described.

    ``deadline_unix`` is wall-clock time (``time.time()``) so it survives the trip
    between processes; the node converts it to its own clock on arrival.
    """

    model: str
    inputs: Mapping[str, np.ndarray]
    priority: int = DEFAULT_PRIORITIES["foreground"]
    id: str = field(default_factory=new_request_id)
    deadline_unix: float | None = None
    key: str | None = None
    # Never run twice: when the node holding it is lost (it may have run there), the
    # caller gets NodeLost instead of the request being placed again.
    at_most_once: bool = False
    version: str | None = None  # served only by a node with this version of the model

    @staticmethod
    def deadline_from_timeout(timeout_s: float | None) -> float | None:
        """Wall-clock deadline ``timeout_s`` seconds from now (None: no deadline)."""
        if timeout_s is None:
            return None
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, int | float | np.integer | np.floating)
            or math.isnan(timeout_s)
        ):
            raise InvalidInput(f"deadline_s must be a number of seconds, got {timeout_s!r}")
        return time.time() + float(timeout_s)


FINISH_REASONS = ("stop", "length", "budget", "cancelled")


@dataclass(frozen=True)
class GenerateRequest:
    """One generation: prompt token ids in, token ids streamed out.

    ``prefix_len`` marks the first tokens of the prompt as a shared prefix (a system
    prompt): a node keeps its KV when it must trim a paused generation's cache, and
    reuses it for later requests with the same prefix. ``session`` names a chat whose
    follow-up turns reuse the KV of earlier turns while the node still holds it.
    ``temperature`` 0 is greedy decoding; otherwise sampling is seeded by ``seed``.
    """

    model: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 64
    priority: int = DEFAULT_PRIORITIES["foreground"]
    id: str = field(default_factory=new_request_id)
    session: str | None = None
    prefix_len: int = 0
    temperature: float = 0.0
    top_k: int = 0
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    deadline_unix: float | None = None  # to start; a started generation runs to its end
    # The last ``continued`` prompt ids were generated by an earlier attempt on a node
    # that was lost: this one goes on from there, within the same token budget and on
    # the same sampling stream, as if never interrupted.
    continued: int = 0
    # Never continued elsewhere: a lost node ends it with NodeLost and the tokens sent.
    at_most_once: bool = False
    version: str | None = None  # served only by a node with this version of the model


@dataclass(eq=False)
class Request:
    """A request as the node's scheduler tracks it. Only the scheduler mutates it."""

    id: str
    model: str
    inputs: Mapping[str, np.ndarray]
    priority: int
    arrival: float
    deadline: float | None = None  # on the node's clock
    key: str | None = None
    seq: int = 0  # arrival order, for FIFO within a priority
    nbytes: int = 0
    rows: int = 1  # rows on the batch axis (1 for models that cannot batch)
    group: Hashable = None  # requests share a batch only within one group
    state: RequestState = RequestState.NEW
    isolate: bool = False  # run alone: its last batch failed
    preemptions: int = 0
    started: float | None = None
    cancel_requested: bool = False  # running when cancelled: drop its result
    pausable: bool = False  # a generation: preemption pauses it instead of requeueing

    @classmethod
    def generation(
        cls, request: GenerateRequest, arrival: float, deadline: float | None
    ) -> Request:
        """The scheduler's view of a generation: pausable, and never in an inference
        batch (decode batches form apart)."""
        return cls(
            id=request.id,
            model=request.model,
            inputs={},
            priority=request.priority,
            arrival=arrival,
            deadline=deadline,
            nbytes=8 * len(request.prompt_ids),
            group=request.id,
            pausable=True,
        )

    def move(self, new: RequestState) -> None:
        if new not in TRANSITIONS.get(self.state, frozenset()):
            raise IllegalTransition(f"request {self.id}: {self.state.name} -> {new.name}")
        self.state = new
