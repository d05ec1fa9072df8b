"""A fake engine with scripted costs and a call log, for node tests without ONNX Runtime."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from actors.engine import InputInfo, RunAborted, Signature, TensorSpec, check_inputs
from edgefleet.config import ModelConfig, NodeSpec, PreemptionConfig, QueueConfig
from edgefleet.errors import EngineError

F32 = np.dtype(np.float32)


class FakeEngine:
    """Doubles its input ``x``. A row whose first value is negative makes the call fail.

    ``cost_s`` is real time spent per call (waiting on the call's stop event, so an
    abort ends it at once); keep it small.
    """

    def __init__(self, name: str, *, batchable: bool = True, cost_s: float = 0.0) -> None:
        self.name = name
        shape: tuple[int | str | None, ...] = ("N", 4) if batchable else (4,)
        self._sig = Signature((TensorSpec("x", F32, shape),), (TensorSpec("y", F32, shape),))
        self.cost_s = cost_s
        self.calls: list[int] = []  # rows per call
        self.closed = False

    @property
    def signature(self) -> Signature:
        return self._sig

    def check(self, inputs: Mapping[str, Any], max_bytes: int) -> InputInfo:
        return check_inputs(self._sig, self.name, inputs, max_bytes)

    def run(
        self, batch: Sequence[Mapping[str, np.ndarray]], stop: threading.Event | None = None
    ) -> list[dict[str, np.ndarray]]:
        stop = stop or threading.Event()
        if stop.is_set() or (self.cost_s and stop.wait(self.cost_s)):
            raise RunAborted(self.name)
        x = [b["x"] for b in batch]
        self.calls.append(sum(a.shape[0] if a.ndim == 2 else 1 for a in x))
        if any(float(a.reshape(-1)[0]) < 0 for a in x):
            raise EngineError("negative input")
        return [{"y": a * 2} for a in x]

    def abort(self) -> None:
        pass  # the node sets the call's stop event, which ends the scripted wait

    def close(self) -> None:
        self.closed = True


def fake_spec(
    models: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    capacity: int = 64,
    budget_mb: float = 1000,
    gap: int = 5,
    order: str = "priority",
) -> NodeSpec:
    models = models or {"m": {}}
    return NodeSpec(
        name="fake-0",
        models={
            name: ModelConfig.model_validate(
                {"path": Path(f"/nonexistent/{name}.onnx"), "warmup": False, **m}
            )
            for name, m in models.items()
        },
        priorities={"foreground": 10, "inline": 7, "background": 3, "offline": 0},
        queue=QueueConfig(capacity=capacity),
        preemption=PreemptionConfig(min_priority_gap=gap),
        memory_budget_mb=budget_mb,
        order=order,  # type: ignore[arg-type]
    )


class FakeLoader:
    """Builds FakeEngines and remembers them, so tests can script and inspect them."""

    def __init__(self, **engine_kw: Any) -> None:
        self.engines: dict[str, FakeEngine] = {}
        self.loads: list[str] = []
        self._kw = engine_kw

    def __call__(self, name: str, config: ModelConfig) -> FakeEngine:
        self.loads.append(name)
        engine = FakeEngine(name, **self._kw.get(name, {}))
        self.engines[name] = engine
        return engine


def x(value: float, rows: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.full((rows, 4), value, dtype=np.float32)}
