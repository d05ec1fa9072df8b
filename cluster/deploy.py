"""Start an embedded Ray cluster on loopback, deploy node actors, tear them down."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import ray
from ray._private import ray_constants
from ray.actor import ActorHandle

from cluster.head import LOOPBACK, recorded_address, recorded_token_auth
from cluster.names import NAMESPACE, actor_name, router_name
from edgefleet.config import FleetConfig, NodeSpec
from edgefleet.errors import ModelNotFound

ROUTER_MAX_CONCURRENCY = 100_000  # requests one router holds open across the fleet
START_TIMEOUT_S = 300.0


def max_concurrency(spec: NodeSpec) -> int:
    """Concurrent calls a node actor holds open: its queue plus headroom for arrivals
    being admitted or refused. More would only hold memory for calls Ray can keep."""
    return max(1024, spec.queue.capacity + 256)


Progress = Callable[[str], None]


def pin_loopback() -> None:
    """Make Ray processes started from here on bind to 127.0.0.1 only.

    Ray replaces a loopback ``_node_ip_address`` with the machine's routable address
    (and then binds on every interface) unless its multi-machine mode is off. Only for
    fleets that never leave this machine: the processes Ray spawns read the
    environment variable, this process the parsed constant.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def connect_ray(address: str | None, fleet: str, *, token_auth: bool = False) -> None:
    """Connect this process to the Ray cluster a fleet runs on.

    ``address`` None or ``auto``: the head ``edgefleet up --detach`` started for
    ``fleet`` when there is one (loopback, token authentication), else Ray's own
    discovery (``RAY_ADDRESS``, then the cluster on this machine). ``token_auth``
    (the config's ``ray.auth: token``) speaks token authentication to any cluster.
    """
    recorded = recorded_address(fleet)
    if address in (None, "auto") and recorded is not None:
        address = recorded
    if address == recorded:
        token_auth = token_auth or recorded_token_auth(fleet)
    if address is not None and address.split("://")[-1].startswith((LOOPBACK, "localhost")):
        pin_loopback()  # else Ray swaps 127.0.0.1 for this machine's address
    if token_auth:
        # Ray's own switch to token authentication, as ray.init uses for new clusters;
        # the token is in ~/.ray/auth_token (or RAY_AUTH_TOKEN).
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()
    ray.init(
        address=address or "auto",
        namespace=NAMESPACE,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )


def init_loopback_ray(*, num_cpus: int, system_config: Mapping[str, Any] | None = None) -> None:
    """Start a private Ray instance whose processes all listen on 127.0.0.1 only.

    Its metrics agent (loopback too) is listed in Ray's Prometheus service-discovery
    file, so a Prometheus configured by ``edgefleet dashboard prometheus-config`` finds
    it. ``system_config`` goes to Ray (e.g. ``metrics_report_interval_ms``).
    """
    from cluster.metrics import write_service_discovery

    pin_loopback()
    ray.init(
        address="local",
        namespace=NAMESPACE,
        num_cpus=num_cpus,
        include_dashboard=False,
        _node_ip_address=LOOPBACK,
        logging_level=logging.WARNING,
        _system_config=dict(system_config or {}),
    )
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(f"the embedded Ray came up on {node_ip}, not {LOOPBACK}")
    try:
        write_service_discovery()
    except OSError as exc:  # Prometheus discovery is a convenience; the fleet runs without it
        logging.getLogger(__name__).warning("no Prometheus service-discovery file: %s", exc)


def start_local_ray(config: FleetConfig) -> None:
    """The embedded default: a private Ray on loopback sized for the config's nodes."""
    init_loopback_ray(num_cpus=config.local.num_cpus or max(2, len(config.node_specs())))


def deploy_nodes(
    config: FleetConfig, progress: Progress | None = None, *, detached: bool = False
) -> dict[str, ActorHandle]:
    """Create and start one node actor per node spec; returns handles by node name.
    Detached nodes outlive the process that deployed them (``edgefleet up --detach``)."""
    from actors.node import NodeRuntime  # the node runtime (ONNX Runtime) only where deployed

    remote_node = ray.remote(NodeRuntime)
    handles: dict[str, ActorHandle] = {}
    specs: list[NodeSpec] = config.node_specs()
    for spec in specs:
        handles[spec.name] = remote_node.options(
            name=actor_name(config.fleet.name, spec.name),
            namespace=NAMESPACE,
            num_cpus=spec.num_cpus,
            resources=spec.resources or None,
            label_selector=spec.labels or None,
            max_concurrency=max_concurrency(spec),
            max_restarts=-1,  # Ray brings a crashed node back; the router restarts its loop
            lifetime="detached" if detached else None,
        ).remote(spec)
    pending = {h.start.remote(): name for name, h in handles.items()}
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=START_TIMEOUT_S)
            if not done:
                raise RuntimeError(f"nodes did not start within {START_TIMEOUT_S:.0f} s")
            ray.get(done[0])
            name = pending.pop(done[0])
            if progress:
                progress(f"node {name} ready ({len(handles) - len(pending)}/{len(handles)})")
    except BaseException:
        teardown(handles)
        raise
    return handles


def deploy_router(config: FleetConfig) -> ActorHandle:
    """Create the fleet's router (named, detached, restarted by Ray) once its nodes exist."""
    from cluster.router import RouterActor

    router = (
        ray.remote(RouterActor)
        .options(
            name=router_name(config.fleet.name),
            namespace=NAMESPACE,
            lifetime="detached",
            max_restarts=-1,
            max_concurrency=ROUTER_MAX_CONCURRENCY,
            num_cpus=config.router.num_cpus,
            resources=dict(config.router.resources) or None,
        )
        .remote(config)
    )
    ray.get(router.start.remote(), timeout=START_TIMEOUT_S)
    return router


def teardown(
    handles: dict[str, ActorHandle], router: ActorHandle | None = None, timeout_s: float = 10.0
) -> None:
    """Stop the router, then every node (cancelling queued work so callers hear of it)."""
    if router is not None:
        ray.kill(router, no_restart=True)
    refs = [h.stop.remote() for h in handles.values()]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for h in handles.values():
        ray.kill(h, no_restart=True)


def find_fleet(fleet: str) -> tuple[ActorHandle, FleetConfig]:
    """The router of a running fleet and the configuration it was deployed with."""
    try:
        router = ray.get_actor(router_name(fleet), namespace=NAMESPACE)
    except ValueError:
        raise ModelNotFound(
            f"no fleet {fleet!r} is running on this Ray cluster; start one with `edgefleet up`"
        ) from None
    return router, ray.get(router.config.remote(), timeout=START_TIMEOUT_S)


def node_handles(config: FleetConfig) -> dict[str, ActorHandle]:
    return {
        spec.name: ray.get_actor(actor_name(config.fleet.name, spec.name), namespace=NAMESPACE)
        for spec in config.node_specs()
    }
