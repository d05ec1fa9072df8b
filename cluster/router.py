"""The fleet router: the placement authority, off the data path.

One router per fleet, a named detached async Ray actor. It keeps the fleet's
membership and health (polling every node's status: a node that died is lost at once;
one alive but silent for ``router.lost_after_s``, or whose engine is stuck, is
unresponsive, and after ``router.restart_after_s`` of that it is killed for Ray to
start it again in place), publishes the resulting view to
every caller that places requests (:class:`cluster.dispatch.Dispatcher`, inside
``FleetClient``), gathers their counters into fleet-wide ones, and forwards control
calls (cancel, lifecycle events). Requests and their payloads go straight from callers
to nodes: the router never holds one, so it is not the fleet's ceiling, and a router
restart loses nothing in flight.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

from cluster.control import NodeControl, NodeEntry
from cluster.dispatch import FleetView, NodeGone, NodeReport
from cluster.membership import NODE_START_TIMEOUT_S, MemberActors, Membership, NodeTable
from cluster.metrics import RouterMetrics
from cluster.names import NAMESPACE, actor_name
from cluster.nodes import RayMemberActors, RayNode, RayNodeTable
from cluster.rollout import Rollout, Rollouts, Version, rollout_of
from edgefleet.clock import Clock, MonotonicClock
from edgefleet.config import FleetConfig, NodeSpec
from edgefleet.errors import InvalidInput, NodeLost, RolloutRefused
from edgefleet.messages import FleetStatus, NodeState, NodeStatus

log = logging.getLogger(__name__)

CALLER_SEEN_S = 10.0  # a caller that asked for the view this recently is counted active
CALLER_COUNTS_KEPT_S = 3600.0  # a caller's counts are known this long after it last sent them
CALLER_REPORTS_KEPT = 4  # what a caller reports counts for this many report intervals


class Router:
    """Membership, health and the fleet view for one fleet's callers."""

    def __init__(
        self,
        config: FleetConfig,
        handles: Mapping[str, NodeControl],
        *,
        clock: Clock | None = None,
        metrics: RouterMetrics | None = None,
        table: NodeTable | None = None,
        actors: MemberActors | None = None,
        store: Any = None,
    ) -> None:
        """``table`` and ``actors``: Ray's node table and the pool members' actors (see
        :mod:`cluster.membership`); without them the router keeps no pools. ``store``:
        the fleet's store actor, where the router keeps the versions rollouts made."""
        self.config = config
        self._metrics = metrics or RouterMetrics(config.fleet.name, config.priorities)
        self._metrics.watching(spec.name for spec in config.node_specs())
        self._clock = clock or MonotonicClock()
        self._nodes = {
            spec.name: NodeEntry(spec, handles[spec.name]) for spec in config.node_specs()
        }
        # Fleet-wide: the router's own counts (nodes lost, joined, rejoined) and every
        # caller's, added up by _merge.
        self._counters: Counter[str] = Counter()
        self._caller_counts: dict[str, tuple[float, dict[str, int]]] = {}  # see _merge
        self._callers: dict[str, float] = {}  # caller id -> when it last fetched the view
        self._shed_waiting: dict[str, int] = {}  # caller id -> its shed requests still out
        self._placed: dict[str, Mapping[int, int]] = {}  # caller id -> its last placements
        self._watchers: dict[str, asyncio.Task[None]] = {}  # one polling task per node
        self._starting: dict[str, asyncio.Task[NodeStatus]] = {}  # nodes being started
        self._restarting: dict[str, asyncio.Task[None]] = {}  # nodes being killed
        self._stopping = False
        self._started: asyncio.Future[None] | None = None
        # Pool members come and go: callers are sent their specs when this changes.
        self._members_version = 0
        self._membership: Membership | None = None
        if config.pools and table is not None and actors is not None:
            self._metrics.watching_pools(p.name for p in config.pools)
            self._membership = Membership(
                config, table, actors, self, clock=self._clock, metrics=self._metrics
            )
        self.rollouts = Rollouts(self, store)
        scorers, picker = config.router.placement.params(config.priorities).resolved()
        weights = ", ".join(f"{n} {w:g}" for n, w in scorers.items()) or "none"
        self._placement = f"scorers: {weights}; picker: {picker}"

    # ------------------------------------------------------------------- membership

    async def start(self) -> FleetStatus:
        """Poll every node once, then keep polling each in the background; reconcile the
        pools once (their members start in the background), then keep reconciling.
        Idempotent; a node that fails or hangs does not hold up the others or the start."""
        if self._started is None:
            self._started = asyncio.get_running_loop().create_future()
            try:
                await asyncio.gather(*(self._poll(e) for e in self._nodes.values()))
                if self._membership is not None:
                    await self._membership.step()
                await self.rollouts.load()
            finally:
                for entry in list(self._nodes.values()):
                    self._watch(entry)
                if self._membership is not None:
                    self._membership.run()
                self._started.set_result(None)
        await self._started
        return self.status_now()

    async def stop(self) -> None:
        """Stop polling the nodes and following the pools (their members keep running)."""
        self._stopping = True
        if self._membership is not None:
            await self._membership.stop()
        tasks = [*self._watchers.values(), *self._starting.values(), *self._restarting.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _watch(self, entry: NodeEntry) -> None:
        """Poll ``entry``'s node every report interval, on its own task: a node slow to
        answer or to start delays nobody else. Supervised: a task that ends by surprise
        is logged and started again."""

        async def loop() -> None:
            # Not `while True`: on Python 3.11 asyncio.wait_for can swallow the
            # cancellation stop() sends when the call it waits for ends at that moment.
            while not self._stopping:
                await asyncio.sleep(self.config.router.report_interval_s)
                await self._poll(entry)

        def ended(task: asyncio.Task[None]) -> None:
            if self._stopping or task.cancelled() or self._nodes.get(entry.spec.name) is not entry:
                return
            log.error(
                "polling of node %s stopped; restarting it",
                entry.spec.name,
                exc_info=task.exception(),
            )
            self._watch(entry)

        task = asyncio.create_task(loop(), name=f"watch-{entry.spec.name}")
        task.add_done_callback(ended)
        self._watchers[entry.spec.name] = task

    async def _poll(self, entry: NodeEntry) -> None:
        """Ask one node for its report. Never raises: a dead node is lost at once, a
        silent one unresponsive once it has been silent for ``lost_after_s``, one that
        fails in any other way (its start failed, an unexpected error) is not healthy
        until it reports again."""
        cfg = self.config.router
        try:
            report = await asyncio.wait_for(
                entry.handle.status(), min(cfg.probe_timeout_s, cfg.lost_after_s)
            )
        except NodeGone:
            self._lose(entry)
            return
        except TimeoutError:  # unresponsive once silent too long, unless merely busy
            if self._clock.now() - entry.reported_at >= cfg.lost_after_s:
                await self._silent(entry)
            return
        except Exception as exc:  # its start failed, or worse: out of service for now
            if entry.healthy or entry.report is None:
                log.warning("node %s: %s: %s", entry.spec.name, type(exc).__name__, exc)
            self._lose(entry)
            return
        first = entry.report is None
        self._keep(entry, report)
        if report.state in (NodeState.STARTING, NodeState.FAILED, NodeState.STUCK):
            if report.state == NodeState.STUCK:  # its engine hangs: a restart is the cure
                self._out(entry, f"is stuck: {report.failure}")
                return
            self._lose(entry)
            if report.state == NodeState.STARTING:  # restarted by Ray: bring it back into service
                self._bring_up(entry)
            return
        if entry.out_since is not None:
            log.info("node %s answers again", entry.spec.name)
            entry.out_since = None
            self._metrics.node_unresponsive(entry.spec.name, False)
        if not entry.healthy:
            self._counters["joined" if first else "rejoined"] += 1
        entry.healthy = True
        self._metrics.node_health(entry.spec.name, True)
        self._metrics.refresh()
        self.rollouts.reconcile(entry)

    async def _silent(self, entry: NodeEntry) -> None:
        """``entry``'s node has not reported for ``lost_after_s``: unresponsive, unless
        its process answers a probe within ``lost_after_s`` more (it is flooded with
        calls, which delay its reports and its answers: its last report stands)."""
        try:
            alive = await entry.handle.alive(self.config.router.lost_after_s)
        except NodeGone:
            self._lose(entry)
            return
        except Exception as exc:
            log.warning("node %s: probe failed: %s: %s", entry.spec.name, type(exc).__name__, exc)
            alive = False
        if not alive:
            self._out(entry, f"has not reported for {self.config.router.lost_after_s:g} s")

    def _out(self, entry: NodeEntry, why: str) -> None:
        """``entry``'s node is alive but out of service (silent, or stuck): callers stop
        sending to it; after ``restart_after_s`` of that it is killed, and Ray starts it
        again."""
        name = entry.spec.name
        now = self._clock.now()
        if entry.out_since is None:
            log.warning("node %s %s: unresponsive", name, why)
            entry.out_since = now
            self._counters["unresponsive"] += 1
            self._metrics.node_unresponsive(name, True)
        if entry.healthy:
            entry.healthy = False
            self._metrics.node_health(name, False)
        after = self.config.router.restart_after_s
        if after is not None and now - entry.out_since >= after and name not in self._restarting:
            self._restart(entry)

    def _restart(self, entry: NodeEntry) -> None:
        """Kill ``entry``'s node (bounded, on its own task); Ray starts it again and
        the router brings it back into service as any node Ray restarted."""
        name = entry.spec.name
        log.warning("node %s: restarting it", name)
        self._counters["restarted"] += 1
        self._metrics.node_restarted(name)
        entry.out_since = self._clock.now()  # the next restart, if any, after as long again

        def done(task: asyncio.Task[None]) -> None:
            self._restarting.pop(name, None)
            if not task.cancelled() and task.exception() is not None:
                log.warning("node %s could not be restarted: %s", name, task.exception())

        timeout = self.config.router.probe_timeout_s
        task = asyncio.create_task(asyncio.wait_for(entry.handle.restart(), timeout))
        task.add_done_callback(done)
        self._restarting[name] = task

    def _keep(self, entry: NodeEntry, report: NodeStatus) -> None:
        """Keep ``report`` as the node's latest, dated now: callers age its work from then."""
        entry.report, entry.reported_at = report, self._clock.now()

    def _bring_up(self, entry: NodeEntry) -> None:
        """Start a node Ray restarted, on its own task (loading its models takes a
        while); it rejoins when it reports serving."""
        name = entry.spec.name
        if name in self._starting:
            return

        def started(task: asyncio.Task[NodeStatus]) -> None:
            self._starting.pop(name, None)
            if not task.cancelled() and task.exception() is not None:
                log.warning("node %s did not start: %s", name, task.exception())

        task = asyncio.create_task(asyncio.wait_for(entry.handle.start(), NODE_START_TIMEOUT_S))
        task.add_done_callback(started)
        self._starting[name] = task

    def _lose(self, entry: NodeEntry) -> None:
        """Out of service: its actor died (or it failed, or is starting again). An
        unresponsive node that turns out dead is lost too."""
        if entry.healthy or entry.out_since is not None:
            entry.healthy = False
            self._counters["nodes_lost"] += 1
            self._metrics.node_lost(entry.spec.name)
        if entry.out_since is not None:
            entry.out_since = None
            self._metrics.node_unresponsive(entry.spec.name, False)

    # ------------------------------------------------------------------- pools

    def add_member(self, spec: NodeSpec, handle: NodeControl, report: NodeStatus) -> None:
        """A pool member's node serves: into the fleet (callers learn of it with their
        next view), polled as every node is."""
        self.drop_member(spec.name)
        entry = self._nodes[spec.name] = NodeEntry(spec, handle)
        self._metrics.watching([spec.name])
        self._members_version += 1
        self._keep(entry, report)
        entry.healthy = True
        self._counters["joined"] += 1
        self._metrics.node_health(spec.name, True)
        if self._started is not None and self._started.done() and not self._stopping:
            self._watch(entry)  # (before that, start() watches every node it holds)

    def drop_member(self, name: str) -> None:
        """A pool member left: out of the fleet (its callers place what it held again,
        as after a node loss), no longer polled."""
        entry = self._nodes.get(name)
        if entry is None or entry.spec.pool is None:
            return
        del self._nodes[name]
        self._members_version += 1
        for tasks in (self._watchers, self._starting, self._restarting):
            task = tasks.pop(name, None)
            if task is not None:
                task.cancel()
        if entry.healthy:
            self._metrics.node_health(name, False)
        if entry.out_since is not None:
            self._metrics.node_unresponsive(name, False)

    def members(self) -> tuple[NodeSpec, ...]:
        """The specs of the pool members in the fleet now."""
        return tuple(e.spec for e in self._nodes.values() if e.spec.pool is not None)

    # ------------------------------------------------------------------- callers

    def _merge(self, caller: str, counted: Mapping[str, int] | None, now: float) -> None:
        """Add ``caller``'s counts to the fleet-wide ones, once, however often they come.

        The contract: a caller sends its id and everything it counted since it was made
        (totals, which only grow), never what it counted since it last sent. The router
        adds what a delivery has beyond the largest totals it holds of that caller, key
        by key. So a delivery sent again because its reply was lost (with more counts
        or not) and deliveries that overtake each other add each count once. A caller
        with no id sends none. The router holds a caller's totals for
        CALLER_COUNTS_KEPT_S after its last delivery: the counts of a caller silent for
        longer would be added again. A restarted router counts from zero, and then from
        the start of each caller still running."""
        if not caller or counted is None:
            return
        held = self._caller_counts.get(caller, (now, {}))[1]
        for key, total in counted.items():
            new = total - held.get(key, 0)
            if new > 0:
                self._counters[key] += new
                held[key] = total
        self._caller_counts[caller] = (now, held)
        stale = [c for c, (t, _) in self._caller_counts.items() if now - t > CALLER_COUNTS_KEPT_S]
        for c in stale:
            del self._caller_counts[c]

    def fleet_view(
        self,
        caller: str = "",
        counted: Mapping[str, int] | None = None,
        shed_waiting: int = 0,
        placed: Mapping[int, int] | None = None,
        members_seen: int = 0,
    ) -> FleetView:
        """The latest report and health of every node, for a caller that places
        requests; ``counted`` is everything that caller counted since it was made (see
        :meth:`_merge`), ``shed_waiting`` the requests it shed that are still to come
        back and ``placed`` the requests it placed since it last asked, by priority. The
        view carries the other callers' sums: shed requests come back in turn
        fleet-wide, and a caller among many widens its choice of near-best nodes.
        ``members_seen``: the version of the pool members the caller holds; the view
        carries the members' specs only when they changed since (a static fleet's never
        do)."""
        now = self._clock.now()
        if caller:
            self._callers[caller] = now
            self._shed_waiting[caller] = shed_waiting
            self._placed[caller] = placed or {}
        self._merge(caller, counted, now)
        fresh = CALLER_REPORTS_KEPT * self.config.router.report_interval_s
        gone = [c for c, t in self._callers.items() if now - t > max(fresh, CALLER_SEEN_S)]
        for c in gone:  # a caller that stopped asking (closed, or its process ended)
            del self._callers[c]
            self._shed_waiting.pop(c, None)
            self._placed.pop(c, None)
        others = [c for c, t in self._callers.items() if c != caller and now - t <= fresh]
        elsewhere: Counter[int] = Counter()
        for c in others:
            elsewhere.update(self._placed.get(c, {}))
        return FleetView(
            {
                name: NodeReport(e.report, e.healthy, now - e.reported_at if e.report else 0.0)
                for name, e in self._nodes.items()
            },
            sum(self._shed_waiting.get(c, 0) for c in others),
            dict(elsewhere),
            None if members_seen == self._members_version else self.members(),
            self._members_version,
        )

    async def set_lifecycle(self, node: str, state: str) -> NodeStatus:
        """Tell ``node`` its lifecycle state changed (an event, e.g. the device's app
        went to the background); token budgets follow at the next token."""
        entry = self._nodes.get(node)
        if entry is None:
            raise InvalidInput(f"no node {node!r}; nodes: {', '.join(self._nodes)}")
        try:
            report = await entry.handle.set_lifecycle(state)
        except NodeGone:
            self._lose(entry)
            raise NodeLost(f"node {node} is gone; its lifecycle state was not set") from None
        self._keep(entry, report)
        return report

    async def cancel(self, request_id: str) -> bool:
        """Cancel ``request_id`` wherever it is; True when a node cancelled it. Every
        node is asked, those out of service too (a silent node may still hold it), each
        for at most ``lost_after_s``: one that fails or does not answer in time is taken
        not to hold it."""
        timeout = self.config.router.lost_after_s
        results = await asyncio.gather(
            *(asyncio.wait_for(e.handle.cancel(request_id), timeout) for e in self._nodes.values()),
            return_exceptions=True,
        )
        return any(r is True for r in results)

    # --------------------------------------------------------------------- rollouts

    async def rollout(
        self,
        model: str,
        new: Version,
        canary: float | int,
        step: float | int,
        bake_s: float,
        gates: str,
    ) -> Rollout:
        """Start moving ``model``'s nodes to ``new`` (see cluster/rollout.py): the nodes
        serving it now, in order, canary first."""
        old = self.rollouts.serving(model)
        if old is None:
            raise RolloutRefused(f"refused: {model} is not published in this fleet")
        nodes = [
            n
            for n, e in self._nodes.items()
            if e.healthy and e.report is not None and any(m.name == model for m in e.report.models)
        ]
        plan = rollout_of(
            model, old, new, nodes, canary=canary, step=step, bake_s=bake_s, gates=gates
        )
        return await self.rollouts.start(plan)

    # ----------------------------------------------------------------------- status

    def status_now(self) -> FleetStatus:
        now = self._clock.now()
        return FleetStatus(
            fleet=self.config.fleet.name,
            nodes=tuple(e.report for e in self._nodes.values() if e.report is not None),
            healthy={n: e.healthy for n, e in self._nodes.items()},
            router=dict(self._counters),
            callers=sum(1 for t in self._callers.values() if now - t <= CALLER_SEEN_S),
            placement=self._placement,
            unresponsive={
                n: now - e.out_since for n, e in self._nodes.items() if e.out_since is not None
            },
            pools=() if self._membership is None else self._membership.status(),
            rollouts=tuple(r.summary() for r in self.rollouts.status() if r.active),
        )

    async def status(
        self, caller: str = "", counted: Mapping[str, int] | None = None
    ) -> FleetStatus:
        """Fresh reports from every reachable node, plus the fleet-wide counters, with
        ``caller``'s ``counted`` (as :meth:`fleet_view` takes them)."""
        self._merge(caller, counted, self._clock.now())
        await asyncio.gather(*(self._poll(e) for e in self._nodes.values()))
        return self.status_now()


# ------------------------------------------------------------------------- on Ray


class RouterActor:
    """The router as a Ray actor: finds its fleet's node actors by name."""

    def __init__(self, config: FleetConfig) -> None:
        handles = {
            spec.name: RayNode(actor_name(config.fleet.name, spec.name), NAMESPACE)
            for spec in config.node_specs()
        }
        timeout_s = config.router.membership.timeout_s
        store = None
        if config.store is not None:
            import ray

            try:
                store = ray.get_actor(config.store, namespace=NAMESPACE)
            except ValueError:
                log.warning(
                    "the fleet's store %s is not running: rollouts are not kept", config.store
                )
        self._router = Router(
            config,
            handles,
            table=RayNodeTable(timeout_s),
            actors=RayMemberActors(timeout_s),
            store=store,
        )

    async def stop(self) -> None:
        """Stop polling and following the pools (before the router is killed, so that
        it starts no member meanwhile)."""
        await self._router.stop()

    async def start(self) -> FleetStatus:
        return await self._router.start()

    def config(self) -> FleetConfig:
        return self._router.config

    async def fleet_view(
        self,
        caller: str = "",
        counted: Mapping[str, int] | None = None,
        shed_waiting: int = 0,
        placed: Mapping[int, int] | None = None,
        members_seen: int = 0,
    ) -> FleetView:
        await self._router.start()  # after a restart of the router itself
        return self._router.fleet_view(caller, counted, shed_waiting, placed, members_seen)

    async def set_lifecycle(self, node: str, state: str) -> NodeStatus:
        await self._router.start()
        return await self._router.set_lifecycle(node, state)

    async def status(
        self, caller: str = "", counted: Mapping[str, int] | None = None
    ) -> FleetStatus:
        return await self._router.status(caller, counted)

    async def cancel(self, request_id: str) -> bool:
        return await self._router.cancel(request_id)

    async def rollout(
        self,
        model: str,
        new: Version,
        canary: float | int,
        step: float | int,
        bake_s: float,
        gates: str,
    ) -> Rollout:
        await self._router.start()
        return await self._router.rollout(model, new, canary, step, bake_s, gates)

    async def rollout_abort(self, model: str) -> Rollout:
        await self._router.start()
        return await self._router.rollouts.abort(model)

    async def rollout_pin(self, target: str, model: str, version: str | None) -> None:
        await self._router.start()
        await self._router.rollouts.pin(target, model, version)

    async def rollouts(self) -> list[Rollout]:
        await self._router.start()
        return self._router.rollouts.status()
