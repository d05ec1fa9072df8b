"""The ONNX Runtime engine: signatures, input validation, batched runs, abort.

A node owns one engine. It runs on the node's engine thread (ONNX Runtime releases
the GIL), one call at a time. Everything here is synchronous; the node actor moves
calls onto the thread.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort

from edgefleet.errors import EngineError, InvalidInput, ModelNotFound
from edgefleet.providers import (
    BUILDS,
    CPU,
    DeviceProviders,
    ProviderConfig,
    ProviderUnavailable,
    ProviderUse,
    SessionPlan,
    short_names,
)
from edgefleet.request import input_rows

Dim = int | str | None  # a fixed size, or a named / unnamed dynamic axis

_ORT_TYPES: dict[str, np.dtype[Any]] = {
    "tensor(float)": np.dtype(np.float32),
    "tensor(float16)": np.dtype(np.float16),
    "tensor(double)": np.dtype(np.float64),
    "tensor(int8)": np.dtype(np.int8),
    "tensor(int16)": np.dtype(np.int16),
    "tensor(int32)": np.dtype(np.int32),
    "tensor(int64)": np.dtype(np.int64),
    "tensor(uint8)": np.dtype(np.uint8),
    "tensor(uint16)": np.dtype(np.uint16),
    "tensor(uint32)": np.dtype(np.uint32),
    "tensor(uint64)": np.dtype(np.uint64),
    "tensor(bool)": np.dtype(np.bool_),
}


class RunAborted(Exception):
    """The running call was aborted on purpose (preemption or cancel)."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: np.dtype[Any]
    shape: tuple[Dim, ...]

    def describe(self) -> str:
        dims = ",".join("N" if d is None else str(d) for d in self.shape)
        return f"{self.dtype.name} [{dims}]"

    @cached_property
    def _fixed(self) -> tuple[tuple[int, int], ...]:
        """(axis, size) of every axis with a fixed size."""
        return tuple((i, d) for i, d in enumerate(self.shape) if isinstance(d, int))

    def fits(self, value: np.ndarray) -> bool:
        """``value`` has this dtype, rank and every fixed axis size."""
        shape = value.shape
        if value.dtype != self.dtype or len(shape) != len(self.shape):
            return False
        return all(shape[axis] == size for axis, size in self._fixed)


def describe_array(a: np.ndarray) -> str:
    return f"{a.dtype.name} [{','.join(str(d) for d in a.shape)}]"


@dataclass(frozen=True)
class Signature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @cached_property
    def batchable(self) -> bool:
        """True when every input and output has a dynamic axis 0 (the shared batch axis)."""
        specs = self.inputs + self.outputs
        if not specs or any(not s.shape or isinstance(s.shape[0], int) for s in specs):
            return False
        # Named batch axes must all carry the same name to be the same axis.
        names = {s.shape[0] for s in specs if isinstance(s.shape[0], str)}
        return len(names) <= 1

    def describe(self) -> str:
        return ", ".join(f"{s.name} ({s.describe()})" for s in self.inputs)

    @cached_property
    def text(self) -> str:
        """Inputs and outputs on one line (every status report carries it): two versions
        of a model take the same requests when theirs are equal."""
        ins = ", ".join(f"{s.name} {s.describe()}" for s in self.inputs)
        return f"{ins} -> " + ", ".join(f"{s.name} {s.describe()}" for s in self.outputs)

    @cached_property
    def input_names(self) -> frozenset[str]:
        return frozenset(s.name for s in self.inputs)


@dataclass(frozen=True)
class InputInfo:
    """What admission needs to know about valid inputs."""

    nbytes: int
    rows: int
    group: Hashable  # None when the model cannot batch: the request runs alone


class Engine(Protocol):
    """One loaded model, as the node uses it. Tests provide fakes with scripted costs."""

    @property
    def signature(self) -> Signature: ...

    def check(self, inputs: Mapping[str, Any], max_bytes: int) -> InputInfo:
        """Validate inputs; MUST raise InvalidInput naming the input, expected and got."""
        ...

    def run(
        self, batch: Sequence[Mapping[str, np.ndarray]], stop: threading.Event | None = None
    ) -> list[dict[str, np.ndarray]]:
        """Run requests together; one output dict per request, in order. MUST raise
        RunAborted without running when ``stop`` is already set, RunAborted when
        ``abort`` interrupted it, and EngineError on failure."""
        ...

    def abort(self) -> None:
        """Interrupt the call in progress, from any thread; no effect when idle.
        Callers set the call's ``stop`` event first, so a call that has not started
        yet cannot miss the abort."""
        ...

    def close(self) -> None: ...


def check_inputs(
    sig: Signature,
    model: str,
    inputs: Mapping[str, Any],
    max_bytes: int,
    *,
    finite: bool = False,
) -> InputInfo:
    """Validate a request's inputs against a signature (shared by real and fake engines).
    With ``finite``, floating-point inputs holding NaN or infinity are refused too."""
    if not isinstance(inputs, Mapping):
        raise InvalidInput(
            f"inputs must be a dict of name -> numpy array, got {type(inputs).__name__}"
        )
    if inputs.keys() != sig.input_names:  # (each request passes here: the common case is quick)
        for name in inputs:
            if name not in sig.input_names:
                raise InvalidInput(
                    f"unknown input {name!r} for model {model!r}; it takes {sig.describe()}"
                )
        for spec in sig.inputs:
            if spec.name not in inputs:
                raise InvalidInput(f"missing input {spec.name!r}: expects {spec.describe()}")
    nbytes = 0
    rows: dict[str, int] = {}
    for spec in sig.inputs:
        value = inputs[spec.name]
        if not isinstance(value, np.ndarray):
            raise InvalidInput(
                f"input {spec.name!r} expects a numpy array {spec.describe()}, "
                f"got {type(value).__name__}"
            )
        if not spec.fits(value):
            raise InvalidInput(
                f"input {spec.name!r} expects {spec.describe()}, got {describe_array(value)}"
            )
        if finite and value.dtype.kind in "fc" and not np.isfinite(value).all():
            count = int(value.size - np.count_nonzero(np.isfinite(value)))
            raise InvalidInput(
                f"input {spec.name!r} of model {model!r} holds {count} NaN or infinite "
                f"value(s) of {value.size}; the model's reject_non_finite is on"
            )
        nbytes += value.nbytes
        if value.ndim:
            rows[spec.name] = value.shape[0]
    if nbytes > max_bytes:
        raise InvalidInput(
            f"inputs of model {model!r} take {nbytes} bytes; the limit is {max_bytes} bytes"
        )
    n = input_rows(inputs, sig.batchable)
    if not sig.batchable:
        return InputInfo(nbytes, n, None)
    if len(set(rows.values())) > 1:
        detail = ", ".join(f"{name} has {r}" for name, r in rows.items())
        raise InvalidInput(f"inputs disagree on the batch axis (axis 0): {detail}")
    if n < 1:
        raise InvalidInput("inputs have an empty batch axis (0 rows)")
    group = (model,) + tuple((s.name, inputs[s.name].shape[1:]) for s in sig.inputs)
    return InputInfo(nbytes, n, group)


def open_session(name: str, path: Path, threads: int) -> ort.InferenceSession:
    """An ONNX Runtime session of ``path`` on the CPU provider, as a node opens one."""
    return open_planned(name, SessionPlan(path, (CPU,)), threads)[0]


def open_planned(
    name: str, plan: SessionPlan, threads: int, *, arena: bool = True
) -> tuple[ort.InferenceSession, ProviderUse]:
    """An ONNX Runtime session as a node runs it (sequential, one inter-op thread) on
    the providers of ``plan``, and what it really runs on. ``arena`` False: the CPU's
    tensors come from the system allocator, not ONNX Runtime's arena (see
    ``DecoderEngine``).

    A session whose first provider is not the CPU is first opened with the CPU
    fallback off, so that a graph its provider cannot run whole is caught: a strict
    model then fails with ProviderUnavailable; any other is opened again with the
    fallback on, and says why in ``ProviderUse.fallback``.
    """
    path = plan.path
    if not path.is_file():
        raise ModelNotFound(f"model {name!r}: file {path} does not exist")
    accelerated = [p for p in plan.providers if p.name != CPU.name]
    fallback = plan.fallback
    if accelerated and plan.providers[0].name != CPU.name:
        try:
            session = _session(name, path, threads, accelerated, cpu_fallback=False, arena=arena)
            return session, _use(session, plan, fallback)
        except _PartlyOnCpu as exc:
            if plan.strict:
                first = plan.providers[0].name
                raise ProviderUnavailable(
                    f"model {name!r} is strict and part of its graph would run on the CPU, "
                    f"not on provider {first}: {exc}",
                    model=name,
                    provider=first,
                ) from None
            fallback = f"part of the graph runs on the CPU: {exc}"
    session = _session(name, path, threads, plan.providers, cpu_fallback=True, arena=arena)
    return session, _use(session, plan, fallback)


class _PartlyOnCpu(Exception):
    """ONNX Runtime refused a session without the CPU fallback: some graph node needs it."""


def _session(
    name: str,
    path: Path,
    threads: int,
    providers: Sequence[ProviderConfig],
    *,
    cpu_fallback: bool,
    arena: bool = True,
) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.enable_cpu_mem_arena = arena
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3  # errors come back as exceptions; keep stderr quiet
    if not cpu_fallback:
        opts.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    asked = [(p.ort_name, p.ort_options()) for p in providers]
    try:
        return ort.InferenceSession(str(path), sess_options=opts, providers=asked)
    except Exception as exc:  # ORT raises its own exception types for bad files
        text = str(exc)
        if not cpu_fallback and "fallback to CPU EP has been explicitly disabled" in text:
            raise _PartlyOnCpu(text.rsplit(":", 1)[-1].strip()) from None
        raise EngineError(f"model {name!r}: cannot load {path}: {exc}") from None


def _use(session: ort.InferenceSession, plan: SessionPlan, fallback: str) -> ProviderUse:
    return ProviderUse(
        asked=tuple(p.name for p in plan.providers),
        used=short_names(session.get_providers()),
        file=str(plan.path),
        fallback=fallback,
    )


def device_providers() -> DeviceProviders:
    """This machine's ONNX Runtime: the installed build, its version and providers."""
    from importlib import metadata

    installed = [b for b in BUILDS if _installed(metadata, b)]
    return DeviceProviders(
        build="+".join(installed),
        version=ort.__version__,
        providers=short_names(ort.get_available_providers()),
    )


def _installed(metadata: Any, distribution: str) -> bool:
    try:
        metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


def available_providers() -> list[str]:
    """The providers (ONNX Runtime's names) of this machine's ONNX Runtime build."""
    return list(ort.get_available_providers())


class OnnxEngine:
    """An ONNX Runtime session with batching, padding, validation and abort."""

    def __init__(
        self,
        name: str,
        path: Path,
        *,
        threads: int = 1,
        pad_to: Sequence[int] = (),
        plan: SessionPlan | None = None,
    ) -> None:
        plan = plan or SessionPlan(path, (CPU,))
        self._session, self.providers = open_planned(name, plan, threads)
        self.name = name
        self.path = plan.path
        self._pad_to = tuple(sorted(pad_to))
        self._sig = session_signature(self._session)
        self._output_names = [o.name for o in self._sig.outputs]
        self._lock = threading.Lock()
        self._options: ort.RunOptions | None = None  # of the call in progress

    @property
    def signature(self) -> Signature:
        return self._sig

    def check(self, inputs: Mapping[str, Any], max_bytes: int) -> InputInfo:
        return check_inputs(self._sig, self.name, inputs, max_bytes)

    def run(
        self, batch: Sequence[Mapping[str, np.ndarray]], stop: threading.Event | None = None
    ) -> list[dict[str, np.ndarray]]:
        if len(batch) > 1 and not self._sig.batchable:
            raise EngineError(f"model {self.name!r} cannot batch; run its requests one by one")
        if len(batch) == 1 and not self._pad_to:
            return [self._call(batch[0], stop)]
        sizes = [int(b[self._sig.inputs[0].name].shape[0]) for b in batch]
        total = sum(sizes)
        padded = next((p for p in self._pad_to if p >= total), total)
        feed = {}
        for spec in self._sig.inputs:
            parts = [b[spec.name] for b in batch]
            if padded > total:  # repeat the last row: zeros can upset normalisation layers
                parts.append(np.repeat(parts[-1][-1:], padded - total, axis=0))
            feed[spec.name] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        out = self._call(feed, stop)
        results: list[dict[str, np.ndarray]] = []
        start = 0
        for n in sizes:
            results.append({k: v[start : start + n] for k, v in out.items()})
            start += n
        return results

    def _call(
        self, feed: Mapping[str, np.ndarray], stop: threading.Event | None
    ) -> dict[str, np.ndarray]:
        options = ort.RunOptions()
        with self._lock:
            if stop is not None and stop.is_set():
                raise RunAborted(self.name)
            self._options = options
        try:
            values = self._session.run(self._output_names, dict(feed), options)
        except Exception as exc:
            if options.terminate:
                raise RunAborted(self.name) from None
            raise EngineError(f"model {self.name!r} failed: {exc}") from None
        finally:
            with self._lock:
                self._options = None
        return dict(zip(self._output_names, values, strict=True))

    def abort(self) -> None:
        with self._lock:
            if self._options is not None:
                self._options.terminate = True

    def close(self) -> None:
        self.abort()
        del self._session


def session_signature(session: ort.InferenceSession) -> Signature:
    """The inputs and outputs of a loaded model."""
    return Signature(
        tuple(_spec(i) for i in session.get_inputs()),
        tuple(_spec(o) for o in session.get_outputs()),
    )


def _spec(arg: Any) -> TensorSpec:
    dtype = _ORT_TYPES.get(arg.type)
    if dtype is None:
        raise EngineError(f"tensor {arg.name!r} has unsupported type {arg.type}")
    shape = tuple(d if isinstance(d, int) else (d or None) for d in arg.shape)
    return TensorSpec(arg.name, dtype, shape)
