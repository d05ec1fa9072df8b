"""A pool on a real multi-raylet Ray cluster (all on loopback): membership follows the
Ray nodes that carry the pool's labels as they join, die and come back.

One cluster for the module, its head with short health checks (a dead raylet is
declared dead in a few seconds, not 15-60): the tests run in order on it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import ray
from ray.cluster_utils import Cluster

from cluster.client import FleetClient
from cluster.deploy import LOOPBACK, NAMESPACE, pin_loopback, pool_member_handles, use_auth_mode
from cluster.names import node_actor_name
from edgefleet.config import parse_config
from edgefleet.errors import Rejected
from edgefleet.labels import DEVICE_LABEL
from edgefleet.modelgen import calibrate_slow, random_inputs

pytestmark = pytest.mark.integration

DEVICES = ["cam-0", "cam-1", "cam-2"]
JOIN_S = 180.0  # a raylet up, reported ALIVE, its node actor started and its model loaded
HEALTH = {  # the head declares a raylet that stopped answering dead in about 3-6 s
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def camera(cluster: Cluster, device: str) -> Any:
    return cluster.add_node(
        num_cpus=1,
        labels={"device": "camera", DEVICE_LABEL: device},
        node_ip_address=LOOPBACK,
    )


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
def pool_fleet(models_dir):
    pin_loopback()
    use_auth_mode(token=False)
    if ray.is_initialized():
        ray.shutdown()  # this module runs its own cluster; others restart the shared one
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
    cluster.connect(namespace=NAMESPACE)
    config = parse_config(
        {
            "fleet": {"name": "pools"},
            "models": {"slow10": {"path": "slow10.onnx"}},
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
        models_dir,
    )
    said: list[str] = []
    client = FleetClient.local(config, progress=said.append)
    raylets: dict[str, Any] = {}
    try:
        yield cluster, raylets, client, said
    finally:
        client.close()
        ray.shutdown()
        cluster.shutdown()


def devices(client: FleetClient) -> dict[str, Any]:
    return {d.device: d for d in client.status().pool("cams").devices}


def serving(client: FleetClient, wanted: set[str]) -> dict[str, Any] | None:
    now = devices(client)
    ok = {d for d, s in now.items() if s.state == "serving"} == wanted
    return now if ok else None


def test_a_pool_with_no_matching_device_comes_up_empty(pool_fleet):
    _, _, client, said = pool_fleet
    assert any("pool cams (device=camera): no Ray node matches yet" in line for line in said)
    (pool,) = client.status().pools
    assert pool.name == "cams" and pool.devices == ()


def test_devices_that_join_each_serve_and_a_device_without_the_labels_gets_none(pool_fleet):
    cluster, raylets, client, _ = pool_fleet
    other = cluster.add_node(num_cpus=1, labels={"device": "doorbell"}, node_ip_address=LOOPBACK)
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


def test_requests_spread_over_the_three(pool_fleet):
    _, _, client, _ = pool_fleet
    feed = random_inputs("slow")
    wait_until(  # the client's view holds the three members (its next fetch brings them)
        "the client sees the members", lambda: len(client._dispatcher.healthy()) == 3, 30
    )
    replies = FleetClient.gather([client.submit("slow10", feed) for _ in range(36)], 120)
    assert all(r.error is None for r in replies), [r.error for r in replies if r.error][:3]
    spread = Counter(r.node for r in replies)
    assert set(spread) == {f"cams/{d}" for d in DEVICES}, spread


def test_a_device_lost_under_load_answers_each_request_once_and_comes_back(pool_fleet):
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

    # The device starts Ray again: a new Ray node under the same device name.
    raylets["cam-1"] = camera(cluster, "cam-1")
    back = wait_until("cam-1 serves again", lambda: serving(client, set(DEVICES)), JOIN_S)
    assert back["cam-1"].ray_node == raylets["cam-1"].node_id and back["cam-1"].joins == 2
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


def test_closing_the_fleet_ends_its_pool_members(pool_fleet):
    _, _, client, _ = pool_fleet
    assert len(pool_member_handles("pools")) == 3
    client.close()  # it deployed the fleet: router and pool members go
    wait_until("no pool member is left", lambda: not pool_member_handles("pools"), 60)
