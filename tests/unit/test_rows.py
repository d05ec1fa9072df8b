"""Rows on the batch axis: the node counts them (it is the authority), and the caller
that prices a request and the simulated node count them the same way."""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from actors.engine import Signature, TensorSpec, check_inputs
from cluster.dispatch import Dispatcher, FleetView, FutureCalls, NodeReport
from edgefleet.clock import FakeClock
from edgefleet.config import parse_config
from edgefleet.messages import ModelStatus, NodeStatus, Reply
from edgefleet.request import InferRequest
from sim.fleet import EventLoop, ModelCost, SimNode
from tests.fakes import fake_spec

F32 = np.dtype(np.float32)
ROW_MS = 2.0

# (the model's inputs as name -> shape, the inputs sent as name -> shape)
CASES = {
    "batch axis and more": ({"x": ("N", 4)}, {"x": (3, 4)}),
    "batch axis only": ({"x": ("N",)}, {"x": (5,)}),
    "two inputs, one of rank 1": ({"a": ("N", 4), "b": ("N",)}, {"a": (2, 4), "b": (2,)}),
    "rank 1 second": ({"b": ("N",), "a": ("N", 4)}, {"b": (6,), "a": (6, 4)}),
    "no batch axis": ({"x": (4,)}, {"x": (4,)}),
    "fixed axis 0": ({"x": (1, 4)}, {"x": (1, 4)}),
    "state apart from the batch": (
        {"state": (2, 1, 16), "x": (None,)},
        {"state": (2, 1, 16), "x": (7,)},
    ),
}


def signature(specs: dict[str, tuple[Any, ...]]) -> Signature:
    tensors = tuple(TensorSpec(name, F32, shape) for name, shape in specs.items())
    return Signature(tensors, tensors)


def arrays(shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    return {name: np.ones(shape, F32) for name, shape in shapes.items()}


class HeldNode(FutureCalls):
    """Takes each request and never answers (the test reads the caller's view)."""

    def infer(self, request: InferRequest, inputs: Any = None) -> cf.Future[Reply]:
        return cf.Future()


def caller_rows(sig: Signature, inputs: dict[str, np.ndarray]) -> int:
    """The rows a caller prices the request at, on a report of the model's node."""
    config = parse_config(
        {
            "fleet": {"name": "t"},
            "models": {"m": {"path": "m.onnx", "warmup": False}},
            "nodes": [{"name": "a"}],
            "router": {"placement": {"shed": {}}},
        },
        Path("/nonexistent"),
    )
    d = Dispatcher(config, {"a": HeldNode()}, clock=FakeClock())
    model = ModelStatus("m", True, sig.batchable, 8, {1: ROW_MS}, None, 1)
    status = NodeStatus("a", "serving", {}, 0, None, (model,))
    d.update(FleetView({"a": NodeReport(status, True, 0.0)}))
    d.submit(InferRequest("m", inputs, priority=10))
    (view,) = d.views()
    d.close()
    return round(view.backlog_s[10] / (ROW_MS / 1000))


def simulated_rows(inputs: dict[str, np.ndarray]) -> int:
    """The rows a simulated node takes the request as (its tensor models batch)."""
    node = SimNode(EventLoop(), fake_spec(), {"m": ModelCost({1: 1.0})}, lambda *a: None)
    node.receive(InferRequest("m", inputs, priority=10))
    status = node.status(0.0)
    running = status.running.rows if status.running is not None else 0
    return running + sum(n for by_model in status.queued_rows.values() for n in by_model.values())


@pytest.mark.parametrize("case", CASES)
def test_the_caller_and_the_simulator_count_rows_as_the_node_does(case):
    specs, shapes = CASES[case]
    sig, inputs = signature(specs), arrays(shapes)
    node = check_inputs(sig, "m", inputs, 1 << 30).rows
    assert caller_rows(sig, inputs) == node
    if sig.batchable:  # a simulated node runs every tensor model as one that batches
        assert simulated_rows(inputs) == node
