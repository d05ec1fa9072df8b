"""The router's rollouts on scripted nodes: steps, gates, rollback, a node Ray restarted on
the old version, pins, and a restarted router carrying a rollout on."""

from __future__ import annotations

import asyncio
import bisect
import pickle
from pathlib import Path
from typing import Any

from cluster.rollout import Version, Versions
from cluster.router import Router
from edgefleet.artifacts import ArtifactFile, ModelArtifact
from edgefleet.config import ModelConfig, parse_config
from edgefleet.errors import VersionFailed
from edgefleet.messages import SERVICE_BUCKETS, ModelStatus, NodeState, NodeStatus
from tests.fakes import fake_spec

NODES = ["n0", "n1", "n2", "n3"]


def artifact(version: str) -> ModelArtifact:
    digest = version.ljust(64, "0")
    return ModelArtifact("m", digest, (ArtifactFile("m.onnx", digest, 10),), "m.onnx", {}, version)


def version(name: str) -> Version:
    return Version(ModelConfig(path=Path(f"/models/{name}/m.onnx")), artifact(name))


def config(names: list[str] = NODES) -> Any:
    cfg = parse_config(
        {
            "fleet": {"name": "t"},
            "models": {"m": {"path": "m.onnx", "warmup": False, "memory_mb": 1}},
            "nodes": [{"name": n} for n in names],
            "router": {"report_interval_s": 0.02, "lost_after_s": 5},
        },
        Path("/models/v1"),
    )
    return cfg.with_artifacts({"m": artifact("v1")}, "t/store")


class Node:
    """A node as the router sees it: serves one version of ``m``; requests it served are
    counted by ``serve`` (those of a ``failing`` version fail; a ``slow`` one takes
    40 ms where others take 4 ms)."""

    failing: set[str] = set()
    slow: set[str] = set()

    def __init__(self, name: str) -> None:
        self.name, self.version = name, "v1"
        self.failed = 0
        self.buckets = [0] * (len(SERVICE_BUCKETS) + 1)
        self.refuse: set[str] = set()  # versions that do not load here
        self.state = NodeState.SERVING
        self.moves: list[str] = []

    def serve(self, n: int) -> None:
        for i in range(n):
            if self.version in self.failing and i % 5 == 0:
                self.failed += 1
            else:
                latency = 0.04 if self.version in self.slow else 0.004
                self.buckets[bisect.bisect_left(SERVICE_BUCKETS, latency)] += 1

    async def status(self) -> NodeStatus:
        total, cumulative = 0, []
        for c in self.buckets:
            total += c
            cumulative.append(total)
        model = ModelStatus(
            "m", True, True, 1, {}, None, 1, version=self.version,
            digest=artifact(self.version).digest, failed=self.failed, service=tuple(cumulative),
        )  # fmt: skip
        return NodeStatus(self.name, self.state, {}, 0, None, (model,))

    async def start(self) -> NodeStatus:
        return await self.status()

    async def set_version(
        self, model: str, config: ModelConfig, artifact: ModelArtifact, drain_s: float
    ) -> NodeStatus:
        await asyncio.sleep(0.01)
        if artifact.version in self.refuse:
            raise VersionFailed(f"node {self.name}: {model}@{artifact.version} did not load")
        self.version = artifact.version
        self.moves.append(artifact.version)
        return await self.status()


class Store:
    """The fleet's store as rollouts use it: state kept as bytes, as on its disk."""

    def __init__(self) -> None:
        self.kept: dict[str, bytes] = {}
        store = self

        class Method:
            def __init__(self, fn: Any) -> None:
                self.fn = fn

            def remote(self, *args: Any) -> Any:
                async def call() -> Any:
                    return self.fn(*args)

                return call()

        self.save_state = Method(lambda k, v, keep: store.kept.__setitem__(k, pickle.dumps(v)))
        self.load_state = Method(lambda k: pickle.loads(store.kept[k]) if k in store.kept else None)


async def traffic(nodes: dict[str, Node], stop: asyncio.Event) -> None:
    while not stop.is_set():
        for node in nodes.values():
            node.serve(5)
        await asyncio.sleep(0.01)


def run(main: Any) -> Any:
    return asyncio.run(asyncio.wait_for(main(), 60))


async def until(cond: Any, timeout: float = 20.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < end, "condition not met in time"
        await asyncio.sleep(0.01)


async def fleet(store: Store | None = None) -> tuple[Router, dict[str, Node], asyncio.Event]:
    nodes = {n: Node(n) for n in NODES}
    router = Router(config(), nodes, store=store)
    await router.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().create_task(traffic(nodes, stop))
    return router, nodes, stop


async def ended(router: Router) -> Any:
    await until(lambda: not router.rollouts.status()[0].active)
    return router.rollouts.status()[0]


def test_a_rollout_moves_the_canary_then_steps_and_a_restarted_node_follows():
    async def main() -> None:
        router, nodes, stop = await fleet()
        r = await router.rollout("m", version("v2"), 1, 0.5, 0.05, "error_rate<=0.01,p99<=1.5x")
        assert r.steps == (("n0",), ("n1", "n2"), ("n3",))
        r = await ended(router)
        assert r.phase == "done", r.events
        assert {n.version for n in nodes.values()} == {"v2"}
        assert router.status_now().router["version_changes"] == 4
        nodes["n2"].version = "v1"  # Ray restarted it: it starts on the deployed version
        await until(lambda: nodes["n2"].version == "v2")
        stop.set()
        await router.stop()

    run(main)


def test_a_drained_node_is_not_waited_for_and_moves_when_it_serves_again():
    async def main() -> None:
        router, nodes, stop = await fleet()
        nodes["n1"].state = NodeState.DRAINED  # healthy, but takes no work
        await router.rollout("m", version("v2"), 1, 1, 0.05, "error_rate<=0.01")
        r = await ended(router)
        assert r.phase == "done", r.events
        assert nodes["n1"].version == "v1" and nodes["n3"].version == "v2"
        nodes["n1"].state = NodeState.SERVING
        await until(lambda: nodes["n1"].version == "v2")
        stop.set()
        await router.stop()

    run(main)


def test_a_failing_version_is_rolled_back_within_its_bake():
    async def main() -> None:
        Node.failing = {"bad"}
        try:
            router, nodes, stop = await fleet()
            await router.rollout("m", version("bad"), 1, 1, 30.0, "error_rate<=0.01")
            r = await ended(router)
        finally:
            Node.failing = set()
        assert r.phase == "rolled back" and "error_rate<=0.01 failed" in r.why, r.events
        assert r.ended - r.started < 30
        assert {n.version for n in nodes.values()} == {"v1"}
        assert nodes["n0"].moves == ["bad", "v1"] and nodes["n1"].moves == []
        stop.set()
        await router.stop()

    run(main)


def test_a_slow_version_fails_its_relative_p99_gate():
    async def main() -> None:
        Node.slow = {"slow"}
        try:
            router, nodes, stop = await fleet()
            await router.rollout("m", version("slow"), 2, 1, 30.0, "p99<=1.5x")
            r = await ended(router)
        finally:
            Node.slow = set()
        assert r.phase == "rolled back" and "p99<=1.5x failed" in r.why, r.events
        assert {n.version for n in nodes.values()} == {"v1"}
        stop.set()
        await router.stop()

    run(main)


def test_a_version_that_does_not_load_rolls_back_the_nodes_moved_before():
    async def main() -> None:
        router, nodes, stop = await fleet()
        nodes["n2"].refuse.add("v2")
        await router.rollout("m", version("v2"), 1, 2, 0.05, "error_rate<=0.01")
        r = await ended(router)
        assert r.phase == "rolled back" and "n2: m@v2 did not load" in r.why, r.events
        assert {n.version for n in nodes.values()} == {"v1"}
        assert nodes["n0"].moves == ["v2", "v1"] and nodes["n1"].moves == ["v2", "v1"]
        stop.set()
        await router.stop()

    run(main)


def test_a_restarted_router_carries_the_rollout_on_from_the_store():
    async def main() -> None:
        store = Store()
        router, nodes, stop = await fleet(store)
        await router.rollout("m", version("v2"), 1, 1, 5.0, "error_rate<=0.01")
        await until(lambda: router.rollouts.status()[0].phase == "baking")
        await router.stop()
        for task in [t for t in asyncio.all_tasks() if t.get_name().startswith("rollout-")]:
            task.cancel()  # the router's process died
        again = Router(config(), nodes, store=store)
        await again.start()
        r = again.rollouts.status()[0]
        assert r.active and any("router restarted" in e for e in r.events)
        r.bake_s = 0.05  # (the kept bake starts again)
        r = await ended(again)
        assert r.phase == "done" and {n.version for n in nodes.values()} == {"v2"}
        stop.set()
        await again.stop()

    run(main)


def test_a_pinned_node_serves_its_version_and_the_deployed_one_once_unpinned():
    async def main() -> None:
        router, nodes, stop = await fleet()
        await router.rollout("m", version("v2"), 1, 1, 30.0, "error_rate<=0.01")
        await router.rollouts.abort("m")  # v2 is known now, and no node serves it
        await ended(router)
        await router.rollouts.pin("n1", "m", "v2")
        await until(lambda: nodes["n1"].version == "v2")
        await router.rollouts.pin("n1", "m", None)
        await until(lambda: nodes["n1"].version == "v1")
        assert {n.version for n in nodes.values()} == {"v1"}
        stop.set()
        await router.stop()

    run(main)


def test_pins_of_a_node_win_over_its_pool_and_rollouts():
    versions = Versions(current={"m": version("v2")})
    spec = fake_spec().model_copy(update={"name": "cams/d1", "pool": "cams"})
    assert versions.wanted(spec, "m").name == "v2"
    versions.pins["cams"] = {"m": version("v3")}
    assert versions.wanted(spec, "m").name == "v3"
    versions.pins["cams/d1"] = {"m": version("v1")}
    assert versions.wanted(spec, "m").name == "v1"
    assert versions.wanted(spec, "other") is None


def test_a_node_whose_new_version_does_not_load_serves_the_old_one_again():
    from actors.models import ModelManager
    from tests.fakes import FakeLoader

    listed: list[list[str]] = []  # the models status lists while a version loads

    class Loader(FakeLoader):
        def __call__(self, name: str, config: ModelConfig) -> Any:
            listed.append([i.name for i in manager.models()])
            if "broken" in str(config.path):
                raise VersionFailed("not an ONNX file")  # what a failed load raises
            return super().__call__(name, config)

    loader = Loader()
    old = ModelConfig(path=Path("/models/v1/m.onnx"), warmup=False)
    manager = ModelManager({"m": old}, 100, loader)
    manager.probe_all()
    listed.clear()
    try:
        manager.replace("m", ModelConfig(path=Path("/models/broken/m.onnx"), warmup=False))
    except VersionFailed as exc:
        assert "the new version failed: not an ONNX file" in str(exc)
    else:
        raise AssertionError("the broken version loaded")
    assert manager.info("m").config == old and manager.resident("m") is not None
    assert loader.engines["m"].closed is False and loader.loads == ["m", "m"]
    new = ModelConfig(path=Path("/models/v2/m.onnx"), warmup=False)
    assert manager.replace("m", new).config == new and manager.info("m").config == new
    assert listed == [["m"]] * 3  # listed throughout (status shows it moving)
