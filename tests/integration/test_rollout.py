"""Rollouts on a real fleet: a model's new version node by node, the refusals before any
node is touched, automatic rollback, and a router killed mid-rollout."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import ray
import yaml

from cluster.client import FleetClient
from edgefleet.config import parse_config
from edgefleet.errors import InvalidInput, ModelNotFound, RolloutRefused
from edgefleet.modelgen import make_classifier, make_slow

pytestmark = pytest.mark.integration

WIDTH = 32
FAIL_ABOVE = 6.0  # v-bad fails a request holding a value above this


def versions(root: Path) -> dict[str, Path]:
    """The model's versions, each in its own folder as a user would ship them."""
    return {
        "v1": make_slow(root / "v1" / "scaler.onnx", layers=2, width=WIDTH, seed=1),
        "v2": make_slow(root / "v2" / "scaler.onnx", layers=2, width=WIDTH, seed=2),
        "bad": make_slow(
            root / "bad" / "scaler.onnx", layers=2, width=WIDTH, seed=3, fail_above=FAIL_ABOVE
        ),
    }


_fleets = itertools.count()


@pytest.fixture
def make_fleet(ray_session, tmp_path):
    """A fleet serving the model at ``path`` (under this test's folder) on ``nodes`` nodes."""
    clients: list[FleetClient] = []

    def make(path: Path, nodes: int = 3, budget_mb: float = 512) -> FleetClient:
        config = {
            "fleet": {"name": f"rollout-{next(_fleets)}"},
            "models": {"scaler": {"path": str(path), "batching": {"window_ms": 1}}},
            "node_defaults": {"memory_budget_mb": budget_mb},
            "nodes": [{"name": f"n{i}"} for i in range(nodes)],
        }
        (tmp_path / f"{config['fleet']['name']}.yaml").write_text(yaml.safe_dump(config))
        clients.append(FleetClient.local(parse_config(config, tmp_path)))
        return clients[-1]

    yield make
    for client in clients:
        client.close()


def expected(path: Path, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(path)).run(None, {"x": x})[0]


class Traffic:
    """Requests in a loop from a thread until stopped: each answer's outcome counted."""

    def __init__(self, fleet, bad_share: float = 0.0) -> None:
        self.fleet, self.bad_share = fleet, bad_share
        self.outcomes: Counter[str] = Counter()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        rng = np.random.default_rng(0)
        i = 0
        while not self._stop.is_set():
            x = rng.uniform(-1, 1, (1, WIDTH)).astype(np.float32)
            if rng.random() < self.bad_share:
                x[0, 0] = 2 * FAIL_ABOVE
            futures = [
                self.fleet.submit("scaler", {"x": x}, request_id=f"t{i}-{k}") for k in range(4)
            ]
            i += 1
            for f in futures:
                reply = f.result(timeout=120)
                kind = "ok" if reply.error is None else type(reply.error).__name__
                self.outcomes[kind] += 1
                if reply.error is not None and len(self.errors) < 5:
                    self.errors.append(str(reply.error))
            time.sleep(0.01)


def digests(fleet, model: str = "scaler") -> dict[str, str]:
    """The version each node serves ("moving" while it moves to another)."""
    return {
        n.name: "moving" if m.moving else m.version
        for n in fleet.status().nodes
        for m in n.models
        if m.name == model
    }


def test_a_rollout_moves_every_node_and_loses_nothing(make_fleet, tmp_path):
    files = versions(tmp_path)
    fleet = make_fleet(files["v1"])
    said: list[str] = []
    with Traffic(fleet) as traffic:
        time.sleep(0.5)
        done = fleet.rollout(
            "scaler",
            files["v2"],
            version="v2",
            canary=1,
            step="50%",
            bake_s=1.0,
            timeout_s=300,
            progress=said.append,
        )
        time.sleep(0.5)
    assert done.phase == "done", (done.why, done.events)
    assert [len(s) for s in done.steps] == [1, 2]
    assert set(digests(fleet).values()) == {"v2"}
    assert traffic.outcomes["ok"] > 50 and set(traffic.outcomes) == {"ok"}, (
        traffic.outcomes,
        traffic.errors,
    )
    x = np.random.default_rng(5).standard_normal((3, WIDTH)).astype(np.float32)
    got = fleet.infer("scaler", {"x": x})["y"]
    np.testing.assert_allclose(got, expected(files["v2"], x), rtol=1e-5, atol=1e-6)
    assert any("bake passed" in s for s in said) and any("done" in s for s in said), said
    # Pinning: one node back on the deployed version, callers pin it by name.
    old = fleet.rollouts()[0].old.name
    fleet.pin("n0", "scaler", old)
    deadline = time.monotonic() + 120
    while digests(fleet)["n0"] != old:
        assert time.monotonic() < deadline, digests(fleet)
        time.sleep(0.2)
    for _ in range(5):
        assert fleet.infer_reply(f"scaler@{old}", {"x": x}).node == "n0"
    np.testing.assert_allclose(
        fleet.infer(f"scaler@{old}", {"x": x})["y"], expected(files["v1"], x), rtol=1e-5, atol=1e-6
    )
    with pytest.raises(RolloutRefused, match="no version 'v9'"):
        fleet.pin("n0", "scaler", "v9")
    with pytest.raises(InvalidInput, match="no node or pool 'n7'"):
        fleet.pin("n7", "scaler", old)


def test_a_version_failing_requests_is_rolled_back_within_its_bake(make_fleet, tmp_path):
    files = versions(tmp_path)
    fleet = make_fleet(files["v1"])
    with Traffic(fleet, bad_share=0.2) as traffic:
        time.sleep(0.5)
        ended = fleet.rollout("scaler", files["bad"], canary=1, step=1, bake_s=120.0, timeout_s=300)
        time.sleep(0.5)
    assert ended.phase == "rolled back", (ended.why, ended.events)
    assert "error_rate<=0.01 failed" in ended.why
    assert ended.ended - ended.started < 120, "rolled back only at the bake's end"
    assert set(digests(fleet).values()) == {ended.old.name}
    # Only requests the canary's new version ran failed; every request was answered.
    assert traffic.outcomes["ok"] > 50
    assert set(traffic.outcomes) <= {"ok", "EngineError"}, traffic.errors


def test_a_version_that_does_not_load_on_the_nodes_is_rolled_back(make_fleet, tmp_path):
    v1 = make_slow(tmp_path / "v1" / "scaler.onnx", layers=2, width=256, seed=1, distinct_weights=1)
    big = make_slow(
        tmp_path / "big" / "scaler.onnx", layers=8, width=256, seed=2, distinct_weights=8
    )
    fleet = make_fleet(v1, nodes=2, budget_mb=2.0)
    ended = fleet.rollout("scaler", big, canary=1, step=1, bake_s=0.5, timeout_s=300)
    assert ended.phase == "rolled back", ended.events
    assert "memory budget" in ended.why, ended.why
    assert "\n" not in ended.why and "did not load again" not in ended.why, ended.why
    assert set(digests(fleet).values()) == {ended.old.name}
    x = np.zeros((1, 256), np.float32)
    assert fleet.infer_reply("scaler", {"x": x}).error is None


def test_a_version_whose_warm_up_fails_leaves_its_node_on_the_old_one(make_fleet, tmp_path):
    files = versions(tmp_path)
    broken = make_slow(  # every call fails, the warm-up's too
        tmp_path / "broken" / "scaler.onnx", layers=2, width=WIDTH, seed=4, fail_above=-1e9
    )
    fleet = make_fleet(files["v1"], nodes=2)
    ended = fleet.rollout("scaler", broken, canary=1, step=1, bake_s=0.5, timeout_s=300)
    assert ended.phase == "rolled back", ended.events
    assert ended.why.endswith("its warm-up failed on inputs the old version ran"), ended.why
    assert set(digests(fleet).values()) == {ended.old.name}
    x = np.zeros((1, WIDTH), np.float32)
    for _ in range(10):
        np.testing.assert_allclose(
            fleet.infer("scaler", {"x": x})["y"], expected(files["v1"], x), rtol=1e-5, atol=1e-6
        )


def test_refusals_touch_no_node(make_fleet, tmp_path):
    files = versions(tmp_path)
    fleet = make_fleet(files["v1"], nodes=2)
    before = digests(fleet)
    not_onnx = tmp_path / "junk" / "scaler.onnx"
    not_onnx.parent.mkdir()
    not_onnx.write_bytes(b"not a model")
    with pytest.raises(RolloutRefused, match="not an ONNX model"):
        fleet.rollout("scaler", not_onnx)
    unloadable = tmp_path / "unloadable" / "scaler.onnx"  # ONNX, with an op nobody has
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Scale", ["x"], ["y"], domain="com.example")],
        "unloadable",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", WIDTH])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", WIDTH])],
    )
    opsets = [onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("com.example", 1)]
    unloadable.parent.mkdir()
    onnx.save(onnx.helper.make_model(graph, opset_imports=opsets), str(unloadable))
    with pytest.raises(RolloutRefused, match="refused: model 'scaler'.*Scale"):
        fleet.rollout("scaler", unloadable)
    other = make_classifier(tmp_path / "other" / "classifier.onnx")
    with pytest.raises(RolloutRefused, match="other inputs or outputs"):
        fleet.rollout("scaler", other)
    with pytest.raises(ModelNotFound, match="'nope'"):
        fleet.rollout("nope", files["v2"])
    with pytest.raises(RolloutRefused, match="already serves these files"):
        fleet.rollout("scaler", files["v1"])
    with pytest.raises(InvalidInput, match="gate"):
        fleet.rollout("scaler", files["v2"], gates="latency<=2x")
    assert digests(fleet) == before and fleet.rollouts() == []
    # One rollout of a model at a time; an abort moves the moved nodes back.
    fleet.rollout("scaler", files["v2"], canary=1, bake_s=600, wait=False)
    with pytest.raises(RolloutRefused, match="is running"):
        fleet.rollout("scaler", files["bad"])
    deadline = time.monotonic() + 120
    while fleet.rollouts()[0].phase != "baking":
        assert time.monotonic() < deadline, fleet.rollouts()[0].events
        time.sleep(0.2)
    (running,) = fleet.status().rollouts
    assert running.startswith("scaler @") and ": baking, step 1/2, 1/2 node(s) on @" in running
    fleet.abort_rollout("scaler")
    ended = fleet.wait_rollout("scaler", timeout_s=120)
    assert ended.phase == "aborted" and digests(fleet) == before


def test_a_router_killed_mid_rollout_carries_it_on(make_fleet, tmp_path):
    from cluster.deploy import NAMESPACE, router_name

    files = versions(tmp_path)
    fleet = make_fleet(files["v1"], nodes=2)
    fleet.rollout("scaler", files["v2"], version="v2", canary=1, step=1, bake_s=3.0, wait=False)
    deadline = time.monotonic() + 120
    while fleet.rollouts()[0].phase != "baking":
        assert time.monotonic() < deadline, fleet.rollouts()[0].events
        time.sleep(0.1)
    router = ray.get_actor(router_name(fleet.config.fleet.name), namespace=NAMESPACE)
    ray.kill(router, no_restart=False)  # Ray starts it again; it reads the rollout back
    ended = fleet.wait_rollout("scaler", timeout_s=300)
    assert ended.phase == "done", ended.events
    assert any("router restarted" in e for e in ended.events), ended.events
    assert set(digests(fleet).values()) == {"v2"}


def test_the_rollout_command(make_fleet, tmp_path, cli_on_ray):
    files = versions(tmp_path)
    fleet = make_fleet(files["v1"], nodes=2)
    name = fleet.config.fleet.name
    config = tmp_path / f"{name}.yaml"
    ran = cli_on_ray(
        "rollout", str(config), "scaler", "--to", str(files["v2"]), "--version", "v2",
        "--canary", "1", "--step", "1", "--bake", "0.5",
    )  # fmt: skip
    assert ran.returncode == 0, ran
    assert "step 1/2: moving n0" in ran.stdout and "done: every node serves @v2" in ran.stdout
    ran = cli_on_ray("rollout", "status", "--fleet", name)
    assert ran.returncode == 0 and "scaler @" in ran.stdout and "-> @v2: done" in ran.stdout
    old = fleet.rollouts()[0].old.name
    ran = cli_on_ray("rollout", "pin", "n1", f"scaler@{old}", "--fleet", name)
    assert ran.returncode == 0 and f"n1 serves scaler@{old}" in ran.stdout, ran
    assert cli_on_ray("rollout", "unpin", "n1", "scaler", "--fleet", name).returncode == 0
    ran = cli_on_ray("rollout", "pin", "n1", "scaler", "--fleet", name)
    assert ran.returncode == 2 and "give MODEL@VERSION" in ran.stderr
    ran = cli_on_ray("rollout", "abort", "scaler", "--fleet", name)
    assert ran.returncode == 2 and "no rollout of scaler is running" in ran.stderr
    ran = cli_on_ray("rollout", str(config), "scaler", "--to", str(files["v2"]), "--gate", "p99")
    assert ran.returncode == 2 and "METRIC<=LIMIT" in ran.stderr
