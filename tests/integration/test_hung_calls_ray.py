"""A real node on Ray with a real ONNX model that loops for as long as asked: a call
past its max_call_s is terminated, answered with EngineTimeout, and the node serves on."""

from __future__ import annotations

import numpy as np
import pytest

from cluster.client import FleetClient
from edgefleet.errors import EngineTimeout
from edgefleet.modelgen import make_spin, random_inputs

pytestmark = pytest.mark.integration


def test_a_call_that_loops_is_terminated_past_max_call_s_and_the_node_serves_on(
    make_fleet, models_dir
):
    make_spin(models_dir / "spin.onnx")
    fleet = make_fleet(
        {
            "local": {"nodes": 1},
            "models": {
                "spin": {"path": "spin.onnx", "max_call_s": 1.0},
                "classifier": {"path": "classifier.onnx"},
            },
        }
    )
    x = np.ones((1, 4), np.float32)
    forever = {"x": x, "steps": np.array(10**15, np.int64)}  # years of steps
    (looped,) = FleetClient.gather([fleet.submit("spin", forever)], 120)
    assert isinstance(looped.error, EngineTimeout), looped.error
    assert "max_call_s of 1 s" in str(looped.error) and "models.spin.max_call_s" in str(
        looped.error
    )
    # The same node, at once: another model, and the same model asked for a few steps.
    refs = [
        fleet.submit("classifier", random_inputs("classifier")),
        fleet.submit("spin", {"x": x, "steps": np.array(3, np.int64)}),
    ]
    classified, spun = FleetClient.gather(refs, 120)
    assert classified.unwrap()["logits"].shape == (1, 10)
    np.testing.assert_allclose(spun.unwrap()["y"], np.tanh(np.tanh(np.tanh(x))), rtol=1e-6)
    (node,) = fleet.status().nodes
    assert node.state == "serving" and node.counters["failed"] == 1
