"""Fleets on a real multi-raylet Ray cluster (all on loopback), one cluster for the
module: a fleet with one raylet per edge node (placement by priority, spill, reject,
shed, node loss and rejoin), then a pool whose membership follows the Ray nodes that
carry its labels as they join, die and come back.

The head has short health checks (a killed raylet is declared dead in about 10 s).
Each part adds the raylets it uses and removes them after; its tests run in order on
them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster

from cluster.client import FleetClient
from cluster.deploy import (
    LOOPBACK,
    NAMESPACE,
    actor_name,
    pin_loopback,
    pool_member_handles,
    use_auth_mode,
)
from cluster.names import node_actor_name
from edgefleet.artifacts import sha256_file
from edgefleet.config import parse_config
from edgefleet.errors import Rejected
from edgefleet.labels import DEVICE_LABEL
from edgefleet.modelgen import calibrate_slow, random_inputs

pytestmark = pytest.mark.integration

NODES = ["edge-0", "edge-1", "edge-2"]
DEVICES = ["cam-0", "cam-1", "cam-2"]
JOIN_S = 180.0  # a raylet up, reported ALIVE, its node actor started and its model loaded
# The head declares a killed raylet (its port refuses at once) dead in about 10 s, not
# Ray's 15-60; a raylet slow to answer on a busy machine has about 30 s (10 checks 2 s
# long, a second apart) before it is taken for dead. With 3 checks of 1 s, a raylet busy
# starting workers under heavy load was declared dead and its actors cancelled.
HEALTH = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 2000,
    "health_check_failure_threshold": 10,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def wait_until(what: str, check: Callable[[], Any], timeout_s: float) -> Any:
    """``check()``'s first truthy result, asked every half second."""
    end = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def ray_cluster(models_dir):
    """The module's Ray head (no raylet of its own for the fleets' nodes), connected."""
    pin_loopback()
    use_auth_mode(token=True)  # as the session's Ray: one process cannot switch modes
    if ray.is_initialized():
        ray.shutdown()  # this module runs its own cluster; others restart the shared one
    calibrate_slow(models_dir / "slow25.onnx", 25.0)
    calibrate_slow(models_dir / "slow10.onnx", 10.0)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"head": 1},
            "node_ip_address": LOOPBACK,
            "include_dashboard": False,
            "dashboard_agent_listen_port": free_port(),  # not Ray's fixed one: shared machine
            "_system_config": HEALTH,
        },
    )
    try:
        cluster.connect(namespace=NAMESPACE)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _remove_raylets(cluster: Cluster, raylets: dict[str, Any]) -> None:
    """A part's raylets, stopped as `ray stop` stops them (not killed: the next part's
    raylets start meanwhile, and the head takes a killed one's absence in a few checks)."""
    for raylet in raylets.values():
        with contextlib.suppress(Exception):
            cluster.remove_node(raylet, allow_graceful=True)
    raylets.clear()


# --- a fleet with a raylet per node ---------------------------------------------------


@pytest.fixture(scope="class")
def cluster_fleet(ray_cluster, models_dir):
    cluster = ray_cluster
    raylets = {
        name: cluster.add_node(
            num_cpus=1, resources={name: 1}, labels={"device": name}, node_ip_address=LOOPBACK
        )
        for name in NODES
    }
    client = None
    try:
        cluster.wait_for_nodes()
        config = parse_config(
            {
                "fleet": {"name": "cluster"},
                "models": {"slow25": {"path": "slow25.onnx"}, "slow": {"path": "slow.onnx"}},
                "node_defaults": {"queue": {"capacity": 16}},
                # edge-2 finds its machine by a node label, the others by a custom resource.
                "nodes": [
                    {"name": "edge-0", "resources": {"edge-0": 0.5}},
                    {"name": "edge-1", "resources": {"edge-1": 0.5}},
                    {"name": "edge-2", "labels": {"device": "edge-2"}},
                ],
                "router": {
                    "resources": {"head": 0.5},
                    "report_interval_s": 0.2,
                    "lost_after_s": 2.0,
                    "restart_after_s": 10.0,
                    "placement": {"shed": {"background": 0.75}},
                },
            },
            models_dir,
        )
        client = FleetClient.local(config)
        yield cluster, raylets, client
    finally:
        if client is not None:
            client.close()
        _remove_raylets(cluster, raylets)


def node_actor(name):
    return ray.get_actor(actor_name("cluster", name), namespace=NAMESPACE)


def wait_idle(client, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        status = client.status()
        if all(n.queue_length == 0 and n.running is None for n in status.nodes):
            return status
        time.sleep(0.1)
    raise AssertionError("fleet did not go idle")


def _signal(pid, sig):
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _serves(client, node, timeout=120.0):
    """Wait until ``node`` is in service again and answers a request placed on it."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if client.status().healthy.get(node):
            replies = FleetClient.gather(
                [client.submit("slow25", random_inputs("slow")) for _ in range(30)], 120
            )
            if any(r.node == node and r.error is None for r in replies):
                return
        time.sleep(0.5)
    raise AssertionError(f"{node} does not serve again")


class TestFleet:
    """The tests run in order on one fleet: the last ones lose a node and bring it back."""

    def test_nodes_are_on_their_own_raylets(self, cluster_fleet):
        _, raylets, client = cluster_fleet
        status = client.status()
        assert sorted(n.name for n in status.nodes) == NODES
        assert all(status.healthy.values())
        for name, raylet in raylets.items():
            where = node_actor(name).__ray_call__.remote(
                lambda _: ray.get_runtime_context().get_node_id()
            )
            assert ray.get(where, timeout=30) == raylet.node_id, name

    def test_foreground_goes_where_least_higher_priority_work_waits(self, cluster_fleet):
        from edgefleet.request import InferRequest

        _, _, fleet = cluster_fleet
        # A caller that counts only the work ahead at a request's priority and picks the
        # best: the decision under test, without the default's share of overtaken work or
        # its random choice among near-best nodes (unit tests cover those).
        client = fleet.with_placement(lower_share=0.0, picker="best")
        feed = random_inputs("slow")
        rows8 = {k: np.repeat(v, 8, axis=0) for k, v in feed.items()}  # 8 rows: a call 8x longer
        # edge-0: a long queue, all background; edge-1/2: a few foreground requests. Each
        # holds its node about 0.2 s: the scene lasts while a busy machine delivers the calls.
        sent = [
            node_actor("edge-0").infer.remote(InferRequest("slow25", rows8, 3)) for _ in range(16)
        ]
        for name in ("edge-1", "edge-2"):
            sent += [
                node_actor(name).infer.remote(InferRequest("slow25", rows8, 10)) for _ in range(6)
            ]
        try:
            deadline = time.monotonic() + 30
            while True:  # status() refreshes the reports the client places on
                queues = {n.name: n.queue_length for n in client.status().nodes}
                if queues["edge-0"] >= 12 and queues["edge-1"] >= 3 and queues["edge-2"] >= 3:
                    break
                assert time.monotonic() < deadline, f"scene not set up: {queues}"
                time.sleep(0.01)
            fg = client.infer_reply("slow25", feed, priority="foreground")
            assert fg.error is None and fg.node == "edge-0", fg.node
            bg = client.infer_reply("slow25", feed, priority="background")
            assert bg.error is None and bg.node in ("edge-1", "edge-2"), bg.node
            assert all(r.error is None for r in ray.get(sent, timeout=60))
        finally:
            client.close()
        wait_idle(fleet)

    def test_full_nodes_spill_then_reject_with_retry_after(self, cluster_fleet):
        _, _, client = cluster_fleet
        before = client.status().router.get("spilled", 0)
        feed = random_inputs("slow")
        refs = [client.submit("slow25", feed, priority="foreground") for _ in range(120)]
        replies = FleetClient.gather(refs, 120)
        kinds = Counter("ok" if r.error is None else type(r.error).__name__ for r in replies)
        assert set(kinds) == {"ok", "Rejected"}, kinds
        assert kinds["ok"] >= 3 * 16  # every queue was used before anyone was refused
        rejected = [r.error for r in replies if isinstance(r.error, Rejected)]
        assert all("every node refused" in str(e) and e.retry_after_s > 0 for e in rejected)
        assert client.status().router["spilled"] > before
        assert Counter(r.node for r in replies if r.error is None).keys() == set(NODES)
        wait_idle(client)

    def test_background_is_shed_before_foreground(self, cluster_fleet):
        _, _, client = cluster_fleet
        feed = random_inputs("slow")
        bg = [client.submit("slow25", feed, priority="background") for _ in range(60)]
        time.sleep(0.3)
        fg = [client.submit("slow25", feed, priority="foreground") for _ in range(6)]
        fg_replies = FleetClient.gather(fg, 120)
        bg_replies = FleetClient.gather(bg, 120)
        shed = [
            r.error for r in bg_replies if isinstance(r.error, Rejected) and "shed" in str(r.error)
        ]
        assert shed, "background should have been shed at 75% occupancy"
        assert all(r.error is None for r in fg_replies), [r.error for r in fg_replies]
        wait_idle(client)

    def test_a_frozen_node_holds_no_request_and_serves_again_after(self, cluster_fleet):
        """A node's process stopped (SIGSTOP) under load: every request is answered once,
        within its limit, none is placed there once it is known frozen, and it serves again
        when continued; frozen for longer, the router restarts it."""
        _, _, fleet = cluster_fleet
        # Round robin: the frozen node is sure to be sent requests after it froze.
        client = fleet.with_placement(picker="round_robin")
        cfg = client.config.router
        feed = random_inputs("slow")
        pid = client.status().node("edge-2").pid
        handle = client._dispatcher._nodes["edge-2"].handle
        sends_there: list[float] = []
        send = handle.infer

        def recorded(*args, **kw):
            sends_there.append(time.monotonic())
            return send(*args, **kw)

        handle.infer = recorded  # type: ignore[method-assign]
        took: dict[str, float] = {}
        futures = []
        frozen_at = 0.0
        try:
            for i in range(350):  # about 50 requests/s: 1 s, then 6 s with the node frozen
                if i == 50:
                    _signal(pid, signal.SIGSTOP)
                    frozen_at = time.monotonic()
                fut = client.submit("slow25", feed, deadline_s=1.0)
                t0 = time.monotonic()
                fut.add_done_callback(
                    lambda f, t0=t0: took.update({f.result().request_id: time.monotonic() - t0})
                )
                futures.append(fut)
                time.sleep(0.02)
            replies = FleetClient.gather(futures, 120)
        finally:
            handle.infer = send  # type: ignore[method-assign]
            _signal(pid, signal.SIGCONT)
        assert len({r.request_id for r in replies}) == 350  # one answer each
        kinds = Counter("ok" if r.error is None else type(r.error).__name__ for r in replies)
        # Typed answers only: two nodes may be too few for the load on a busy machine.
        assert set(kinds) <= {"ok", "DeadlineExceeded", "Rejected"} and kinds["ok"] >= 100, kinds
        # Each within its limit (its deadline, one probe, another node's answer), with room
        # for a busy machine; without limits, those the node held wait for it to wake.
        limit_s = 1.0 + cfg.probe_timeout_s
        slow = sorted(took.values())[-3:]
        assert slow[-1] < limit_s + 20.0, slow  # still frozen: without limits they wait on
        # Once the limit of the first requests it held passed, nothing more went there.
        assert any(t > frozen_at for t in sends_there)  # it held some
        assert max(sends_there) < frozen_at + limit_s + 2.0, max(sends_there) - frozen_at
        assert client.counters().get("replaced", 0) >= 1
        status = client.status()
        assert status.router.get("unresponsive", 0) >= 1, status.router
        _serves(client, "edge-2")

        # Frozen past router.restart_after_s: killed, and Ray starts it again in place.
        before = client.status().router.get("restarted", 0)
        _signal(pid, signal.SIGSTOP)
        try:
            end = time.monotonic() + 120
            while time.monotonic() < end:
                status = client.status()
                if status.router.get("restarted", 0) > before and status.healthy.get("edge-2"):
                    break
                time.sleep(0.5)
            else:
                raise AssertionError(f"edge-2 was not restarted: {status.router}")
        finally:
            _signal(pid, signal.SIGCONT)
        assert status.node("edge-2").pid != pid
        _serves(client, "edge-2")
        client.close()
        wait_idle(fleet)

    def test_killing_a_node_mid_load_loses_no_request(self, cluster_fleet):
        """Three callers: two send futures (``submit``), one reads its answers on its own
        thread (``map_unordered``); the node holding work from all of them dies."""
        cluster, raylets, client = cluster_fleet
        other = client.with_placement()  # a second caller placing on its own view
        piped = client.with_placement()  # a third, pipelining on a thread of its own
        feed = random_inputs("slow")
        ids = [f"kill-{i}" for i in range(16)]  # with the 14 piped, fits in the two queues left
        refs = [
            (client if i % 2 else other).submit("slow25", feed, priority=i % 11, request_id=rid)
            for i, rid in enumerate(ids)
        ]
        answers: dict[int, object] = {}

        def pipeline() -> None:
            inputs = (feed for _ in range(14))
            for i, reply in piped.map_unordered("slow25", inputs, priority=7, in_flight=14):
                answers[i] = reply

        thread = threading.Thread(target=pipeline, daemon=True)
        thread.start()

        def piped_on_edge_1() -> int:
            return len(piped._dispatcher._nodes["edge-1"].inflight)

        for _ in range(400):  # kill edge-1 while it holds queued work, some of it piped
            if client.status().node("edge-1").queue_length >= 3 and piped_on_edge_1() >= 2:
                break
            time.sleep(0.005)
        else:
            raise AssertionError("edge-1 never held queued work to lose")
        # The machine dies: its raylet and the node's process, at once. (A worker whose
        # raylet alone died may still finish the calls already delivered to it.)
        pid = client.status().node("edge-1").pid
        cluster.remove_node(raylets.pop("edge-1"), allow_graceful=False)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        replies = FleetClient.gather(refs, 180)
        assert sorted(r.request_id for r in replies) == sorted(ids)  # one answer each
        errors = [r.error for r in replies if r.error is not None]
        assert not errors, errors[:3]
        thread.join(180)
        assert not thread.is_alive(), "the pipelined caller is still waiting"
        assert sorted(answers) == list(range(14))  # one answer per input
        assert all(r.error is None for r in answers.values()), answers  # type: ignore[attr-defined]
        assert len({r.request_id for r in answers.values()}) == 14  # type: ignore[attr-defined]
        assert piped.counters().get("replaced", 0) >= 1, piped.counters()
        other.close()
        piped.close()
        status = client.status()
        # edge-1 held at least 3 queued requests when it died: each was placed again.
        assert status.router.get("replaced", 0) >= 3, status.router
        assert status.router.get("nodes_lost", 0) >= 1, status.router
        assert not status.healthy["edge-1"]

    def test_a_restarted_node_rejoins(self, cluster_fleet):
        cluster, raylets, client = cluster_fleet
        raylets["edge-1"] = cluster.add_node(
            num_cpus=1, resources={"edge-1": 1}, node_ip_address=LOOPBACK
        )
        end = time.monotonic() + 90
        while time.monotonic() < end and not client.status().healthy.get("edge-1"):
            time.sleep(0.5)
        status = client.status()
        assert status.healthy["edge-1"], "edge-1 did not rejoin"
        assert status.node("edge-1").state == "serving"
        assert status.router.get("rejoined", 0) >= 1
        reply = ray.get(node_actor("edge-1").status.remote(), timeout=30)
        assert reply.name == "edge-1"


# --- a pool of devices that join, die and come back ---------------------------------


def camera(cluster: Cluster, device: str) -> Any:
    return cluster.add_node(
        num_cpus=1,
        labels={"device": "camera", DEVICE_LABEL: device},
        node_ip_address=LOOPBACK,
    )


@pytest.fixture(scope="class")
def pool_fleet(ray_cluster, models_dir, tmp_path_factory):
    cluster = ray_cluster
    # The deployer's own copy of the model, and the devices' cache: a test removes both.
    deployer = tmp_path_factory.mktemp("deployer")
    shutil.copy(models_dir / "slow10.onnx", deployer / "slow10.onnx")
    config = parse_config(
        {
            "fleet": {"name": "pools"},
            "models": {"slow10": {"path": "slow10.onnx"}},
            "node_defaults": {"model_cache": str(deployer / "cache")},
            "pools": [
                {"name": "cams", "selector": {"device": "camera"}, "queue": {"capacity": 16}}
            ],
            "router": {
                "resources": {"head": 0.5},
                "report_interval_s": 0.2,
                "lost_after_s": 2.0,
                "membership": {"interval_s": 0.5},
            },
        },
        deployer,
    )
    said: list[str] = []
    raylets: dict[str, Any] = {}
    client = FleetClient.local(config, progress=said.append)
    try:
        yield cluster, raylets, client, said
    finally:
        client.close()
        _remove_raylets(cluster, raylets)


def devices(client: FleetClient) -> dict[str, Any]:
    return {d.device: d for d in client.status().pool("cams").devices}


def serving(client: FleetClient, wanted: set[str]) -> dict[str, Any] | None:
    now = devices(client)
    ok = {d for d, s in now.items() if s.state == "serving"} == wanted
    return now if ok else None


class TestPool:
    """The tests run in order on one pool: devices join, one dies and comes back."""

    def test_a_pool_with_no_matching_device_comes_up_empty(self, pool_fleet):
        _, _, client, said = pool_fleet
        assert any("pool cams (device=camera): no Ray node matches yet" in line for line in said)
        (pool,) = client.status().pools
        assert pool.name == "cams" and pool.devices == ()

    def test_devices_that_join_each_serve_and_a_device_without_the_labels_gets_none(
        self, pool_fleet
    ):
        cluster, raylets, client, _ = pool_fleet
        other = cluster.add_node(
            num_cpus=1, labels={"device": "doorbell"}, node_ip_address=LOOPBACK
        )
        for device in DEVICES:
            raylets[device] = camera(cluster, device)
        cluster.wait_for_nodes()
        now = wait_until("three cameras serve", lambda: serving(client, set(DEVICES)), JOIN_S)
        assert set(now) == set(DEVICES)  # the doorbell is none of them
        status = client.status()
        for device, raylet in raylets.items():
            assert now[device].ray_node == raylet.node_id and now[device].joins == 1
            assert status.healthy[f"cams/{device}"]
            spec = client.config.member_spec("cams", device, raylet.node_id)
            actor = ray.get_actor(node_actor_name("pools", spec), NAMESPACE)
            where = actor.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
            assert ray.get(where, timeout=30) == raylet.node_id
        assert other.node_id not in {d.ray_node for d in now.values()}

    def test_requests_spread_over_the_three(self, pool_fleet):
        _, _, client, _ = pool_fleet
        feed = random_inputs("slow")
        wait_until(  # the client's view holds the three members (its next fetch brings them)
            "the client sees the members", lambda: len(client._dispatcher.healthy()) == 3, 30
        )
        replies = FleetClient.gather([client.submit("slow10", feed) for _ in range(36)], 120)
        assert all(r.error is None for r in replies), [r.error for r in replies if r.error][:3]
        spread = Counter(r.node for r in replies)
        assert set(spread) == {f"cams/{d}" for d in DEVICES}, spread

    def test_a_device_lost_under_load_answers_each_request_once_and_comes_back(self, pool_fleet):
        cluster, raylets, client, _ = pool_fleet
        feed = random_inputs("slow")
        futures = []
        stop = threading.Event()

        def load() -> None:  # bursts of 9, about 30 requests/s, until told to stop
            i = 0
            while not stop.is_set():  # a burst outlasts one node's turn: each gets some
                for _ in range(9):
                    futures.append(client.submit("slow10", feed, request_id=f"load-{i}"))
                    i += 1
                time.sleep(0.3)

        before = client.status()
        pid = before.node("cams/cam-1").pid
        thread = threading.Thread(target=load, daemon=True)
        thread.start()
        try:
            entry = client._dispatcher._nodes["cams/cam-1"]
            end = time.monotonic() + 60
            while not entry.inflight:  # a request there now (each burst leaves some for 30 ms+)
                assert time.monotonic() < end, "cam-1 was sent nothing"
                time.sleep(0.002)
            # The device dies: its raylet and the node's process, at once.
            cluster.remove_node(raylets.pop("cam-1"), allow_graceful=False)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            left = wait_until(
                "cam-1 leaves the pool",
                lambda: (lambda d: d if d["cam-1"].state == "left" else None)(devices(client)),
                60,
            )
            assert sorted(d for d, s in left.items() if s.state == "serving") == ["cam-0", "cam-2"]
            time.sleep(2.0)  # and the load goes on without it
        finally:
            stop.set()
            thread.join(30)
        replies = FleetClient.gather(futures, 180)
        assert len({r.request_id for r in replies}) == len(futures)  # one answer each
        # Typed answers only: two nodes sharing a busy machine may refuse some (full queues)
        # but none is lost, and most are served.
        errors = [r.error for r in replies if r.error is not None]
        assert all(isinstance(e, Rejected) and e.retry_after_s > 0 for e in errors), errors[:3]
        assert len(errors) < len(replies) / 4, errors[:3]
        assert {r.node for r in replies} >= {"cams/cam-0", "cams/cam-2"}
        assert "cams/cam-1" not in client._dispatcher.healthy()

        # Meanwhile the deployer's model file goes, and so does the device's cache: the
        # node the device gets when it comes back fetches the model from the store.
        artifact = client.config.artifacts["slow10"]
        model = client.config.models["slow10"]
        cache = client.config.node_defaults.model_cache
        assert sha256_file(model.path) == artifact.files[0].sha256
        model.path.unlink()
        shutil.rmtree(cache)

        # The device starts Ray again: a new Ray node under the same device name.
        raylets["cam-1"] = camera(cluster, "cam-1")
        back = wait_until("cam-1 serves again", lambda: serving(client, set(DEVICES)), JOIN_S)
        assert back["cam-1"].ray_node == raylets["cam-1"].node_id and back["cam-1"].joins == 2
        (loaded,) = client.status().node("cams/cam-1").models
        assert (loaded.version, loaded.fetched_bytes) == (artifact.version, artifact.size)
        cached = cache / "trees" / artifact.digest / "slow10.onnx"
        assert sha256_file(cached) == artifact.files[0].sha256
        wait_until(
            "a request lands on cam-1 again",
            lambda: any(
                r.node == "cams/cam-1"
                for r in FleetClient.gather([client.submit("slow10", feed) for _ in range(30)], 60)
            ),
            60,
        )
        counters = client.status().router
        assert counters.get("joined", 0) >= 4, counters

    def test_closing_the_fleet_ends_its_pool_members(self, pool_fleet):
        _, _, client, _ = pool_fleet
        assert len(pool_member_handles("pools")) == 3
        client.close()  # it deployed the fleet: router and pool members go
        wait_until("no pool member is left", lambda: not pool_member_handles("pools"), 60)
