"""Rollouts: a model's new version, node by node, gated, and rolled back when it fails.

The deployer checks the new file (it is ONNX, it loads, its inputs and outputs are
those of the version served) and uploads it to the fleet's store
(:func:`prepare`); nothing else happens when a check fails. The router then runs the
rollout (:class:`Rollouts`): a canary, then steps of a share of the nodes
(:func:`policies.rollout.plan_steps`). Each node of a step fetches the new files into
its cache while serving, refuses new work for the model (callers place it on other
nodes), finishes what it holds, loads, warms up and measures the new version, and
admits again (``NodeRuntime.set_version``). The nodes moved so far then bake: every
report interval the gates (:func:`policies.rollout.judge`) compare what they served
since the bake began with what the nodes still on the old version served in the same
time. A failed gate, a node whose new version does not load or warm up, or an abort
moves every node moved so far back to the old version.

Which version each node should serve (:class:`Versions`: the rollouts, the versions
rollouts made current, pins) is kept in the fleet's store, on disk: a restarted router
finds a rollout there and carries it on (a bake starts again), and a node that Ray
restarted, or a pool member that joins, is moved to the version it should serve
(it starts on the deployed one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from cluster.control import NodeEntry
from edgefleet.artifacts import ModelArtifact
from edgefleet.clock import Clock
from edgefleet.config import FleetConfig, ModelConfig, NodeSpec
from edgefleet.errors import EdgeFleetError, InvalidInput, ModelNotFound, RolloutRefused
from edgefleet.messages import NodeState, NodeStatus
from policies.rollout import DEFAULT_GATES, Gate, Served, judge, parse_gates, plan_steps

log = logging.getLogger(__name__)

ENDED = ("done", "rolled back", "aborted")
STATE_KEY = "versions"  # the store's record of them
DRAIN_S = 60.0  # a moving node finishes what it holds of the model within this
LOAD_TIMEOUT_S = 600.0  # a node's whole version change (fetch, drain, load, warm-up)
HISTORY = 50  # events a rollout keeps


@dataclass(frozen=True)
class Version:
    """One version of a model: its files as published, and its config (the deployed
    one with these files)."""

    config: ModelConfig
    artifact: ModelArtifact

    @property
    def name(self) -> str:
        return self.artifact.version

    def on(self, spec: NodeSpec, model: str) -> ModelConfig:
        """The config ``spec``'s node loads this version with: its own (providers may
        differ by pool or node) with this version's files."""
        own = spec.models.get(model, self.config)
        files = {"path": self.config.path, "variants": self.config.variants}
        return own.model_copy(update={**files, "version": self.config.version})


@dataclass
class Rollout:
    """One rollout of a model, as the router runs it and the store keeps it."""

    model: str
    old: Version
    new: Version
    steps: tuple[tuple[str, ...], ...]
    gates: tuple[Gate, ...]
    bake_s: float
    step: int = 0  # the step in progress
    phase: str = "moving"  # moving, baking, rolling back; then done, rolled back, aborted
    moved: list[str] = field(default_factory=list)  # nodes on the new version
    why: str = ""  # why it ended, or the last verdict
    started: float = field(default_factory=time.time)
    ended: float | None = None
    events: list[str] = field(default_factory=list)

    @property
    def active(self) -> bool:
        return self.phase not in ENDED

    def event(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        self.events = [*self.events, f"{stamp} {text}"][-HISTORY:]
        log.info("rollout of %s: %s", self.model, text)

    def summary(self) -> str:
        nodes = sum(len(s) for s in self.steps)
        where = f"step {min(self.step + 1, len(self.steps))}/{len(self.steps)}"
        return (
            f"{self.model} @{self.old.name} -> @{self.new.name}: {self.phase}, {where}, "
            f"{len(self.moved)}/{nodes} node(s) on @{self.new.name}"
            + (f"; {self.why}" if self.why else "")
        )


@dataclass
class Versions:
    """Which version each node should serve, beyond the deploy: each model's rollouts
    (the last one of each), the versions finished rollouts made current, and pins of
    a node or a pool to a version. Kept in the fleet's store."""

    current: dict[str, Version] = field(default_factory=dict)  # model -> version
    pins: dict[str, dict[str, Version]] = field(default_factory=dict)  # node/pool -> model
    rollouts: dict[str, Rollout] = field(default_factory=dict)  # model -> its last rollout
    known: dict[str, dict[str, Version]] = field(default_factory=dict)  # model -> name ->

    def wanted(self, spec: NodeSpec, model: str) -> Version | None:
        """The version ``spec``'s node should serve of ``model``; None: the deployed one."""
        for target in (spec.name, spec.pool):
            pinned = self.pins.get(target or "", {}).get(model)
            if pinned is not None:
                return pinned
        r = self.rollouts.get(model)
        if r is not None and r.active and spec.name in r.moved:
            return r.old if r.phase == "rolling back" else r.new
        return self.current.get(model)

    def learn(self, model: str, version: Version) -> None:
        self.known.setdefault(model, {})[version.name] = version

    def digests(self) -> list[str]:
        """Every file of every version known: the store keeps them."""
        return sorted(
            {f.sha256 for vs in self.known.values() for v in vs.values() for f in v.artifact.files}
        )


class Fleet(Protocol):
    """What rollouts use of the router (cluster/router.py)."""

    config: FleetConfig
    _nodes: dict[str, NodeEntry]
    _counters: Counter[str]
    _clock: Clock

    def _keep(self, entry: NodeEntry, report: NodeStatus) -> None: ...


class Rollouts:
    """The router's side: runs rollouts (one task each, supervised), moves nodes to the
    version they should serve, and keeps :class:`Versions` in the fleet's store."""

    def __init__(self, fleet: Fleet, store: Any = None) -> None:
        """``fleet``: the router's nodes and what it does with their reports; ``store``:
        the fleet's store actor (None: nothing is kept, as in tests)."""
        self._router = fleet
        self._store = store
        self.versions = Versions()
        self._tasks: dict[str, asyncio.Task[None]] = {}  # model -> its rollout's task
        self._moving: dict[str, asyncio.Task[None]] = {}  # node -> its version change
        self._failed: dict[tuple[str, str], str] = {}  # (node, digest) -> why it failed
        self._loaded = False

    # --------------------------------------------------------------------- keeping

    async def load(self) -> None:
        """Read the versions from the store (once), and carry on a rollout that was
        running when the router stopped."""
        if self._loaded:
            return
        self._loaded = True
        if self._store is not None:
            try:
                kept = await asyncio.wait_for(self._store.load_state.remote(STATE_KEY), 30.0)
            except Exception as exc:  # the store is out of reach: start from the deploy
                log.warning("could not read the fleet's versions from its store: %s", exc)
                kept = None
            if isinstance(kept, Versions):
                self.versions = kept
        for r in self.versions.rollouts.values():
            if r.active:
                r.event(f"the router restarted; carrying on ({r.phase})")
                self._run(r)

    async def _save(self) -> None:
        if self._store is None:
            return
        try:
            await asyncio.wait_for(
                self._store.save_state.remote(STATE_KEY, self.versions, self.versions.digests()),
                30.0,
            )
        except Exception as exc:
            log.warning("could not keep the fleet's versions in its store: %s", exc)

    # --------------------------------------------------------------------- commands

    async def start(self, rollout: Rollout) -> Rollout:
        """Start ``rollout`` (its steps name the nodes serving the model now, in order);
        RolloutRefused while another rollout of the model runs."""
        running = self.versions.rollouts.get(rollout.model)
        if running is not None and running.active:
            raise RolloutRefused(
                f"a rollout of {rollout.model} is running ({running.summary()}); wait for "
                f"it or `edgefleet rollout abort {rollout.model}`"
            )
        self.versions.learn(rollout.model, rollout.old)
        self.versions.learn(rollout.model, rollout.new)
        self.versions.rollouts[rollout.model] = rollout
        rollout.event(
            f"started: @{rollout.old.name} -> @{rollout.new.name}, "
            f"{len(rollout.steps)} step(s), bake {rollout.bake_s:g} s, gates "
            + (",".join(map(str, rollout.gates)) or "none")
        )
        await self._save()
        self._run(rollout)
        return rollout

    async def abort(self, model: str) -> Rollout:
        r = self.versions.rollouts.get(model)
        if r is None or not r.active:
            raise InvalidInput(f"no rollout of {model} is running")
        if r.phase != "rolling back":
            task = self._tasks.get(model)
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            self._roll_back(r, "aborted by the operator")
            await self._save()
            self._run(r)
        return r

    async def pin(self, target: str, model: str, version: str | None) -> None:
        """Make node or pool ``target`` serve ``model``@``version`` (None: unpin)."""
        pools = {p.name for p in self._router.config.pools}
        if target not in pools and target not in self._router._nodes:
            names = ", ".join(sorted({*pools, *self._router._nodes})) or "none"
            raise InvalidInput(f"no node or pool {target!r}; there are: {names}")
        if model not in self._router.config.models:
            raise ModelNotFound(f"model {model!r} is not in the fleet")
        if version is None:
            self.versions.pins.get(target, {}).pop(model, None)
        else:
            known = self.known(model)
            if version not in known:
                raise RolloutRefused(
                    f"{model} has no version {version!r}; known: {', '.join(known) or 'none'}"
                )
            self.versions.pins.setdefault(target, {})[model] = known[version]
            for key in [k for k in self._failed if k[1] == known[version].artifact.digest]:
                del self._failed[key]
        await self._save()
        for entry in list(self._router._nodes.values()):
            self.reconcile(entry)

    def known(self, model: str) -> dict[str, Version]:
        """The versions of ``model`` the fleet knows: the deployed one and those rolled out."""
        out = dict(self.versions.known.get(model, {}))
        deployed = self.deployed(model)
        if deployed is not None:
            out.setdefault(deployed.name, deployed)
        return out

    def deployed(self, model: str) -> Version | None:
        artifact = self._router.config.artifacts.get(model)
        config = self._router.config.models.get(model)
        return None if artifact is None or config is None else Version(config, artifact)

    def serving(self, model: str) -> Version | None:
        """The version of ``model`` the fleet serves when no rollout or pin says else."""
        return self.versions.current.get(model) or self.deployed(model)

    def status(self) -> list[Rollout]:
        return list(self.versions.rollouts.values())

    # --------------------------------------------------------------------- moving

    def reconcile(self, entry: NodeEntry) -> None:
        """Start moving ``entry``'s node to the versions it should serve, where its last
        report says it serves others (not twice at once; not again to a version that
        failed there, until it is asked for anew)."""
        report = entry.report
        if report is None or report.state is not NodeState.SERVING or not entry.healthy:
            return
        name = entry.spec.name
        if name in self._moving:
            return
        for m in report.models:
            want = self.versions.wanted(entry.spec, m.name) or self.deployed(m.name)
            if want is None or not m.digest or want.artifact.digest == m.digest:
                continue
            if (name, want.artifact.digest) in self._failed:
                continue
            self._moving[name] = asyncio.create_task(self._move(entry, m.name, want))
            return

    async def _move(self, entry: NodeEntry, model: str, version: Version) -> None:
        name = entry.spec.name
        try:
            config = version.on(entry.spec, model)
            change = entry.handle.set_version(model, config, version.artifact, DRAIN_S)
            report: NodeStatus = await asyncio.wait_for(change, LOAD_TIMEOUT_S)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Ray hands on what the node raised wrapped, its message a remote traceback.
            cause = getattr(exc, "cause", None)
            exc = cause if isinstance(cause, Exception) else exc
            why = str(exc) if isinstance(exc, EdgeFleetError) else f"{type(exc).__name__}: {exc}"
            if isinstance(exc, TimeoutError):
                why = f"node {name} did not load @{version.name} within {LOAD_TIMEOUT_S:g} s"
            self._failed[(name, version.artifact.digest)] = why
            self._router._counters["version_failures"] += 1
            log.warning("node %s: %s@%s failed: %s", name, model, version.name, why)
        else:
            self._router._keep(entry, report)
            self._router._counters["version_changes"] += 1
        finally:
            self._moving.pop(name, None)
        self.reconcile(entry)  # another model may be due too

    async def _reach(self, r: Rollout, nodes: list[str], version: Version) -> str | None:
        """Wait until each of ``nodes`` serves ``version`` of the rollout's model; why one
        failed (the first), or None. A node that is lost meanwhile, or not serving (a
        drained one), is not waited for: it is moved when it serves again."""
        digest = version.artifact.digest
        for node in nodes:
            self._failed.pop((node, digest), None)
        while True:
            waiting = False
            for node in nodes:
                entry = self._router._nodes.get(node)
                if entry is None or not entry.healthy or entry.report is None:
                    continue
                if entry.report.state is not NodeState.SERVING:
                    continue
                why = self._failed.get((node, digest))
                if why is not None:
                    return why
                served = _model(entry.report, r.model)
                if served is None or served.digest != digest:
                    waiting = True
                    self.reconcile(entry)
            if not waiting:
                return None
            await asyncio.sleep(0.05)

    def _run(self, r: Rollout) -> None:
        task = asyncio.create_task(self._drive(r), name=f"rollout-{r.model}")
        self._tasks[r.model] = task

        def ended(task: asyncio.Task[None]) -> None:
            if self._tasks.get(r.model) is task:
                del self._tasks[r.model]
            if task.cancelled() or task.exception() is None:
                return
            log.error("rollout of %s stopped", r.model, exc_info=task.exception())
            if r.active and r.phase != "rolling back":  # supervised: roll back, again
                self._roll_back(r, f"the rollout failed: {task.exception()}")
                self._run(r)

        task.add_done_callback(ended)

    def _roll_back(self, r: Rollout, why: str) -> None:
        r.phase, r.why = "rolling back", why
        r.event(f"rolling back {len(r.moved)} node(s): {why}")

    async def _drive(self, r: Rollout) -> None:
        while r.active:
            if r.phase == "moving":
                nodes = [n for n in r.steps[r.step] if n not in r.moved]
                r.moved = [*r.moved, *nodes]
                r.event(f"step {r.step + 1}/{len(r.steps)}: moving {', '.join(nodes) or 'none'}")
                await self._save()
                failed = await self._reach(r, list(r.steps[r.step]), r.new)
                if failed is not None:
                    self._roll_back(r, failed)
                else:
                    r.phase = "baking"
                await self._save()
            elif r.phase == "baking":
                verdict = await self._bake(r)
                if verdict is not None:
                    self._roll_back(r, verdict)
                elif r.step + 1 < len(r.steps):
                    r.step += 1
                    r.phase = "moving"
                else:
                    self.versions.current[r.model] = r.new
                    r.phase, r.ended = "done", time.time()
                    r.event(f"done: every node serves @{r.new.name}")
                await self._save()
            elif r.phase == "rolling back":
                failed = await self._reach(r, list(r.moved), r.old)
                r.phase = "aborted" if r.why == "aborted by the operator" else "rolled back"
                r.moved, r.ended = [], time.time()
                if failed is None:
                    r.event(f"{r.phase}: every node serves @{r.old.name}")
                else:
                    r.event(f"{r.phase}, but a node could not move back: {failed}")
                await self._save()

    async def _bake(self, r: Rollout) -> str | None:
        """Bake the moved nodes for ``bake_s``; why a gate failed, or None."""
        nodes = self._router._nodes
        baseline = {n: _served(e.report, r.model) for n, e in nodes.items()}
        until = self._router._clock.now() + r.bake_s
        interval = self._router.config.router.report_interval_s
        r.event(f"baking {len(r.moved)} node(s) for {r.bake_s:g} s")
        while True:
            final = self._router._clock.now() >= until
            new, old = Served(), Served()
            for n, e in list(nodes.items()):
                served = _model(e.report, r.model)
                if served is None:
                    continue
                since = _served(e.report, r.model) - baseline.get(n, Served())
                if served.digest == r.new.artifact.digest:
                    new = new + since
                elif served.digest == r.old.artifact.digest:
                    old = old + since
            verdict = judge(new, old, r.gates, final=final)
            r.why = verdict.why
            if verdict.passed is False:
                return verdict.why
            if verdict.passed or final:
                r.event(f"bake passed: {verdict.why}")
                return None
            await asyncio.sleep(interval)


def _model(report: NodeStatus | None, model: str) -> Any:
    if report is None:
        return None
    return next((m for m in report.models if m.name == model), None)


def _served(report: NodeStatus | None, model: str) -> Served:
    m = _model(report, model)
    return Served() if m is None else Served(m.failed, tuple(m.service))


# ------------------------------------------------------------------- the deployer


def prepare(
    config: FleetConfig,
    model: str,
    to: Path,
    *,
    version: str | None = None,
    serving_signature: str | None = None,
    allow_signature_change: bool = False,
    progress: Any = None,
) -> Version:
    """Check ``to`` as ``model``'s next version and upload its files to the fleet's
    store. RolloutRefused, before any node is touched, when it is not an ONNX model,
    does not load, or (unless ``allow_signature_change``) its inputs or outputs differ
    from ``serving_signature`` (what the nodes report of the version served)."""
    from cluster.modelfiles import model_signature
    from cluster.store import upload_files

    if model not in config.models:
        known = ", ".join(sorted(config.models)) or "none"
        raise ModelNotFound(f"model {model!r} is not in the fleet; it has: {known}")
    base = config.models[model]
    files = {"path": Path(to).resolve(), "variants": {}, "version": version}
    new_config = base.model_copy(update=files)
    try:
        signature = model_signature(model, new_config)
    except EdgeFleetError as exc:
        raise RolloutRefused(f"refused: {exc}") from None
    text = signature.text
    if serving_signature and text != serving_signature and not allow_signature_change:
        raise RolloutRefused(
            f"refused: {to} has other inputs or outputs than the {model} served\n"
            f"  served: {serving_signature}\n  new:    {text}\n"
            "  callers would send it what it does not take; pass --allow-signature-change "
            "if they are ready"
        )
    artifact = upload_files(config, model, new_config, progress)
    return Version(new_config, artifact)


def rollout_of(
    model: str,
    old: Version,
    new: Version,
    nodes: list[str],
    *,
    canary: float | int = 1,
    step: float | int = 0.25,
    bake_s: float = 60.0,
    gates: str = DEFAULT_GATES,
) -> Rollout:
    """The rollout of ``model`` from ``old`` to ``new`` on ``nodes`` (those serving it)."""
    if old.artifact.digest == new.artifact.digest:
        raise RolloutRefused(f"refused: {model} already serves these files (@{old.name})")
    try:
        parsed = parse_gates(gates)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    if bake_s < 0:
        raise InvalidInput(f"--bake {bake_s:g}: give seconds, 0 or more")
    if not nodes:
        raise RolloutRefused(f"refused: no node serves {model} now")
    return Rollout(model, old, new, plan_steps(nodes, canary, step), parsed, bake_s)
