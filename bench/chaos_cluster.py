"""The chaos soak's cluster and the chaos itself (see bench/chaos.py).

A Ray head started as ``edgefleet up --detach`` does (with ``ray.redis`` when
redis-server is installed, so that it can be killed and started again) and one raylet
per edge node, all on loopback; the driver attaches to a spared node's raylet (or one
of its own: a driver on the head's raylet would die with the head). The
:class:`Controller` hits the cluster on a seeded schedule, one event at a time:
``node`` (SIGKILL a node actor's process), ``router`` (``ray.kill``), ``raylet``
(SIGKILL a raylet and its processes, a new one joins later), ``node-freeze`` and
``raylet-freeze`` (SIGSTOP, SIGCONT after a drawn while) and ``head`` (kill the head
and start it again once nothing else is down or frozen).
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil
import ray

from bench.common import log
from cluster.client import FleetClient
from cluster.deploy import pin_loopback, use_auth_mode
from cluster.head import head_processes, kill_head, restart_head, start_head, stop_head
from cluster.names import NAMESPACE, actor_name, router_name
from cluster.raylet import kill_raylet, raylet_processes, start_raylet, the_raylet
from edgefleet.config import parse_config
from edgefleet.errors import FleetStartError
from edgefleet.messages import NodeState, NodeStatus

NODES = ("edge-0", "edge-1", "edge-2")
CLIENT = "client"  # the driver's own raylet, when no node is spared
KINDS = ("node", "router", "raylet", "node-freeze", "raylet-freeze", "head")
LM = "tiny_lm"
REPORT_INTERVAL_S = 0.25
KV_BUDGET_MB = 16  # sessions' and paused generations' KV per node
LOST_AFTER_S = 2.0
RESTART_AFTER_S = 5.0  # router.restart_after_s: a frozen node is killed after this long
# A raylet that dies or freezes is found dead by the GCS's health checks: a few seconds,
# not Ray's default of about 15 s (dead) or a minute (frozen), so a machine's node actor
# moves on within the run.
HEALTH_CHECKS = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "3",
}
FIRST_EVENT_S = (5.0, 8.0)  # the first event, seconds after the load starts
AIM_WORK = 2  # a node or raylet event waits for a target holding this many requests...
AIM_S = 2.0  # ...for at most this long
QUIET_END_S = 12.0  # no event this close to the end: what was hit comes back
DOWN_S = (4.0, 8.0)  # how long a killed raylet stays away
HEAD_DOWN_S = (3.0, 6.0)  # how long a killed head stays dead
HEAD_STARTS = 3  # tries to start it again
# How long a frozen node's process stays stopped: shorter than lost_after_s; past it
# (unresponsive); past lost_after_s + restart_after_s (the router kills it).
NODE_FREEZE_S = (
    ("short", (0.5, 1.5)),
    ("past lost_after_s", (LOST_AFTER_S + 1.0, LOST_AFTER_S + RESTART_AFTER_S - 1.0)),
    ("past restart_after_s", (LOST_AFTER_S + RESTART_AFTER_S + 3.0, 13.0)),
)
# A frozen raylet: within the health checks' limit (about 6-9 s here), or past it.
RAYLET_FREEZE_S = (("short", (1.5, 3.0)), ("past the health checks", (12.0, 15.0)))
# Raylets and drivers wait this long for a head that is down, not Ray's 60 s: a head
# restart on a busy machine can take longer.
GCS_RECONNECT = {"RAY_gcs_rpc_server_reconnect_timeout_s": "300"}
# The head's settings: its health checks, and the time its raylet gets to register
# (Ray's 10 s is short on a busy machine; restart_head starts it with the same).
HEAD_ENV = {**HEALTH_CHECKS, "RAY_raylet_start_wait_time_s": "60"}
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


def _signal(procs: list[psutil.Process], sig: signal.Signals) -> int:
    """Send ``sig`` to each of ``procs`` still running (psutil checks that a pid still
    names the same process); how many got it."""
    sent = 0
    for proc in procs:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                proc.send_signal(sig)
                sent += 1
        except psutil.Error:
            continue
    return sent


class Raylets:
    """A Ray head on loopback and raylets started and killed as machines come and go,
    each in a folder of its own (bench.chaos and bench.churn)."""

    def __init__(self, name: str) -> None:
        self.name = name  # the head's folder
        self.address = ""
        self.dirs: dict[str, Path] = {}  # raylet -> its folder (the current one)
        self.old: list[Path] = []  # folders of raylets that died

    def add(self, name: str, **kw: Any) -> float:
        """Start ``name``'s raylet (again) in a new folder; when it joined."""
        directory = Path(tempfile.mkdtemp(prefix="ef-", dir="/tmp"))  # short: sockets
        self.dirs[name] = directory
        start_raylet(self.address, directory, **kw)
        return time.monotonic()

    def kill(self, name: str) -> tuple[int, ...]:
        """``name``'s machine dies: every process of its raylet; their pids."""
        directory = self.dirs.pop(name)
        self.old.append(directory)
        pids = tuple(p.pid for p in raylet_processes(directory))
        kill_raylet(directory)
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
    """The cluster (head, one raylet per node and one for the client, on loopback) and
    the deployed fleet."""

    def __init__(self, models: Path, traces: Path, *, redis: bool, spare: tuple[str, ...]) -> None:
        super().__init__(f"chaos{os.getpid()}")  # a head folder and actor names of its own
        self.models = models
        self.traces = traces
        self.redis = redis
        # The driver's raylet: a spared node's (never hit), else one of its own.
        self.home = spare[0] if spare else CLIENT
        self._actors: dict[str, Any] = {}  # handles, got while the head is there
        self.client: FleetClient | None = None
        self.closed = False

    def start(self) -> FleetClient:
        pin_loopback()
        use_auth_mode(token=True)
        if self.redis:  # read by the raylets started from here, and by this driver
            os.environ.update(GCS_RECONNECT)
        if ray.is_initialized():
            ray.shutdown()
        t0 = time.monotonic()
        self.address = start_head(self.name, 1, redis=self.redis, env=HEAD_ENV)
        log(f"  head up in {time.monotonic() - t0:.1f} s")
        for name in ([] if self.home in NODES else [CLIENT]) + list(NODES):
            self.add_raylet(name)  # one at a time: a GCS on a busy machine times out
        log(f"  raylets up in {time.monotonic() - t0:.1f} s")
        ray.init(
            address=self.address,
            _temp_dir=str(self.dirs[self.home]),
            namespace=NAMESPACE,
            logging_level=logging.WARNING,
            log_to_driver=False,
        )
        self.client = FleetClient.local(self._config(), progress=lambda m: log(f"  {m}"))
        self._actors = {n: ray.get_actor(actor_name(self.name, n), NAMESPACE) for n in NODES}
        self._actors["router"] = ray.get_actor(router_name(self.name), NAMESPACE)
        return self.client

    def _config(self) -> Any:
        return parse_config(
            {
                "fleet": {"name": self.name},
                "models": {
                    "classifier": {
                        "path": "classifier.onnx",
                        "batching": {"window_ms": 2, "max_batch_size": 8},
                    },
                    "slow": {"path": "slow.onnx"},
                    LM: {"path": "tiny_lm.onnx", "kind": "decoder"},
                },
                "node_defaults": {
                    "queue": {"capacity": 24},
                    # Bounded caches fill within the warm-up, so later growth is a leak.
                    "kv_budget_mb": KV_BUDGET_MB,
                    "trace_dir": str(self.traces),
                },
                "nodes": [{"name": n, "resources": {n: 0.5}} for n in NODES],
                "router": {
                    # Ray gives the head this resource: the router lives (and dies) there.
                    "resources": {"node:__internal_head__": 0.001},
                    "report_interval_s": REPORT_INTERVAL_S,
                    "lost_after_s": LOST_AFTER_S,
                    "restart_after_s": RESTART_AFTER_S,
                },
            },
            self.models,
        )

    # ----------------------------------------------------------------- machines

    def add_raylet(self, name: str) -> None:
        """Start ``name``'s raylet (again) in a new folder, with its resources."""
        self.add(name, resources={} if name == CLIENT else {name: 1}, num_cpus=int(name != CLIENT))

    def raylet_processes(self, name: str) -> list[psutil.Process]:
        return raylet_processes(self.dirs[name])

    def raylet_running(self, name: str) -> bool:
        return the_raylet(self.dirs[name]) is not None

    def kill_head(self) -> tuple[int, ...]:
        router = self.router_pid()
        return tuple(kill_head(self.name)) + ((router,) if router else ())

    def restart_head(self) -> None:
        restart_head(self.name)

    def processes(self) -> list[psutil.Process]:
        """Every process of the cluster: the head's and every raylet's."""
        procs = head_processes(self.name)
        for directory in list(self.dirs.values()):  # raylets come and go meanwhile
            procs += raylet_processes(directory)
        return procs

    def owned(self, pid: int | None, name: str) -> psutil.Process | None:
        """The process ``pid`` if it belongs to ``name``'s raylet, else None."""
        if pid is None or name not in self.dirs:
            return None
        return next((p for p in self.raylet_processes(name) if p.pid == pid), None)

    def actors_titled(self, title: str) -> list[psutil.Process]:
        """The cluster's worker processes whose title starts with ``title``."""
        found = []
        for proc in self.processes():
            with contextlib.suppress(psutil.Error):
                cmd = proc.cmdline()
                if cmd and cmd[0].startswith(title):
                    found.append(proc)
        return found

    # --------------------------------------------------------------- the fleet

    def node_status(self, name: str) -> NodeStatus | None:
        """The node's status, asked of it (its pid is NodeStatus.pid); None when it does
        not answer or does not serve."""
        try:
            status: NodeStatus = ray.get(self._actors[name].status.remote(), timeout=2.0)
        except Exception:
            return None
        return status if status.state == NodeState.SERVING and status.pid else None

    def kill_router(self) -> bool:
        try:
            ray.kill(self._actors["router"], no_restart=False)  # Ray restarts it
        except Exception as exc:
            log(f"chaos: could not kill the router: {type(exc).__name__}: {exc}")
            return False
        return True

    def router_pid(self) -> int | None:
        procs = self.actors_titled("ray::RouterActor")
        return procs[0].pid if len(procs) == 1 else None

    def close(self) -> list[str]:
        """Close the client (it tears the fleet down); what is still alive after."""
        leaked: list[str] = []
        if self.client is not None:
            self.client.close()
            self.client = None
            leaked = self._alive_actors()
        return leaked

    def _alive_actors(self, wait_s: float = 15.0) -> list[str]:
        """Actors Ray does not report dead, and processes of this fleet's actors still
        running, waiting up to ``wait_s`` for the ones just killed to go."""
        end = time.monotonic() + wait_s
        while True:
            actors = ray._private.state.actors()
            alive = [
                f"{a.get('Name') or a.get('ActorClassName') or actor_id} ({a.get('State')})"
                for actor_id, a in actors.items()
                if a.get("State") != "DEAD"
            ]
            alive += [
                f"process {p.pid} ({title})"
                for title in ("ray::NodeRuntime", "ray::RouterActor")
                for p in self.actors_titled(title)
            ]
            if not alive or time.monotonic() >= end:
                return sorted(alive)
            time.sleep(0.5)

    def shutdown(self) -> None:
        """Stop everything the fleet started: its raylets, its head and its Redis."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            if self.client is not None:
                self.client.close()
        self.stop()


class Controller:
    """Chaos events on a seeded schedule (see the module's text). The first ones are
    one of each kind, in a seeded order.

    Driven by :meth:`tick` from the main thread: what an event undoes later (a raylet
    started again, a SIGCONT, the head started again) is scheduled, not slept on."""

    def __init__(
        self, fleet: Fleet, kinds: tuple[str, ...], spare: tuple[str, ...], seed: int
    ) -> None:
        self.fleet = fleet
        self.kinds = kinds
        self.spare = spare
        self.rng = random.Random(f"{seed}/chaos")
        self.events: list[Event] = []
        self.errors: list[str] = []
        self.away: dict[str, Event] = {}  # nodes down or frozen, until they are back
        self._later: list[tuple[float, Callable[[], None]]] = []  # (when, what)
        self._head_down = False
        self._lock = threading.Lock()
        order = list(kinds)
        self.rng.shuffle(order)
        self._first = order
        self._next = math.inf
        self.until = 0.0
        self._kind: str | None = None  # the kind of the event that is due
        self._due = 0.0

    def start(self, t0: float, seconds: float, every_s: float) -> None:
        self._every = every_s
        self._next = t0 + self.rng.uniform(*FIRST_EVENT_S)
        self.until = t0 + max(seconds - QUIET_END_S, FIRST_EVENT_S[1])

    def targets(self) -> list[str]:
        return [n for n in NODES if n not in self.spare and n not in self.away]

    def tick(self) -> None:
        """Undo what is due; start the next event when the schedule says so."""
        now = time.monotonic()
        self._run_due(now)
        if now < self._next or now >= self.until or self._head_down:
            return
        if self._kind is None:
            self._kind = self._first.pop(0) if self._first else self.rng.choice(self.kinds)
            self._due = now
        try:
            done = self._attempt(self._kind, aim=now < self._due + AIM_S)
            if done is None:
                return  # waiting for a target holding work, or for the head's turn
            missed = not isinstance(done, Event) or done.kind != self._kind
            if missed and not any(e.kind == self._kind for e in self.snapshot()):
                self._first.insert(0, self._kind)  # its first time is still to come
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
        due = [item for item in self._later if item[0] <= now]
        self._later = [item for item in self._later if item[0] > now]
        for _, what in sorted(due, key=lambda item: item[0]):
            try:
                what()
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                log(f"chaos: undoing an event failed: {type(exc).__name__}: {exc}")

    def _attempt(self, kind: str, *, aim: bool) -> Event | None | bool:
        """One event of ``kind`` (another kind when none can be): the Event; None to
        wait (``aim``: no node holds work yet; a head restart: something is still down
        or frozen); False when nothing could be hit."""
        kinds = [kind, *(k for k in self.rng.sample(self.kinds, len(self.kinds)) if k != kind)]
        for k in kinds:
            if k == "head" and (self._later or self.away):
                if k == kind:
                    return None
                continue
            event = self._strike(k, aim=aim and k == kind)
            if event == "wait":
                return None
            if isinstance(event, Event):
                with self._lock:
                    self.events.append(event)
                pids = " ".join(map(str, event.pids)) or "-"
                log(f"chaos: {k} {event.target} (pids {pids}) {event.note}")
                return event
        return False

    def _strike(self, kind: str, *, aim: bool) -> Event | Literal["wait"] | None:
        if kind == "router":
            return self._kill_router()
        if kind == "head":
            return self._kill_head()
        target = self._target(aim=aim)
        if target is None or target == "wait":
            return target
        act = {
            "node": self._kill_node,
            "raylet": self._kill_raylet,
            "node-freeze": self._freeze_node,
            "raylet-freeze": self._freeze_raylet,
        }[kind]
        return act(*target)

    def _target(self, *, aim: bool) -> tuple[str, int | None] | Literal["wait"] | None:
        """The node to hit (name, pid): of the nodes that may be hit, the one holding
        the most requests. "wait" while none holds AIM_WORK requests yet (``aim``);
        None when there is none to hit."""
        names = self.targets()
        self.rng.shuffle(names)  # a seeded choice among equals
        held: list[tuple[int, str, int | None]] = []
        for name in names:
            status = self.fleet.node_status(name)
            if status is None:
                held.append((-1, name, None))
                continue
            work = status.queue_length + sum(status.paused.values())
            work += len(status.running.request_ids) if status.running is not None else 0
            held.append((work, name, int(status.pid)))
        if not held:
            return None
        work, name, pid = max(held, key=lambda h: h[0])
        if aim and work < AIM_WORK:
            return "wait"
        return name, pid

    # --------------------------------------------------------------------- kills

    def _kill_node(self, name: str, pid: int | None) -> Event | None:
        proc = self.fleet.owned(pid, name)
        if proc is not None and _signal([proc], signal.SIGKILL):
            return Event(time.time(), "node", name, (proc.pid,))
        return None

    def _kill_router(self) -> Event | None:
        pid = self.fleet.router_pid()
        if not self.fleet.kill_router():
            return None
        return Event(time.time(), "router", "router", (pid,) if pid else ())

    def _kill_raylet(self, name: str, pid: int | None) -> Event:
        pids = self.fleet.kill(name)
        down = self.rng.uniform(*DOWN_S)
        event = Event(time.time(), "raylet", name, pids, note=f"down {down:.1f} s")
        self.away[name] = event
        self._later_do(down, lambda: self._restore(name, event))
        return event

    def _restore(self, name: str, event: Event) -> None:
        """Start ``name``'s raylet again, with the same resources."""
        try:
            self.fleet.add_raylet(name)
            if event.kind == "raylet":
                event.back_at = time.time()
            log(f"chaos: raylet {name} started again")
        finally:
            self.away.pop(name, None)

    def _kill_head(self) -> Event:
        self._head_down = True
        pids = self.fleet.kill_head()
        down = self.rng.uniform(*HEAD_DOWN_S)
        event = Event(time.time(), "head", "head", pids, note=f"down {down:.1f} s")
        self._later_do(down, lambda: self._restart_head(event))
        return event

    def _restart_head(self, event: Event) -> None:
        """Start the head again; as an operator would, once more when a start fails (on
        a busy machine its raylet may not register in time)."""
        try:
            for attempt in range(1, HEAD_STARTS + 1):
                try:
                    self.fleet.restart_head()
                    break
                except FleetStartError as exc:
                    log(f"chaos: starting the head again failed: {str(exc)[:300]}")
                    if attempt == HEAD_STARTS:
                        raise
                    event.note += f"; start {attempt} failed, started again"
            event.back_at = time.time()
            log(f"chaos: head started again ({event.back_at - event.at:.1f} s after the kill)")
        finally:
            self._head_down = False

    # ------------------------------------------------------------------- freezes

    def _freeze(self, kind: str, name: str, procs: list[psutil.Process], bands: Any) -> Event:
        """SIGSTOP ``procs``; SIGCONT them after a duration drawn from one of ``bands``."""
        band, (low, high) = self.rng.choice(bands)
        frozen_s = self.rng.uniform(low, high)
        _signal(procs, signal.SIGSTOP)
        pids = tuple(p.pid for p in procs)
        event = Event(time.time(), kind, name, pids, note=f"frozen {frozen_s:.1f} s ({band})")
        self.away[name] = event
        self._later_do(frozen_s, lambda: self._thaw(event, procs))
        return event

    def _freeze_node(self, name: str, pid: int | None) -> Event | None:
        proc = self.fleet.owned(pid, name)
        if proc is None:
            return None
        return self._freeze("node-freeze", name, [proc], NODE_FREEZE_S)

    def _freeze_raylet(self, name: str, pid: int | None) -> Event:
        procs = self.fleet.raylet_processes(name)
        return self._freeze("raylet-freeze", name, procs, RAYLET_FREEZE_S)

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
        (what is left of the old one is killed). One that still runs after
        EXITED_WITHIN_S serves on."""
        name = event.target
        if self.fleet.raylet_running(name):
            if time.monotonic() - since < EXITED_WITHIN_S:
                self._later_do(0.5, lambda: self._after_thaw(event, since))
                return
            event.note += "; it serves on"
            self.away.pop(name, None)
            return
        event.note += "; declared dead, it exited: started again"
        self.fleet.kill(name)
        self._restore(name, event)
