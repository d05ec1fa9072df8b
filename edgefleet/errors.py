"""Typed errors. Every request that does not produce a result ends in exactly one of these.

All errors are subclasses of :class:`EdgeFleetError`, carry a human-readable message
that says what to do, and pickle cleanly so they cross Ray process boundaries intact.
"""

from __future__ import annotations

from typing import Any


class EdgeFleetError(Exception):
    """Base class of every error edgefleet reports to a caller."""

    def __init__(self, message: str, *, request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle only their positional args by default; keep the keywords too.
        return (_rebuild, (type(self), self.message, self.__dict__.copy()))

    def __str__(self) -> str:
        return self.message


def _rebuild(cls: type[EdgeFleetError], message: str, state: dict[str, Any]) -> EdgeFleetError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


class Rejected(EdgeFleetError):
    """The request was refused at admission (queue full, node draining, switching...).

    ``retry_after_s`` estimates when capacity for this priority frees up.
    """

    def __init__(
        self, message: str, *, retry_after_s: float = 0.0, request_id: str | None = None
    ) -> None:
        super().__init__(message, request_id=request_id)
        self.retry_after_s = retry_after_s


class Evicted(EdgeFleetError):
    """A queued request was pushed out of a full queue by a higher-priority arrival."""


class Superseded(EdgeFleetError):
    """A queued request was replaced by a newer request with the same dedup key."""


class DeadlineExceeded(EdgeFleetError):
    """The request's deadline passed before it could run; the engine was not used."""


class Cancelled(EdgeFleetError):
    """The request was cancelled by its caller (or its node was shut down)."""


class InvalidInput(EdgeFleetError):
    """The inputs do not match the model signature or the configured limits, or an
    argument of a call is not what it accepts (an unknown node, a non-string id...)."""


class ModelNotFound(EdgeFleetError):
    """The model is not configured on this node or fleet, or its file is missing."""


class EngineError(EdgeFleetError):
    """The inference engine failed while running this request."""


class EngineTimeout(EngineError):
    """The engine call running this request ran past its model's ``max_call_s`` and
    was terminated (or its node gave up on it: the engine did not stop)."""


class NodeLost(EdgeFleetError):
    """The node holding the request died or stopped answering."""


class TimedOut(EdgeFleetError, TimeoutError):
    """A caller's wait ran out before every answer came (the requests keep running)."""


class ConfigError(EdgeFleetError):
    """A fleet configuration is invalid; the message names each problem by its YAML path."""


class FleetNotRunning(EdgeFleetError):
    """The fleet, or the Ray cluster it runs on, is not there: never started, stopped,
    or its Ray head died. The message says which, and what to run."""


class FleetStartError(EdgeFleetError):
    """A fleet could not be started: it is already running, a node failed to start
    (the message names the node, the model and why), or nodes could not be placed in
    time (the message names what they ask for)."""


class VersionFailed(EdgeFleetError):
    """A model's new version did not load or warm up on a node, which serves the old
    version again."""


class RolloutRefused(EdgeFleetError):
    """A rollout was refused before any node was touched: the new file is not ONNX, does
    not load, has other inputs or outputs than the version served, the model or version
    is unknown, or another rollout of the model is running. The message says which."""


__all__ = [
    "Cancelled",
    "ConfigError",
    "DeadlineExceeded",
    "EdgeFleetError",
    "EngineError",
    "EngineTimeout",
    "Evicted",
    "FleetNotRunning",
    "FleetStartError",
    "InvalidInput",
    "ModelNotFound",
    "NodeLost",
    "Rejected",
    "RolloutRefused",
    "Superseded",
    "TimedOut",
    "VersionFailed",
]
