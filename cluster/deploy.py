"""Start an embedded Ray cluster on loopback, deploy node actors, tear them down."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
from ray._private import ray_constants
from ray.actor import ActorHandle

from cluster.head import (
    LOOPBACK,
    RAY_START_ATTEMPTS,
    children,
    ray_start_timed_out,
    reachable,
    recorded_address,
    recorded_token_auth,
    stop_children,
    token_auth_at,
)
from cluster.names import NAMESPACE, PROBE_GROUP, actor_name, node_actor_prefix, router_name
from cluster.nodes import max_concurrency
from cluster.store import stop_store
from edgefleet.config import FleetConfig
from edgefleet.errors import FleetNotRunning, FleetStartError
from edgefleet.messages import PoolStatus

ROUTER_MAX_CONCURRENCY = 100_000  # requests one router holds open across the fleet
CONTROL_TIMEOUT_S = 30.0  # a router that does not answer a control call by then is lost
PROGRESS_EVERY_S = 5.0  # while actors wait to be placed, say which and what they ask for


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


def use_auth_mode(token: bool) -> None:
    """Set Ray's authentication mode for this process and the Ray processes it starts:
    token authentication (the token in ~/.ray/auth_token or RAY_AUTH_TOKEN, written on
    first use) or none. Set explicitly, Ray uses it without a warning about its default."""
    from ray._private.authentication.authentication_token_setup import Config

    os.environ["RAY_AUTH_MODE"] = "token" if token else "disabled"
    Config.initialize("")  # Ray caches its configuration: make this process see the mode


def connect_ray(address: str | None, fleet: str, *, token_auth: bool = False) -> None:
    """Connect this process to the Ray cluster a fleet runs on.

    ``address`` None or ``auto``: the head ``edgefleet up --detach`` started for
    ``fleet`` when there is one (loopback, token authentication), else Ray's own
    discovery (``RAY_ADDRESS``, then the cluster on this machine). ``token_auth``
    (the config's ``ray.auth: token``) speaks token authentication to any cluster.

    Raises FleetNotRunning at once, saying what to do, when there is no cluster to
    connect to or nothing answers at its address (Ray itself would retry for a minute).
    """
    recorded = recorded_address(fleet)
    found = address in (None, "auto") and recorded is None  # by Ray's own discovery
    if address is None or address == "auto":
        address = recorded if recorded is not None else _discover(fleet)
    if address == recorded:
        token_auth = token_auth or recorded_token_auth(fleet)
    elif found:  # another fleet's head, maybe: speak its authentication
        token_auth = token_auth or token_auth_at(address)
    if not reachable(address):
        if address == recorded:
            raise FleetNotRunning(
                f"fleet {fleet!r} is not running: the Ray head `edgefleet up --detach` "
                f"started for it at {address} is gone; `edgefleet down --fleet {fleet}` "
                "cleans up what is left of it"
            )
        where = " (found in RAY_ADDRESS or Ray's record of its last start)" if found else ""
        raise FleetNotRunning(
            f"fleet {fleet!r}: no Ray cluster answers at {address}{where}; check the address, "
            f"or start the fleet with `edgefleet up CONFIG --detach`"
        )
    if address.split("://")[-1].startswith((LOOPBACK, "localhost")):
        pin_loopback()  # else Ray swaps 127.0.0.1 for this machine's address
    if token_auth:
        use_auth_mode(token=True)
    ray.init(
        address=address,
        namespace=NAMESPACE,
        logging_level=logging.WARNING,
        log_to_driver=False,
    )


def _discover(fleet: str) -> str:
    """The address Ray's own discovery finds (``RAY_ADDRESS``, else the cluster last
    started on this machine, else any running one), without connecting to it."""
    from ray._private.services import get_ray_address_from_environment

    try:
        return str(get_ray_address_from_environment("auto", None))
    except ConnectionError:
        raise FleetNotRunning(
            f"fleet {fleet!r} is not running: there is no Ray cluster on this machine "
            f"(none recorded for it, no RAY_ADDRESS); start it with "
            f"`edgefleet up CONFIG --detach`, or pass --address"
        ) from None


def init_loopback_ray(
    *,
    num_cpus: int,
    system_config: Mapping[str, Any] | None = None,
    token_auth: bool = True,
    log_to_driver: bool = True,
) -> None:
    """Start a private Ray instance whose processes all listen on 127.0.0.1 only.

    Its metrics agent (loopback too) is listed in Ray's Prometheus service-discovery
    file, so a Prometheus configured by ``edgefleet dashboard prometheus-config`` finds
    it. ``system_config`` goes to Ray (e.g. ``metrics_report_interval_ms``);
    ``token_auth`` chooses Ray's authentication mode; ``log_to_driver`` False keeps the
    actors' output in Ray's log files instead of this process's console.
    """
    from cluster.metrics import write_service_discovery

    pin_loopback()
    use_auth_mode(token=token_auth)
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        before = children()
        try:
            ray.init(
                address="local",
                namespace=NAMESPACE,
                num_cpus=num_cpus,
                include_dashboard=False,
                _node_ip_address=LOOPBACK,
                logging_level=logging.WARNING,
                log_to_driver=log_to_driver,
                _system_config=dict(system_config or {}),
            )
            break
        except Exception as exc:  # Ray raises a bare Exception for this one
            if not ray_start_timed_out(str(exc)):
                raise
            stop_children(spare=before)  # what the attempt started, before the next
            if attempt == RAY_START_ATTEMPTS:
                raise FleetStartError(
                    f"could not start the embedded Ray on {LOOPBACK} in {attempt} attempts: {exc}"
                ) from None
            logging.getLogger(__name__).warning("%s; starting it again", exc)
    node_ip = ray.util.get_node_ip_address()
    if node_ip != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(f"the embedded Ray came up on {node_ip}, not {LOOPBACK}")
    try:
        write_service_discovery()
    except OSError as exc:  # Prometheus discovery is a convenience; the fleet runs without it
        logging.getLogger(__name__).warning("no Prometheus service-discovery file: %s", exc)


def start_local_ray(config: FleetConfig, *, log_to_driver: bool = True) -> None:
    """The embedded default: a private Ray on loopback sized for the config's nodes,
    with the config's authentication mode (``ray.auth``)."""
    init_loopback_ray(
        num_cpus=config.local.num_cpus or max(2, len(config.node_specs())),
        token_auth=config.ray.auth == "token",
        log_to_driver=log_to_driver,
    )


@dataclass(frozen=True)
class _Starting:
    """An actor being placed and started: what to call it and what it asks of a machine."""

    what: str  # "node edge-0", "router"
    num_cpus: float = 0
    resources: Mapping[str, float] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)

    def asks(self, offered: Mapping[str, float], labelled: list[Mapping[str, str]]) -> str:
        """``node edge-0 asks for resources gpu=1 (no machine offers resource gpu)``: what
        it needs, and what of that this cluster (``offered`` resources, the machines'
        labels) lacks."""
        parts = [f"{self.num_cpus:g} CPU"] if self.num_cpus else []
        if self.resources:
            parts.append("resources " + ", ".join(f"{k}={v:g}" for k, v in self.resources.items()))
        if self.labels:
            parts.append("labels " + ", ".join(f"{k}={v}" for k, v in self.labels.items()))
        lacking = [f"resource {k}" for k in self.resources if k not in offered]
        lacking += [
            f"label {k}={v}"
            for k, v in self.labels.items()
            if re.fullmatch(r"[\w.-]+", v) and all(m.get(k) != v for m in labelled)
        ]
        text = f"{self.what} asks for {' and '.join(parts) or 'no special resources'}"
        return text + (f" (no machine offers {', '.join(lacking)})" if lacking else "")


def _describe(waiting: list[_Starting]) -> str:
    """What each of ``waiting`` asks for, against what the cluster offers now."""
    try:
        offered = ray.cluster_resources()
        labelled = [n.get("Labels", {}) for n in ray.nodes() if n.get("Alive")]
    except Exception:  # a description only: never the reason a start fails
        offered, labelled = {}, []
    return "; ".join(s.asks(offered, labelled) for s in waiting)


def _one_line(exc: BaseException) -> str:
    """An error as one plain line: a Ray task error's cause, no colour codes, and of a
    multi-line message (a remote traceback) its last line."""
    if isinstance(exc, ray.exceptions.RayTaskError) and exc.cause is not None:
        exc = exc.cause
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _wait_started(
    starting: Mapping[ray.ObjectRef, _Starting], timeout_s: float, progress: Progress | None
) -> None:
    """Wait for every actor's ``start`` call; say every PROGRESS_EVERY_S which are still
    waiting and what they ask for. Raises FleetStartError naming the actor and the cause
    when one fails, or those still waiting after ``timeout_s``."""
    pending = dict(starting)
    began = time.monotonic()
    report_at = began + PROGRESS_EVERY_S
    while pending:
        now = time.monotonic()
        if now - began >= timeout_s:
            raise FleetStartError(
                f"not started within {timeout_s:g} s: {_describe(list(pending.values()))}; "
                "run them where a machine offers what they ask for, or change the config "
                "(`ray.start_timeout_s` or `up --start-timeout` set how long to wait)"
            )
        wait_s = min(report_at, began + timeout_s) - now
        done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, wait_s))
        if done:
            item = pending.pop(done[0])
            try:
                ray.get(done[0])
            except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as exc:
                raise FleetStartError(f"{item.what} could not start: {_one_line(exc)}") from None
            if progress:
                count = f" ({len(starting) - len(pending)}/{len(starting)})"
                progress(f"{item.what} ready{count if len(starting) > 1 else ''}")
        elif time.monotonic() >= report_at:
            report_at += PROGRESS_EVERY_S
            if progress:
                progress(
                    f"still starting after {time.monotonic() - began:.0f} s (giving up at "
                    f"{timeout_s:g} s): {_describe(list(pending.values()))}"
                )


def _refuse_running(fleet: str) -> None:
    """Raise FleetStartError if ``fleet``'s router already runs on this Ray cluster."""
    try:
        ray.get_actor(router_name(fleet), namespace=NAMESPACE)
    except ValueError:
        return
    raise FleetStartError(
        f"fleet {fleet!r} is already running on this Ray cluster; stop it first with "
        f"`edgefleet down --fleet {fleet}`"
    )


def deploy_nodes(
    config: FleetConfig, progress: Progress | None = None, *, detached: bool = False
) -> dict[str, ActorHandle]:
    """Create and start one node actor per node spec; returns handles by node name.
    Detached nodes outlive the process that deployed them (``edgefleet up --detach``).

    Raises FleetStartError, having stopped every node it created, when the fleet already
    runs here, a node fails to start (naming it and the cause), or nodes are not placed
    and started within ``ray.start_timeout_s`` (naming what they ask for).
    """
    from actors.node import NodeRuntime  # the node runtime (ONNX Runtime) only where deployed

    _refuse_running(config.fleet.name)
    # Probes run on a thread of their own: a node flooded with calls still answers them.
    remote_node = ray.remote(concurrency_groups={PROBE_GROUP: 1})(NodeRuntime)
    handles: dict[str, ActorHandle] = {}
    starting: dict[ray.ObjectRef, _Starting] = {}
    try:
        for spec in config.node_specs():
            handle = handles[spec.name] = remote_node.options(
                name=actor_name(config.fleet.name, spec.name),
                namespace=NAMESPACE,
                num_cpus=spec.num_cpus,
                resources=spec.resources or None,
                label_selector=spec.labels or None,
                max_concurrency=max_concurrency(spec),
                max_restarts=-1,  # Ray brings a crashed node back; the router restarts its loop
                lifetime="detached" if detached else None,
            ).remote(spec)
            ask = _Starting(f"node {spec.name}", spec.num_cpus, spec.resources, spec.labels)
            starting[handle.start.remote()] = ask
        _wait_started(starting, config.ray.start_timeout_s, progress)
    except BaseException:
        teardown(handles, timeout_s=1.0)
        raise
    return handles


def deploy_router(config: FleetConfig, progress: Progress | None = None) -> ActorHandle:
    """Create the fleet's router (named, detached, restarted by Ray) once its nodes exist.
    Raises FleetStartError, having stopped it, as :func:`deploy_nodes` does."""
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
    ask = _Starting("router", config.router.num_cpus, config.router.resources)
    try:
        _wait_started({router.start.remote(): ask}, config.ray.start_timeout_s, progress)
    except BaseException:
        ray.kill(router, no_restart=True)
        raise
    if progress is not None:
        say_pools(config, router, progress)
    return router


def say_pools(config: FleetConfig, router: ActorHandle, progress: Progress) -> None:
    """Say what each pool holds now that the router started (bounded; a router that
    does not answer in time is not waited for: the fleet runs)."""
    if not config.pools:
        return
    try:
        status = ray.get(router.start.remote(), timeout=CONTROL_TIMEOUT_S)  # its first result
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
        return
    for pool in status.pools:
        progress(pool_line(pool))


def pool_line(pool: PoolStatus) -> str:
    """``pool cameras (device=camera): 2 devices starting`` or, with none, that nodes
    start as devices join: ``up`` does not wait for devices."""
    if not pool.devices:
        return (
            f"pool {pool.name} ({pool.selector}): no Ray node matches yet; a node starts on "
            "each as it joins the cluster"
        )
    counts = Counter(d.state for d in pool.devices)
    listed = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    return f"pool {pool.name} ({pool.selector}): {len(pool.devices)} device(s): {listed}"


def teardown(
    handles: dict[str, ActorHandle],
    router: ActorHandle | None = None,
    timeout_s: float = 10.0,
    *,
    fleet: str | None = None,
) -> int:
    """Stop the router, then every node (cancelling queued work so callers hear of it):
    those of ``handles`` and, given the ``fleet``'s name, its pool members (the router
    stops following the pools first, so that it starts none meanwhile). Returns the
    nodes stopped."""
    if router is not None:
        with contextlib.suppress(Exception):  # a router that does not answer is killed
            ray.get(router.stop.remote(), timeout=min(timeout_s, CONTROL_TIMEOUT_S))
        ray.kill(router, no_restart=True)
    if fleet is not None:
        stop_store(fleet)
    handles = dict(handles)
    if fleet is not None:
        handles.update(pool_member_handles(fleet, exclude=handles))
    refs = [h.stop.remote() for h in handles.values()]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for h in handles.values():
        ray.kill(h, no_restart=True)
    return len(handles)


def find_fleet(fleet: str) -> tuple[ActorHandle, FleetConfig]:
    """The router of a running fleet and the configuration it was deployed with; raises
    FleetNotRunning when there is none, or it does not answer within CONTROL_TIMEOUT_S."""
    try:
        router = ray.get_actor(router_name(fleet), namespace=NAMESPACE)
    except ValueError:
        raise FleetNotRunning(
            f"no fleet {fleet!r} is running on this Ray cluster; start one with `edgefleet up`"
        ) from None
    try:
        config: FleetConfig = ray.get(router.config.remote(), timeout=CONTROL_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise FleetNotRunning(
            f"the router of fleet {fleet!r} did not answer within {CONTROL_TIMEOUT_S:g} s"
        ) from None
    except ray.exceptions.RayActorError as exc:
        raise FleetNotRunning(
            f"the router of fleet {fleet!r} is not reachable: {_one_line(exc)}"
        ) from None
    return router, config


def pool_member_handles(
    fleet: str, exclude: Mapping[str, Any] | None = None
) -> dict[str, ActorHandle]:
    """Handles of the node actors of ``fleet`` running on this Ray cluster that are not
    nodes of ``exclude`` (the pool members: the router starts them), by actor name."""
    prefix = node_actor_prefix(fleet)
    static = {actor_name(fleet, name) for name in exclude or {}}
    handles = {}
    for named in ray.util.list_named_actors(all_namespaces=True):
        name = named["name"]
        if named["namespace"] != NAMESPACE or not name.startswith(prefix) or name in static:
            continue
        with contextlib.suppress(ValueError):  # ended meanwhile
            handles[name] = ray.get_actor(name, namespace=NAMESPACE)
    return handles


def node_handles(config: FleetConfig) -> dict[str, ActorHandle]:
    """Handles of the fleet's node actors; FleetNotRunning names one that is not there."""
    handles = {}
    for spec in config.node_specs():
        try:
            handles[spec.name] = ray.get_actor(
                actor_name(config.fleet.name, spec.name), namespace=NAMESPACE
            )
        except ValueError:
            raise FleetNotRunning(
                f"node {spec.name} of fleet {config.fleet.name!r} is not running"
            ) from None
    return handles
