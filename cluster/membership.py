"""Pool membership: a node actor on every Ray node a pool selects, following the cluster.

The router reconciles, it does not script: every ``router.membership.interval_s`` it
reads Ray's node table (:class:`NodeTable`) and compares what should run (every pool x
every alive Ray node its selector matches, :func:`wanted`) with what does (the pool
members it knows), and takes each member one step towards it:

- a device that matches and has no member: create its node actor pinned to that Ray
  node (or adopt the one a previous router created: actor names are deterministic),
  start it, and add it to the fleet once it serves (``starting`` -> ``serving``);
- a member whose Ray node is dead, or was replaced by a newer Ray node of the same
  device (it came back): it leaves the fleet and its actor is killed (``left``); the
  next step starts it again on the new Ray node under the same name;
- a member whose actor could not be created or started is ``failed``, with the reason,
  and is tried again after a backoff (doubling up to ``retry_max_s``).

A restarted router starts from the node table and the actors it finds, so it simply
continues. Ray is behind two small protocols (:class:`NodeTable`, :class:`MemberActors`;
the Ray implementations are in :mod:`cluster.nodes`), so the reconcile logic runs on a
fake table and a fake clock in tests.

A device is named by its ``edgefleet.io/device`` label (see :mod:`edgefleet.labels`);
when several alive Ray nodes carry one device name, the newest is that device.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from cluster.control import NodeControl
from edgefleet.clock import Clock
from edgefleet.config import FleetConfig, NodeSpec
from edgefleet.labels import Selector, device_name
from edgefleet.messages import DeviceStatus, NodeState, NodeStatus, PoolStatus
from edgefleet.providers import missing_strict_provider

if TYPE_CHECKING:
    from cluster.metrics import RouterMetrics

log = logging.getLogger(__name__)

NODE_START_TIMEOUT_S = 300.0  # a node loads, warms up and measures its models
LEFT_KEPT_S = 3600.0  # a device that left is listed this long (until it comes back)
LEFT_CHECK_S = 60.0  # devices listed past LEFT_KEPT_S are looked for this often


@dataclass(frozen=True)
class RayNodeRow:
    """One Ray node as Ray's node table has it."""

    node_id: str  # hex
    alive: bool
    labels: Mapping[str, str]
    started_at: float  # unix seconds
    ended_at: float = 0.0  # unix seconds; 0 while alive


class NodeTable(Protocol):
    """Ray's node table."""

    async def read(self) -> Sequence[RayNodeRow]:
        """Every Ray node Ray knows of, alive or dead. MUST return or raise within its
        own timeout."""
        ...


class MemberActors(Protocol):
    """Creates and ends pool members' node actors."""

    async def create(self, spec: NodeSpec) -> NodeControl:
        """The node actor of ``spec``, pinned to the Ray node ``spec.ray_node``: created,
        or the one already running under its name. MUST return or raise within its own
        timeout; the actor may still be starting (call ``start``)."""
        ...

    async def remove(self, spec: NodeSpec) -> None:
        """End ``spec``'s node actor for good (none left: nothing to do). MUST return or
        raise within its own timeout."""
        ...


class Members(Protocol):
    """The fleet's nodes as membership changes them (the router)."""

    def add_member(self, spec: NodeSpec, handle: NodeControl, report: NodeStatus) -> None:
        """``spec``'s node serves (``report`` says so): into the fleet, watched."""
        ...

    def drop_member(self, name: str) -> None:
        """Out of the fleet and no longer watched (nothing to do for an unknown name)."""
        ...


class DeviceState(enum.StrEnum):
    STARTING = "starting"  # its node actor is being created and started
    SERVING = "serving"  # its node is in the fleet (health: the node's own report)
    FAILED = "failed"  # could not be created or started: tried again after a backoff
    LEFT = "left"  # its Ray node is dead, or the device came back as a new Ray node


D = DeviceState
DEVICE_MOVES: Mapping[DeviceState, frozenset[DeviceState]] = {
    D.STARTING: frozenset({D.SERVING, D.FAILED, D.LEFT}),
    D.SERVING: frozenset({D.LEFT}),
    D.FAILED: frozenset({D.STARTING, D.LEFT}),
    D.LEFT: frozenset({D.STARTING}),
}
"""The moves a pool member's state may make, written down once."""
del D


@dataclass(frozen=True)
class Wanted:
    """A device a pool should have a node on now: its newest alive Ray node."""

    pool: str
    device: str
    row: RayNodeRow
    first_seen: float  # unix: the earliest start of its Ray nodes still in Ray's table

    @property
    def name(self) -> str:
        return f"{self.pool}/{self.device}"


@dataclass(frozen=True)
class Gone:
    """A device of a pool with no alive Ray node in Ray's table, only dead ones."""

    pool: str
    device: str
    first_seen: float
    last_started: float
    left_at: float


Match = tuple[str, str, str]  # a pool, the device, the member's name (POOL/DEVICE)


def matches(pools: Sequence[tuple[str, Selector]], row: RayNodeRow) -> tuple[Match, ...]:
    """The pools whose selector ``row``'s labels match, with the device it is."""
    out = []
    for pool, selector in pools:
        if selector.matches(row.labels):
            device = device_name(row.labels, row.node_id)
            out.append((pool, device, f"{pool}/{device}"))
    return tuple(out)


def wanted(
    pools: Sequence[tuple[str, Selector]],
    rows: Iterable[RayNodeRow],
    memo: dict[str, tuple[Match, ...]] | None = None,
) -> tuple[dict[str, Wanted], dict[str, Gone]]:
    """What should run (member name -> its device's newest alive Ray node), and the
    devices the table knows only dead Ray nodes of: the desired state. ``memo`` holds
    each Ray node's :func:`matches` by node id between calls (a Ray node's labels never
    change); it is filled, and kept to the nodes of ``rows``."""
    held = memo if memo is not None else {}
    kept: dict[str, tuple[Match, ...]] = {}
    groups: dict[str, list[RayNodeRow]] = {}
    devices: dict[str, tuple[str, str]] = {}
    for row in rows:
        hits = held.get(row.node_id)
        if hits is None:
            hits = matches(pools, row)
        kept[row.node_id] = hits
        for pool, device, name in hits:
            group = groups.get(name)
            if group is None:
                groups[name] = [row]
                devices[name] = (pool, device)
            else:
                group.append(row)
    if memo is not None:
        memo.clear()
        memo.update(kept)
    want: dict[str, Wanted] = {}
    gone: dict[str, Gone] = {}
    for name, group in groups.items():
        pool, device = devices[name]
        if len(group) == 1:  # most devices: one Ray node in the table
            (row,) = group
            if row.alive:
                want[name] = Wanted(pool, device, row, row.started_at)
            else:
                gone[name] = Gone(pool, device, row.started_at, row.started_at, row.ended_at)
            continue
        first = min(r.started_at for r in group)
        alive = [r for r in group if r.alive]
        if alive:
            want[name] = Wanted(pool, device, max(alive, key=_started), first)
        else:
            last = max(r.started_at for r in group)
            gone[name] = Gone(pool, device, first, last, max(r.ended_at for r in group))
    return want, gone


def _started(row: RayNodeRow) -> float:
    return row.started_at


@dataclass
class Member:
    """A pool's device as the router knows it."""

    pool: str
    device: str
    state: DeviceState = DeviceState.STARTING
    spec: NodeSpec | None = None  # of its current (or last) Ray node
    first_joined: float = 0.0  # unix
    joined_at: float = 0.0  # unix: when its current (or last) Ray node started
    left_at: float | None = None  # unix
    joins: int = 0  # times this router saw it join (its first join included)
    failures: int = 0  # in a row, since it last served
    retry_at: float = 0.0  # on the router's clock
    reason: str = ""  # why it failed
    task: asyncio.Task[None] | None = None  # its start, while one runs

    @property
    def name(self) -> str:
        return f"{self.pool}/{self.device}"

    @property
    def ray_node(self) -> str | None:
        return None if self.spec is None else self.spec.ray_node

    def move(self, to: DeviceState) -> None:
        if to not in DEVICE_MOVES[self.state]:
            raise ValueError(f"pool member {self.name}: {self.state.name} -> {to.name}")
        self.state = to


class Membership:
    """The reconcile loop of one fleet's pools (see the module's text)."""

    def __init__(
        self,
        config: FleetConfig,
        table: NodeTable,
        actors: MemberActors,
        members: Members,
        *,
        clock: Clock,
        metrics: RouterMetrics,
        wall: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self._cfg = config.router.membership
        self._pools = [(p.name, p.matcher()) for p in config.pools]
        self._table = table
        self._actors = actors
        self._members_out = members
        self._clock = clock
        self._wall = wall
        self._rng = rng or random.Random()
        self._metrics = metrics
        self.members: dict[str, Member] = {}
        self.failures = 0  # reads of the node table that failed in a row
        self._loop: asyncio.Task[None] | None = None
        self._removals: set[asyncio.Task[None]] = set()
        # Devices by (pool, state), kept as members move; those changed since exported.
        self._counts: Counter[tuple[str, DeviceState]] = Counter()
        self._changed: set[tuple[str, DeviceState]] = {
            (p, state) for p, _ in self._pools for state in DeviceState
        }
        # The table as last compared (its rows kept: their ids name them) and the
        # desired state computed from it; when a read brings the same rows and no member
        # is due (a retry, an expiry), a pass has nothing to do.
        self._seen: frozenset[int] = frozenset()
        self._rows: Sequence[RayNodeRow] = ()
        self._matches: dict[str, tuple[Match, ...]] = {}  # by Ray node id: see wanted()
        self._want: dict[str, Wanted] = {}
        self._gone: dict[str, Gone] = {}
        self._due = 0.0  # on the router's clock: the next retry or expiry check
        self._stopping = False
        self._publish()

    # ------------------------------------------------------------------- the loop

    def run(self) -> None:
        """Reconcile every ``interval_s`` on a task of its own; after a failed read of
        the node table, again after a backoff (doubling up to ``retry_max_s``, with
        jitter). Supervised: a loop that ends by surprise is logged and started again."""

        async def loop() -> None:
            while not self._stopping:
                await self.step()
                await asyncio.sleep(self._delay())

        def ended(task: asyncio.Task[None]) -> None:
            if self._stopping or task.cancelled():
                return
            log.error("pool membership stopped; restarting it", exc_info=task.exception())
            self.run()

        self._loop = asyncio.create_task(loop(), name="membership")
        self._loop.add_done_callback(ended)

    async def step(self) -> None:
        """One reconcile; a table that cannot be read is logged (once in a row) and
        counted in ``failures``, which backs the loop off."""
        try:
            await self.reconcile()
        except Exception as exc:  # Ray's table out of reach (a head restarting, say)
            self.failures += 1
            if self.failures == 1:
                log.warning("pool membership: Ray's node table: %s: %s", type(exc).__name__, exc)
            return
        if self.failures:
            log.info(
                "pool membership: Ray's node table read again after %d failures", self.failures
            )
        self.failures = 0

    def _delay(self) -> float:
        if not self.failures:
            return self._cfg.interval_s
        backoff = min(self._cfg.retry_max_s, self._cfg.interval_s * 2**self.failures)
        return backoff * (0.5 + self._rng.random())

    async def stop(self) -> None:
        """Stop reconciling and starting members; the members keep running."""
        self._stopping = True
        tasks = [m.task for m in self.members.values() if m.task is not None]
        tasks += [self._loop] if self._loop is not None else []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, *self._removals, return_exceptions=True)

    # ---------------------------------------------------------------- one pass

    async def reconcile(self) -> None:
        """Read Ray's node table once and take every member one step towards it. Raises
        when the table cannot be read (nothing changes then)."""
        self._metrics.refresh()  # the pools' gauges, even while nothing changes
        rows = await self._table.read()
        now = self._clock.now()
        seen = frozenset(map(id, rows))
        if seen != self._seen:
            self._seen, self._rows = seen, rows
            self._want, self._gone = wanted(self._pools, rows, self._matches)
        elif now < self._due:
            return  # the same table, and no member due for anything: nothing to do
        want, gone = self._want, self._gone
        for name, member in self.members.items():
            if member.state is DeviceState.LEFT:
                continue
            target = want.get(name)
            if target is None or target.row.node_id != member.ray_node:
                ended = gone[name].left_at if name in gone else 0.0
                self._leave(member, ended or self._wall())
        for name, target in want.items():
            held = self.members.get(name)
            if held is None:
                member = self._add(Member(target.pool, target.device))
                member.first_joined = target.first_seen
                self._start(member, target)
            elif held.state is DeviceState.LEFT or (
                held.state is DeviceState.FAILED and now >= held.retry_at
            ):
                self._move(held, DeviceState.STARTING)
                self._start(held, target)
        wall = self._wall()
        for name, g in gone.items():  # known to Ray as gone (lately), not to this router yet
            if name not in self.members and wall - g.left_at <= LEFT_KEPT_S:
                member = self._add(Member(g.pool, g.device, DeviceState.LEFT))
                member.first_joined, member.joined_at, member.left_at = (
                    g.first_seen,
                    g.last_started,
                    g.left_at,
                )
        for name in [
            n
            for n, m in self.members.items()
            if m.state is DeviceState.LEFT and wall - (m.left_at or wall) > LEFT_KEPT_S
        ]:
            member = self.members.pop(name)
            self._count(member.pool, member.state, -1)
        self._due = now + LEFT_CHECK_S
        for member in self.members.values():
            if member.state is DeviceState.FAILED:
                self._due = min(self._due, member.retry_at)
        self._publish()

    def _add(self, member: Member) -> Member:
        self.members[member.name] = member
        self._count(member.pool, member.state, 1)
        return member

    def _move(self, member: Member, to: DeviceState) -> None:
        self._count(member.pool, member.state, -1)
        member.move(to)
        self._count(member.pool, to, 1)

    def _count(self, pool: str, state: DeviceState, n: int) -> None:
        self._counts[(pool, state)] += n
        self._changed.add((pool, state))

    def _start(self, member: Member, target: Wanted) -> None:
        """Create (or adopt) and start ``member``'s node on ``target``'s Ray node, on a
        task of its own: a slow start holds up nobody."""
        spec = self.config.member_spec(target.pool, target.device, target.row.node_id)
        retry = member.spec is not None and member.spec.ray_node == spec.ray_node
        member.spec = spec
        member.joined_at = target.row.started_at
        member.left_at = None
        lacking = missing_strict_provider(spec.models, target.row.labels)
        if lacking:  # known from the device's labels: no actor to start and see fail
            self._failed(member, spec, lacking)
            return
        member.task = asyncio.create_task(
            self._bring_up(member, spec, retry), name=f"join-{member.name}"
        )

    async def _bring_up(self, member: Member, spec: NodeSpec, retry: bool) -> None:
        try:
            if retry:  # the failed actor, if any, goes first: a new one under its name
                await self._actors.remove(spec)
            handle = await self._actors.create(spec)
            report = await asyncio.wait_for(handle.start(), NODE_START_TIMEOUT_S)
            if report.state is not NodeState.SERVING:
                raise RuntimeError(
                    f"it reports {report.state}: {report.failure or 'no reason given'}"
                )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failed(member, spec, exc)
        else:
            self._serving(member, spec, handle, report)
        finally:
            member.task = None

    def _serving(
        self, member: Member, spec: NodeSpec, handle: NodeControl, report: NodeStatus
    ) -> None:
        if member.spec is not spec or member.state is not DeviceState.STARTING:
            return  # it left meanwhile
        self._move(member, DeviceState.SERVING)
        member.failures = 0
        member.reason = ""
        member.joins += 1
        rejoin = member.joins > 1
        log.info(
            "pool %s: device %s %s (Ray node %s)",
            member.pool,
            member.device,
            "came back" if rejoin else "joined",
            spec.ray_node,
        )
        self._metrics.device_change(member.pool, "joined")
        self._members_out.add_member(spec, handle, report)
        self._publish()

    def _failed(self, member: Member, spec: NodeSpec, exc: Exception) -> None:
        if member.spec is not spec or member.state is not DeviceState.STARTING:
            return
        self._move(member, DeviceState.FAILED)
        member.failures += 1
        member.reason = _one_line(exc)
        wait = min(self._cfg.retry_max_s, self._cfg.retry_s * 2 ** (member.failures - 1))
        member.retry_at = self._clock.now() + wait * (0.5 + self._rng.random())
        self._due = min(self._due, member.retry_at)
        log.warning(
            "pool %s: device %s did not start (%s); trying again in %.0f s",
            member.pool,
            member.device,
            member.reason,
            wait,
        )
        self._publish()

    def _leave(self, member: Member, at: float) -> None:
        """``member``'s Ray node is gone (or replaced): out of the fleet, its actor
        ended in the background."""
        if member.task is not None:
            member.task.cancel()
            member.task = None
        was = member.state
        self._move(member, DeviceState.LEFT)
        member.left_at = at
        self._members_out.drop_member(member.name)
        if was is DeviceState.SERVING:
            log.info(
                "pool %s: device %s left (Ray node %s)", member.pool, member.device, member.ray_node
            )
            self._metrics.device_change(member.pool, "left")
        if member.spec is not None:
            task = asyncio.create_task(self._remove(member.spec))
            self._removals.add(task)
            task.add_done_callback(self._removals.discard)

    async def _remove(self, spec: NodeSpec) -> None:
        try:
            await self._actors.remove(spec)
        except Exception as exc:  # its Ray node is dead: so is the actor, most likely
            log.debug("pool member %s: ending its actor: %s", spec.name, exc)

    # ---------------------------------------------------------------- status

    def status(self) -> tuple[PoolStatus, ...]:
        """Every pool with its devices, by name."""
        wall = self._wall()
        devices: dict[str, list[DeviceStatus]] = {p.name: [] for p in self.config.pools}
        for name in sorted(self.members):
            m = self.members[name]
            devices[m.pool].append(
                DeviceStatus(
                    node=m.name,
                    device=m.device,
                    state=str(m.state),
                    ray_node=m.ray_node or "",
                    age_s=max(0.0, wall - m.first_joined),
                    joined_s=max(0.0, wall - m.joined_at),
                    joins=m.joins,
                    reason=m.reason,
                    left_s=None if m.left_at is None else max(0.0, wall - m.left_at),
                )
            )
        return tuple(
            PoolStatus(p.name, _selector_text(p.selector), tuple(devices[p.name]))
            for p in self.config.pools
        )

    def _publish(self) -> None:
        """Devices per pool and state, to the metrics (only what changed)."""
        for pool, state in self._changed:
            self._metrics.pool_devices(pool, str(state), self._counts[(pool, state)])
        self._changed.clear()


def _selector_text(selector: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in selector.items())


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1]}" if lines else type(exc).__name__
