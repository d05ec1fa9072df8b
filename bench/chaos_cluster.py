"""The chaos soak's cluster and the chaos itself (see bench/chaos.py).

A Ray head started as ``edgefleet up --detach`` does (with Redis when asked, so that it
can be killed and started again) and one raylet per edge node, all on loopback; the
driver attaches to a spared node's raylet (or one of its own). The :class:`Controller`
hits the cluster on a seeded schedule, one event at a time: ``node`` (SIGKILL a node
actor's process), ``router`` (``ray.kill``), ``raylet`` (SIGKILL a raylet and its
processes; a new one joins later), ``node-freeze`` and ``raylet-freeze`` (SIGSTOP, then
SIGCONT) and ``head`` (kill the head, start it again once nothing else is away).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import ray

from bench.common import log
from cluster.client import FleetClient
from cluster.deploy import node_handles, pin_loopback, use_auth_mode
from cluster.head import head_processes, kill_head, restart_head, start_head, stop_head
from cluster.names import NAMESPACE, router_name
from cluster.raylet import kill_raylet, raylet_processes, start_raylet, the_raylet
from edgefleet.config import parse_config
from edgefleet.messages import NodeState, NodeStatus

NODES = ("edge-0", "edge-1", "edge-2")
CLIENT = "client"  # the driver's own raylet, when no node is spared
KINDS = ("node", "router", "raylet", "node-freeze", "raylet-freeze", "head")
LM = "tiny_lm"
REPORT_INTERVAL_S = 0.25
LOST_AFTER_S = 2.0
RESTART_AFTER_S = 5.0  # router.restart_after_s: a frozen node is killed after this long
# The GCS finds a dead or frozen raylet in seconds, not Ray's 15 s (dead) or a minute
# (frozen), so that a machine's node actor moves on within the run.
HEALTH_CHECKS = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "3",
}
# Raylets and drivers wait this long for a head that is down (Ray: 60 s).
GCS_RECONNECT = {"RAY_gcs_rpc_server_reconnect_timeout_s": "300"}
# ... and the head's raylet gets this long to register (Ray: 10 s; short on a busy machine).
HEAD_ENV = {**HEALTH_CHECKS, "RAY_raylet_start_wait_time_s": "60"}
FIRST_EVENT_S = (5.0, 8.0)  # the first event, seconds after the load starts
AIM_WORK, AIM_S = 2, 2.0  # an event waits up to AIM_S for a target holding AIM_WORK requests
QUIET_END_S = 12.0  # no event this close to the end: what was hit comes back
DOWN_S = (4.0, 8.0)  # how long a killed raylet stays away
HEAD_DOWN_S = (3.0, 6.0)  # how long a killed head stays dead
# A frozen node: shorter than lost_after_s; past it (unresponsive); past lost_after_s +
# restart_after_s (the router kills it). A frozen raylet: within the health checks'
# limit (about 6-9 s here), or past it.
FREEZE_S = {
    "node-freeze": (
        ("short", (0.5, 1.5)),
        ("past lost_after_s", (LOST_AFTER_S + 1.0, LOST_AFTER_S + RESTART_AFTER_S - 1.0)),
        ("past restart_after_s", (LOST_AFTER_S + RESTART_AFTER_S + 3.0, 13.0)),
    ),
    "raylet-freeze": (("short", (1.5, 3.0)), ("past the health checks", (12.0, 15.0))),
}
EXITED_WITHIN_S = 8.0  # a raylet thawed past the health checks exits by then
CONTROL_TIMEOUT_S = 10.0


@dataclass
class Event:
    """One chaos event: a kill, a freeze or a head restart."""

    at: float  # unix time
    kind: str  # one of KINDS
    target: str  # a node's name, "router" or "head"
    pids: tuple[int, ...]  # the processes it hit
    back_at: float | None = None  # a raylet or the head started again; a freeze's SIGCONT
    healthy_at: float | None = None  # the node (or router) answering again
    note: str = ""

    @property
    def freeze(self) -> bool:
        return self.kind.endswith("-freeze")


def _signal(procs: Sequence[psutil.Process], sig: signal.Signals) -> int:
    """Send ``sig`` to each of ``procs`` still running; how many got it."""
    sent = 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE:
                proc.send_signal(sig)
                sent += 1
    return sent


class Raylets:
    """A Ray head on loopback and raylets started and killed as machines come and go,
    each in a folder of its own (bench.chaos and bench.churn); ``options(name)`` are
    the keywords of ``name``'s :func:`start_raylet`."""

    def __init__(self, name: str, options: Callable[[str], dict[str, Any]]) -> None:
        self.name = name  # the head's folder and the fleet's name
        self.options = options
        self.address = ""
        self.dirs: dict[str, Path] = {}  # raylet -> its folder (the current one)
        self.old: list[Path] = []  # folders of raylets that died

    def start_cluster(
        self, raylets: Sequence[str], home: str, env: dict[str, str], redis: bool
    ) -> None:
        """Start the head, then ``raylets`` one at a time (a GCS on a busy machine times
        out); connect this driver through ``home``'s raylet."""
        pin_loopback()
        use_auth_mode(token=True)
        if ray.is_initialized():
            ray.shutdown()
        self.address = start_head(self.name, 1, redis=redis, env=env)
        for name in raylets:
            self.add(name)
        ray.init(
            address=self.address,
            _temp_dir=str(self.dirs[home]),
            namespace=NAMESPACE,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )

    def add(self, name: str) -> float:
        """Start ``name``'s raylet (again) in a new folder; when it joined."""
        self.dirs[name] = Path(tempfile.mkdtemp(prefix="ef-", dir="/tmp"))  # short: sockets
        start_raylet(self.address, self.dirs[name], **self.options(name))
        return time.monotonic()

    def kill(self, name: str) -> tuple[int, ...]:
        """``name``'s machine dies: every process of its raylet; their pids."""
        self.old.append(self.dirs.pop(name))
        pids = tuple(p.pid for p in raylet_processes(self.old[-1]))
        kill_raylet(self.old[-1])
        return pids

    def stop(self) -> None:
        """Disconnect; stop every raylet started here, then the head (and its Redis)."""
        with contextlib.suppress(Exception):
            ray.shutdown()
        for directory in [*self.dirs.values(), *self.old]:
            try:
                kill_raylet(directory)
            except Exception as exc:
                log(f"stopping raylet {directory}: {type(exc).__name__}: {exc}")
            shutil.rmtree(directory, ignore_errors=True)
        try:
            stop_head(self.name)
        except Exception as exc:
            log(f"stopping the head: {type(exc).__name__}: {exc}")


class Fleet(Raylets):
    """The cluster (a head, a raylet per node and one for the driver when no node is
    spared) and the deployed fleet."""

    def __init__(self, models: Path, traces: Path, *, redis: bool, spare: tuple[str, ...]) -> None:
        super().__init__(f"chaos{os.getpid()}", self._raylet)  # a head and names of its own
        self.models, self.traces, self.redis = models, traces, redis
        self.home = spare[0] if spare else CLIENT  # the driver's raylet: never hit
        self.client: FleetClient | None = None
        self.nodes: dict[str, Any] = {}  # the node actors' handles

    @staticmethod
    def _raylet(name: str) -> dict[str, Any]:
        return {"resources": {} if name == CLIENT else {name: 1}, "num_cpus": int(name != CLIENT)}

    def start(self) -> FleetClient:
        if self.redis:  # read by the raylets started from here, and by this driver
            os.environ.update(GCS_RECONNECT)
        t0 = time.monotonic()
        raylets = [CLIENT] * (self.home == CLIENT) + list(NODES)
        self.start_cluster(raylets, self.home, HEAD_ENV, self.redis)
        log(f"  head and raylets up in {time.monotonic() - t0:.1f} s")
        self.client = FleetClient.local(self._config(), progress=lambda m: log(f"  {m}"))
        self.nodes = node_handles(self.client.config)
        return self.client

    def _config(self) -> Any:
        classifier = {"path": "classifier.onnx", "batching": {"window_ms": 2, "max_batch_size": 8}}
        models = {"classifier": classifier, "slow": {"path": "slow.onnx"}}
        return parse_config(
            {
                "fleet": {"name": self.name},
                "models": models | {LM: {"path": "tiny_lm.onnx", "kind": "decoder"}},
                # Bounded caches (16 MB of KV a node) fill within the warm-up: later growth
                # is a leak.
                "node_defaults": {
                    "queue": {"capacity": 24},
                    "kv_budget_mb": 16,
                    "trace_dir": str(self.traces),
                },
                "nodes": [{"name": n, "resources": {n: 0.5}} for n in NODES],
                "router": {
                    "resources": {"node:__internal_head__": 0.001},  # on the head, dies with it
                    "report_interval_s": REPORT_INTERVAL_S,
                    "lost_after_s": LOST_AFTER_S,
                    "restart_after_s": RESTART_AFTER_S,
                },
            },
            self.models,
        )

    def processes(self, title: str = "") -> list[psutil.Process]:
        """The cluster's processes (the head's and every raylet's) whose title starts
        with ``title``."""
        procs = head_processes(self.name)
        for directory in list(self.dirs.values()):  # raylets come and go meanwhile
            procs += raylet_processes(directory)
        found = []
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                if (proc.cmdline() or [""])[0].startswith(title):
                    found.append(proc)
        return found

    def router_pid(self) -> int | None:
        procs = self.processes("ray::RouterActor")
        return procs[0].pid if len(procs) == 1 else None

    def close(self, wait_s: float = 15.0) -> list[str]:
        """Close the client (it tears the fleet down); the actors Ray does not report
        dead and the processes of the fleet's actors still running after it, waiting up
        to ``wait_s`` for the ones just killed to go."""
        if self.client is None:
            return []
        self.client.close()
        self.client = None
        end = time.monotonic() + wait_s
        while True:
            alive = [
                f"{a.get('Name') or a.get('ActorClassName') or actor_id} ({a.get('State')})"
                for actor_id, a in ray._private.state.actors().items()
                if a.get("State") != "DEAD"
            ]
            alive += [
                f"process {p.pid} ({title})"
                for title in ("ray::NodeRuntime", "ray::RouterActor")
                for p in self.processes(title)
            ]
            if not alive or time.monotonic() >= end:
                return sorted(alive)
            time.sleep(0.5)

    def shutdown(self) -> None:
        """Stop everything the fleet started: its raylets, its head and its Redis."""
        with contextlib.suppress(Exception):
            if self.client is not None:
                self.client.close()
        self.stop()


class Controller:
    """Chaos events on a seeded schedule, one of each kind first (in a seeded order).
    Driven by :meth:`tick` from the main thread: what an event undoes later (a raylet
    started again, a SIGCONT, the head started again) is scheduled, not slept on."""

    def __init__(
        self, fleet: Fleet, kinds: tuple[str, ...], spare: tuple[str, ...], seed: int
    ) -> None:
        self.fleet, self.kinds, self.spare = fleet, kinds, spare
        self.rng = random.Random(f"{seed}/chaos")
        self.events: list[Event] = []
        self.errors: list[str] = []
        self.away: dict[str, Event] = {}  # nodes down or frozen, until they are back
        self._later: list[tuple[float, Callable[[], None]]] = []  # (when, what)
        self._head_down = False
        self._lock = threading.Lock()
        self._first = self.rng.sample(kinds, len(kinds))
        self._kind: str | None = None  # the kind of the event that is due, since _due
        self._due = self._next = math.inf
        self.until = self._every = 0.0

    def start(self, t0: float, seconds: float, every_s: float) -> None:
        self._every = every_s
        self._next = t0 + self.rng.uniform(*FIRST_EVENT_S)
        self.until = t0 + max(seconds - QUIET_END_S, FIRST_EVENT_S[1])

    def tick(self) -> None:
        """Undo what is due; strike when the schedule says so."""
        now = time.monotonic()
        self._run_due(now)
        if now < self._next or now >= self.until or self._head_down:
            return
        if self._kind is None:
            self._kind = self._first.pop(0) if self._first else self.rng.choice(self.kinds)
            self._due = now
        try:
            event = self._strike(self._kind, aim=now < self._due + AIM_S)
            if event is None:
                return  # waiting for a target, or for the head's turn
            with self._lock:
                self.events.append(event)
            pids = " ".join(map(str, event.pids)) or "-"
            log(f"chaos: {event.kind} {event.target} (pids {pids}) {event.note}")
        except Exception as exc:
            self.errors.append(f"{self._kind}: {type(exc).__name__}: {exc}")
            log(f"chaos: {self._kind} failed: {type(exc).__name__}: {exc}")
        self._next = now + self.rng.uniform(0.6 * self._every, 1.4 * self._every)
        self._kind = None

    def finish(self) -> None:
        """Nothing stays down or frozen: undo everything still pending, now."""
        self._next = math.inf
        self._run_due(math.inf)  # SIGCONT, raylets and the head started again
        while self._later:  # a thawed raylet's check: it needs time to see it exit
            time.sleep(0.25)
            self._run_due(time.monotonic())

    def snapshot(self) -> list[Event]:
        with self._lock:
            return list(self.events)

    def _later_do(self, delay_s: float, what: Callable[[], None]) -> None:
        self._later.append((time.monotonic() + delay_s, what))

    def _run_due(self, now: float) -> None:
        due = sorted((item for item in self._later if item[0] <= now), key=lambda i: i[0])
        self._later = [item for item in self._later if item[0] > now]
        for _, what in due:
            try:
                what()
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                log(f"chaos: undoing an event failed: {type(exc).__name__}: {exc}")

    def _strike(self, kind: str, *, aim: bool) -> Event | None:
        """An event of ``kind``; None to wait: for a node that serves (``aim``: one
        holding AIM_WORK requests), or for the head, until nothing else is away."""
        now = time.time()
        if kind == "router":
            pid = self.fleet.router_pid()
            router = ray.get_actor(router_name(self.fleet.name), NAMESPACE)
            ray.kill(router, no_restart=False)  # Ray starts it again
            return Event(now, kind, "router", (pid,) if pid else ())
        if kind == "head":
            if self._later or self.away:
                return None
            self._head_down = True
            router = self.fleet.router_pid()
            pids = tuple(kill_head(self.fleet.name)) + ((router,) if router else ())
            down = self.rng.uniform(*HEAD_DOWN_S)
            event = Event(now, kind, "head", pids, note=f"down {down:.1f} s")
            self._later_do(down, lambda: self._restart_head(event))
            return event
        target = self._target(aim)
        if target is None:
            return None
        name, proc = target
        if kind == "node":
            return Event(now, kind, name, (proc.pid,)) if _signal([proc], signal.SIGKILL) else None
        if kind == "raylet":
            down = self.rng.uniform(*DOWN_S)
            event = Event(now, kind, name, self.fleet.kill(name), note=f"down {down:.1f} s")
            self._later_do(down, lambda: self._restore(name, event))
        else:  # SIGSTOP; SIGCONT after a duration drawn from one of the kind's bands
            procs = [proc] if kind == "node-freeze" else raylet_processes(self.fleet.dirs[name])
            band, (low, high) = self.rng.choice(FREEZE_S[kind])
            frozen_s = self.rng.uniform(low, high)
            _signal(procs, signal.SIGSTOP)
            note = f"frozen {frozen_s:.1f} s ({band})"
            event = Event(now, kind, name, tuple(p.pid for p in procs), note=note)
            self._later_do(frozen_s, lambda: self._thaw(event, procs))
        self.away[name] = event
        return event

    def _target(self, aim: bool) -> tuple[str, psutil.Process] | None:
        """Of the nodes that may be hit and serve, the one holding the most requests
        (a seeded choice among equals) and its process; None while there is none, or
        (``aim``) none holds AIM_WORK requests yet."""
        names = [n for n in NODES if n not in self.spare and n not in self.away]
        held = []
        for name in self.rng.sample(names, len(names)):
            try:
                status: NodeStatus = ray.get(self.fleet.nodes[name].status.remote(), timeout=2)
            except Exception:
                continue
            procs = [p for p in raylet_processes(self.fleet.dirs[name]) if p.pid == status.pid]
            if status.state == NodeState.SERVING and procs:
                work = status.queue_length + sum(status.paused.values())
                work += len(status.running.request_ids) if status.running is not None else 0
                held.append((work, name, procs[0]))
        if not held:
            return None
        work, name, proc = max(held, key=lambda h: h[0])
        return None if aim and work < AIM_WORK else (name, proc)

    def _restore(self, name: str, event: Event) -> None:
        """Start ``name``'s raylet again, with the same resources."""
        try:
            self.fleet.add(name)
            if event.kind == "raylet":
                event.back_at = time.time()
            log(f"chaos: raylet {name} started again")
        finally:
            self.away.pop(name, None)

    def _restart_head(self, event: Event) -> None:
        """Start the head again (``restart_head`` starts it again itself when, on a busy
        machine, its raylet does not register in time)."""
        try:
            restart_head(self.fleet.name)
            event.back_at = time.time()
            log(f"chaos: head started again ({event.back_at - event.at:.1f} s after the kill)")
        finally:
            self._head_down = False

    def _thaw(self, event: Event, procs: list[psutil.Process]) -> None:
        continued = _signal(procs, signal.SIGCONT)
        event.back_at = time.time()
        if continued < len(procs):
            event.note += f"; {len(procs) - continued} of its processes had been killed"
        if event.kind == "raylet-freeze":
            self._later_do(0.5, lambda: self._after_thaw(event, time.monotonic()))
        else:
            self.away.pop(event.target, None)

    def _after_thaw(self, event: Event, since: float) -> None:
        """A thawed raylet the GCS declared dead exits: start a new one in its place
        (what is left of the old one is killed). One still running after
        EXITED_WITHIN_S serves on."""
        name = event.target
        if the_raylet(self.fleet.dirs[name]) is None:
            event.note += "; declared dead, it exited: started again"
            self.fleet.kill(name)
            self._restore(name, event)
        elif time.monotonic() - since < EXITED_WITHIN_S:
            self._later_do(0.5, lambda: self._after_thaw(event, since))
        else:
            event.note += "; it serves on"
            self.away.pop(name, None)
