"""A device with another ONNX Runtime build: a raylet whose Python has
``onnxruntime-openvino`` (the virtual environment ``.ci/run`` makes, ``.venv-openvino``)
joins a cluster whose head has the plain CPU build. The node placed there with
``providers: [openvino, cpu]`` runs the model on OpenVINO, as its session says (not
its config), and answers what the CPU node answers, within float tolerance."""

from __future__ import annotations

import os
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from cluster.client import FleetClient
from cluster.raylet import head_and_device
from edgefleet.config import parse_config
from edgefleet.modelgen import random_inputs

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
OPENVINO_PYTHON = Path(
    os.environ.get("EDGEFLEET_OPENVINO_PYTHON", REPO / ".venv-openvino" / "bin" / "python")
)
JOIN_S = 180.0  # a raylet started and joined on a busy machine
ANSWER_S = 120.0
TOLERANCE = 1e-4  # measured: within 5e-7 of the CPU provider's outputs


def _openvino_build() -> str | None:
    """Why the OpenVINO environment cannot be used, or None when it can."""
    if not OPENVINO_PYTHON.is_file():
        return f"no {OPENVINO_PYTHON}: .ci/run makes it (pip install onnxruntime-openvino)"
    probe = subprocess.run(
        [str(OPENVINO_PYTHON), "-c", "import onnxruntime as o; print(o.get_available_providers())"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "OpenVINOExecutionProvider" not in probe.stdout:
        return f"{OPENVINO_PYTHON} has no OpenVINO provider: {probe.stdout}{probe.stderr[-500:]}"
    return None


@pytest.fixture(scope="module")
def mixed_fleet(models_dir):
    why = _openvino_build()
    if why is not None:
        pytest.skip(why)
    with head_and_device(
        OPENVINO_PYTHON, head_labels={"accel": "cpu"}, device_labels={"accel": "openvino"}
    ):
        config = parse_config(
            {
                "fleet": {"name": "mixed"},
                "models": {"detector": {"path": "detector.onnx"}},
                "nodes": [
                    {"name": "cpu-0", "labels": {"accel": "cpu"}},
                    {
                        "name": "ov-0",
                        "labels": {"accel": "openvino"},
                        "providers": [{"name": "openvino", "options": {"device_type": "CPU"}}],
                    },
                ],
                "router": {"resources": {"head": 0.5}},
            },
            models_dir,
        )
        client = FleetClient.local(config)
        try:
            yield client
        finally:
            client.close()


def test_a_node_on_an_openvino_device_runs_its_model_on_openvino(mixed_fleet):
    status = {n.name: n for n in mixed_fleet.status().nodes}
    ov, cpu = status["ov-0"], status["cpu-0"]
    assert "onnxruntime-openvino" in ov.device.build.split("+"), ov.device
    assert "openvino" in ov.device.providers
    assert cpu.device.build == "onnxruntime" and "openvino" not in cpu.device.providers
    (model,) = ov.models
    assert model.providers.used[0] == "openvino", model.providers  # the session's own
    assert model.providers.fallback == ""
    (model,) = cpu.models
    assert model.providers.used == ("cpu",)


def test_the_openvino_node_answers_as_the_cpu_node_does(mixed_fleet):
    inputs = random_inputs("detector", 2, seed=3)
    by_node: dict[str, list[dict[str, np.ndarray]]] = defaultdict(list)
    deadline = time.monotonic() + ANSWER_S
    while len(by_node) < 2 and time.monotonic() < deadline:
        futures = [mixed_fleet.submit("detector", inputs, timeout_s=ANSWER_S) for _ in range(8)]
        for future in futures:
            reply = future.result(ANSWER_S + 30)
            assert reply.error is None, reply.error
            by_node[reply.node].append(reply.outputs)
    assert set(by_node) == {"cpu-0", "ov-0"}, f"only {sorted(by_node)} answered"
    reference = by_node["cpu-0"][0]
    for outputs in by_node["ov-0"]:
        assert outputs.keys() == reference.keys()
        for name, value in outputs.items():
            np.testing.assert_allclose(value, reference[name], atol=TOLERANCE, rtol=TOLERANCE)
