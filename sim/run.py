"""Run a workload on a simulated fleet and collect what happened to every request.

``simulate`` runs once; ``compare`` runs the same workload (same arrivals, same node
failures) under several placement policies. Ctrl-C ends a run early and keeps what it
has: the report says it was interrupted.
"""

from __future__ import annotations

import concurrent.futures as cf
import gc
import json
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from edgefleet.config import FleetConfig, NodeSpec
from edgefleet.errors import (
    Cancelled,
    ConfigError,
    DeadlineExceeded,
    EdgeFleetError,
    Evicted,
    NodeLost,
    Rejected,
    Superseded,
)
from edgefleet.request import GenerateRequest, InferRequest
from sim.fleet import ModelCost, Network, SimFleet, grow
from sim.report import Recorder, RunResult
from sim.workload import (
    Arrival,
    ChurnConfig,
    CostConfig,
    EngineTimes,
    NodeTypeConfig,
    RecordedCall,
    RecordedGeneration,
    Workload,
    read_engine_times,
    read_generation_times,
)

# A fit of a decoder's two costs is kept when the recorded shapes tell them apart: the
# smaller singular value of (tokens prefilled, tokens made) at least this share of the
# larger one.
FIT_CONDITION = 0.01
SAMPLE_EVERY_S = 0.05  # queue length over time: one sample per this much simulated time
PROGRESS_EVERY = 2000  # answers between progress updates
DRAIN_LIMIT_S = 600.0  # simulated seconds after the last arrival before giving up
# The garbage collector during a run. A run makes almost no reference cycles, but
# millions of objects: a large fleet's nodes, schedulers and every caller's view of
# them, which live as long as the run, and every request's objects, which live for as
# long as it is in flight. With the default thresholds the collector scans the
# requests in flight hundreds of times a second and the whole fleet again and again,
# for nothing (a third of the run's CPU time at 10,000 nodes). So a run collects only
# once this many more objects exist than at the last collection, and the objects that
# exist when it starts (the fleet) are left out of the scans. Collection has no part in
# what is simulated: only the CPU time changes.
YOUNG_OBJECTS = 500_000
# A call drawing a recorded engine time draws among the calls recorded within this
# many seconds of its own time into the run: the recorded machine's slow stretches
# then come back together, as queues build behind them (see ModelCost).
RECORDED_WINDOW_S = 0.1
_OUTCOME = {
    Rejected: "rejected",
    Evicted: "evicted",
    DeadlineExceeded: "expired",
    Superseded: "superseded",
    Cancelled: "cancelled",
    NodeLost: "lost",
}


def outcome(error: EdgeFleetError | None) -> str:
    if error is None:
        return "completed"
    return _OUTCOME.get(type(error), "failed")


def model_costs(costs: Mapping[str, CostConfig]) -> dict[str, ModelCost]:
    return {
        name: ModelCost(
            call_ms=dict(c.call_ms or {}),
            prefill_ms_per_token=c.prefill_ms_per_token or 0.0,
            step_ms=dict(c.step_ms or {}),
        )
        for name, c in costs.items()
    }


def measured_costs(tables: Iterable[tuple[str, Mapping[Any, float]]]) -> dict[str, ModelCost]:
    """Cost tables as nodes report them (model, ms per call by batch rows), the median
    of every node's measurement per model and size."""
    by_model: dict[str, dict[int, list[float]]] = {}
    for model, cost_ms in tables:
        for rows, ms in cost_ms.items():
            by_model.setdefault(model, {}).setdefault(int(rows), []).append(float(ms))
    return {
        model: ModelCost({rows: statistics.median(v) for rows, v in table.items()})
        for model, table in by_model.items()
        if table
    }


def costs_from_status(path: str | Path) -> dict[str, ModelCost]:
    """The engine costs a live fleet's nodes measured at warm-up, from the output of
    ``edgefleet status --json`` saved in ``path``."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        tables = [(m["name"], m["cost_ms"]) for n in data["nodes"] for m in n["models"]]
        return measured_costs(tables)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"{path}: not the output of `edgefleet status --json` (nodes[].models[] with "
            f"name and cost_ms): {type(exc).__name__}: {exc}"
        ) from None


def recorded_costs(
    times: EngineTimes,
    tables: Mapping[str, ModelCost] | None = None,
    window_s: float = RECORDED_WINDOW_S,
) -> dict[str, ModelCost]:
    """``tables`` with the engine times a call record gave (:func:`read_engine_times`)
    to draw each call's from: those recorded within ``window_s`` of the call's own time
    into the run (0: any, see :class:`ModelCost`); a node named in the record draws
    those its namesake ran first. A model of ``times`` keeps its table (what its nodes
    report and price calls by, and scale the recorded times by between batch sizes)
    or, without one, gets the median recorded per batch size as its table. Each
    recorded call keeps its request's time outside the node, drawn with it. The models
    of ``tables`` without recorded calls keep their tables alone."""
    out = dict(tables or {})
    for model, by_size in times.items():
        calls = {n: c for n, c in sorted(by_size.items()) if c}
        given = out.get(model, ModelCost())
        table = given.call_ms or {
            n: statistics.median(call.ms for call in c) for n, c in calls.items()
        }
        cost = replace(given, call_ms=table, window_s=window_s)
        by_node: dict[str, dict[int, list[RecordedCall]]] = {}  # one pass, in time order
        for n, c in calls.items():
            for call in c:
                if call.node is not None:
                    by_node.setdefault(call.node, {}).setdefault(n, []).append(call)
        out[model] = replace(
            _drawing(cost, calls),
            by_node={node: _drawing(cost, ran) for node, ran in by_node.items()},
        )
    return out


def _drawing(cost: ModelCost, calls: Mapping[int, Sequence[RecordedCall]]) -> ModelCost:
    """``cost`` drawing among ``calls`` (by batch size, in time order)."""
    return replace(
        cost,
        samples_ms={n: tuple(call.ms for call in c) for n, c in calls.items()},
        samples_at_s={n: tuple(call.at for call in c) for n, c in calls.items()},
        samples_outside_ms=_column(calls, "outside_ms"),
        samples_handoff_ms=_column(calls, "handoff_ms"),
        abort_ms=tuple(call.abort_ms for c in calls.values() for call in c if call.abort_ms),
    )


def _column(calls: Mapping[int, Sequence[RecordedCall]], name: str) -> dict[int, tuple[float, ...]]:
    """Figure ``name`` of ``calls`` by batch size, NaN where a call has none."""
    return {
        n: tuple(math.nan if (v := getattr(call, name)) is None else v for call in c)
        for n, c in calls.items()
    }


def is_call_record(path: str | Path) -> bool:
    """Whether ``path`` is a call record (a folder, a ``.jsonl`` file, or a file whose
    first line is a JSON object with ``at`` and ``model``) rather than the output of
    ``edgefleet status --json``."""
    path = Path(path)
    if path.is_dir() or path.suffix == ".jsonl":
        return True
    try:
        with path.open() as file:
            first = next((line for line in file if line.strip()), "")
        obj = json.loads(first)
    except (OSError, ValueError):
        return False  # costs_from_status names the problem
    return isinstance(obj, dict) and "at" in obj and "model" in obj


def workload_costs(workload: Workload, measured: str | Path | None = None) -> dict[str, ModelCost]:
    """The engine costs of a run of ``workload``: its ``costs:`` tables; for the models
    they leave out, those of ``measured`` when it is the output of ``edgefleet status
    --json``; each inference call drawn from the recorded engine times of a call record,
    ``measured`` when it is one (see :func:`is_call_record`), else the workload's
    ``costs_from:``."""
    tables = model_costs(workload.costs)
    record: str | Path | None = workload.costs_from
    if measured is not None and is_call_record(measured):
        times, record = read_engine_times(measured), measured
    else:
        if measured is not None:
            tables = costs_from_status(measured) | tables
        times = workload.engine_times()
    costs = recorded_costs(times, tables) if times else tables
    for model, generations in (read_generation_times(record) if record else {}).items():
        costs[model] = fitted_decoder(generations, costs.get(model, ModelCost()))
    return costs


def fitted_decoder(generations: Sequence[RecordedGeneration], table: ModelCost) -> ModelCost:
    """``table`` with a decoder's costs fitted to the recorded ``generations``: engine ms
    = ``prefill_ms_per_token`` x tokens prefilled + the step's ms x tokens made, by least
    squares. Where the generations cannot tell the two apart (all of one shape, or a
    fit below zero), the table's two costs are scaled together to match them. The
    step's costs across batch sizes keep the table's shape (scaled); without a table,
    one row's. Their answers spend the generations' recorded times outside the node
    (by the tokens each made)."""
    x = np.array([(g.prefilled, g.made) for g in generations], dtype=np.float64)
    y = np.array([g.ms for g in generations], dtype=np.float64)
    step0 = table.step_s(1) * 1000.0
    fit, _, rank, singular = np.linalg.lstsq(x, y, rcond=None)
    if rank == 2 and singular[-1] > FIT_CONDITION * singular[0] and (fit >= 0).all():
        prefill, step = float(fit[0]), float(fit[1])
    else:
        base = x @ np.array([table.prefill_ms_per_token, step0])
        if base @ base > 0:
            scale = float(y @ base / (base @ base))
            prefill, step = table.prefill_ms_per_token * scale, step0 * scale
        else:  # no table: all of it a step's
            prefill, step = 0.0, float(y.sum() / max(1.0, x[:, 1].sum()))
    steps = {k: v * step / step0 for k, v in table.step_ms.items()} if step0 > 0 else {1: step}
    outside: dict[int, list[float]] = {}
    for g in generations:
        if g.outside_ms is not None:
            outside.setdefault(g.made, []).append(g.outside_ms)
    return replace(
        table, prefill_ms_per_token=prefill, step_ms=steps, generation_outside_ms=outside
    )


LOCAL_TYPE = "local"  # the node type of a config's local.nodes identical nodes


@dataclass(frozen=True)
class NodeType:
    """Nodes alike, as ``edgefleet plan`` counts them: copies of an entry of the config's
    ``nodes:`` (named NAME, NAME-1, ...), members of a pool of ``pools:`` (named
    POOL/d0, POOL/d1, ...), or ``local``, the ``local.nodes`` identical nodes of a config
    with neither; with the workload's ``node_types:`` speed and price."""

    name: str
    template: NodeSpec
    pool: str | None = None
    speed: float = 1.0
    price: float | None = None
    costs: Mapping[str, ModelCost] = field(default_factory=dict)  # its own, by model

    def costs_over(self, costs: Mapping[str, ModelCost]) -> Mapping[str, ModelCost] | None:
        """The costs of the type's nodes: ``costs`` with its own in place (None: ``costs``)."""
        return {**costs, **self.costs} if self.costs else None

    def spec(self, config: FleetConfig, i: int) -> NodeSpec:
        """The ``i``-th node of the type (from 0)."""
        if self.pool is not None:
            return config.member_spec(self.pool, f"d{i}", f"{self.pool}/d{i}")
        if self.name == LOCAL_TYPE:
            return self.template.model_copy(update={"name": f"edge-{i}"})
        name = self.name if i == 0 else f"{self.name}-{i}"
        return self.template.model_copy(update={"name": name})


def node_types(config: FleetConfig, workload: Workload) -> dict[str, NodeType]:
    """The node types of ``config``, in its order (``nodes:``, then ``pools:``; or
    ``local``), each with the speed and price the workload's ``node_types:`` give it.
    ConfigError naming the known types for a ``node_types:`` key that is none of them,
    or a pool named as a node."""
    settings = workload.node_types
    specs = config.node_specs()
    found: dict[str, NodeType] = {}
    if config.nodes:
        for spec in specs:
            found[spec.name] = NodeType(spec.name, spec)
    elif not config.pools:
        found[LOCAL_TYPE] = NodeType(LOCAL_TYPE, specs[0])
    for p in config.pools:
        if p.name in found:
            raise ConfigError(
                f"pool {p.name!r} is named as a node of nodes:; `edgefleet plan` counts "
                "node types by name: rename one"
            )
        found[p.name] = NodeType(p.name, config.member_spec(p.name, "d0", f"{p.name}/d0"), p.name)
    unknown = sorted(set(settings) - set(found))
    if unknown:
        raise ConfigError(
            f"workload node_types: {', '.join(map(repr, unknown))} is not a node type of "
            f"the fleet; known: {', '.join(found)}"
        )
    out = {}
    for name, t in found.items():
        s = settings.get(name, NodeTypeConfig())
        out[name] = replace(t, speed=s.speed, price=s.price, costs=model_costs(s.costs))
    return out


def with_policy(config: FleetConfig, policy: str) -> FleetConfig:
    """``config`` placing with the named policy (its preset scorers and picker)."""
    return config.with_placement(policy=policy)


@contextmanager
def _few_collections() -> Iterator[None]:
    """Run the block with the garbage collector's first generation ``YOUNG_OBJECTS``
    objects large (instead of a few hundred)."""
    threshold = gc.get_threshold()
    gc.set_threshold(YOUNG_OBJECTS, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)


@contextmanager
def _frozen() -> Iterator[None]:
    """Leave every object that exists now out of the garbage collector's scans while
    the block runs (unless the process keeps objects frozen itself)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclass
class Progress:
    """Told how many requests were answered so far (and of how many, when known)."""

    update: Callable[[int], None]
    close: Callable[[], None]


@_few_collections()
def simulate(
    config: FleetConfig,
    workload: Workload,
    *,
    nodes: int | None = None,
    requests: int | None = None,
    seed: int | None = None,
    draw_seed: int | None = None,
    label: str | None = None,
    costs: Mapping[str, ModelCost] | None = None,
    network: Network | None = None,
    progress: Callable[[int | None], Progress] | None = None,
    specs: Sequence[NodeSpec] | None = None,
    speeds: Sequence[float] | None = None,
    types: Sequence[NodeType] | None = None,
) -> RunResult:
    """Run ``workload`` on ``config``'s fleet grown to ``nodes`` nodes (default: as the
    config has them), or on the nodes ``specs``, of node ``types`` (by node: their
    speeds and costs; default: speed 1 and ``costs``) or engine ``speeds``, until
    every arrival is answered or Ctrl-C. Grown nodes take the speed and costs the workload's
    ``node_types:`` gives the node of ``nodes:`` they copy; every node's speed is
    multiplied by the workload's ``node_classes:``. ``costs`` and
    ``network`` replace the workload's (default: :func:`workload_costs`). ``seed``
    (default: the workload's) seeds everything; ``draw_seed`` replaces it for the
    fleet's own draws (engine times, times outside the nodes, placement's random
    choices), so the same arrivals meet another draw."""
    if specs is None:
        base = config.node_specs()
        known = node_types(config, workload)
        specs = grow(base, nodes or len(base))
        if config.nodes:
            types = [known[base[i % len(base)].name] for i in range(len(specs))]
        else:
            types = [known[LOCAL_TYPE]] * len(specs) if LOCAL_TYPE in known else None
    if speeds is None and types is not None:
        speeds = [t.speed for t in types]
    specs = list(specs)
    n = len(specs)
    own = list(speeds) if speeds is not None else [1.0] * n
    speeds = [a * b for a, b in zip(own, workload.speeds(n), strict=True)]
    costs = workload_costs(workload) if costs is None else costs
    by_type = {t.name: t.costs_over(costs) for t in types or ()}
    node_costs = [by_type[t.name] for t in types] if any(by_type.values()) and types else None
    workload.check(config.priorities, {m for s in specs for m in s.models}, costs)
    seed = workload.seed if seed is None else seed
    rng = random.Random(seed)
    arrivals = workload.arrivals(rng, nodes=n, requests=requests, priorities=config.priorities)
    total = requests or workload.requests
    rate = workload.mean_rate(n)
    if rate and workload.duration_s is not None:
        expected = int(rate * workload.duration_s)  # what the progress bar counts to
        total = expected if total is None else min(total, expected)
    horizon = workload.duration_s or (total / rate if total and rate else 60.0)
    events = workload.events(rng, nodes=n, horizon_s=horizon * 1.5 + 1.0)
    recorder = Recorder([s.name for s in specs], config.priorities)
    fleet = SimFleet(
        config,
        costs,
        specs=specs,
        speeds=speeds,
        network=network
        or Network(workload.network.hop_ms / 1000.0, workload.network.report_delay_ms / 1000.0),
        seed=seed if draw_seed is None else draw_seed,
        callers=workload.callers,
        shared_cores=workload.shared_cores,
        on_busy=recorder.busy,
        members=workload.churn is not None,
        on_capacity=recorder.capacity if workload.churn is not None else None,
        on_first_served=recorder.first_served,
        node_costs=node_costs,
    )
    driver = _Driver(
        fleet, recorder, arrivals, progress(total) if progress else None, workload.churn
    )
    for e in events:
        fleet.loop.at(e.at, driver.fleet_event, e.kind, e.node, e.state)
    wall = time.perf_counter()
    interrupted = False
    try:
        with _frozen():
            driver.run()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        driver.close()
    wall = time.perf_counter() - wall
    counters: Counter[str] = Counter()
    for d in fleet.dispatchers:
        counters.update(d.counted())
    for name in ("spilled", "shed", "replaced"):
        if counters[name]:
            recorder.counter(name, counters[name])
    for name, n in sorted(fleet.churned.items()):
        recorder.counter(name, n)
    return RunResult(
        label or config.router.placement.policy,
        recorder,
        simulated_s=fleet.loop.t,
        wall_s=wall,
        events=fleet.loop.events,
        interrupted=interrupted,
    )


def compare(
    config: FleetConfig, workload: Workload, policies: Sequence[str], **kwargs: Any
) -> list[RunResult]:
    """The same workload under each placement policy; stops at the first interrupted."""
    out = []
    for policy in policies:
        result = simulate(with_policy(config, policy), workload, label=policy, **kwargs)
        out.append(result)
        if result.interrupted:
            break
    return out


class _Driver:
    """Feeds arrivals in time order (one pending at a time), records answers."""

    def __init__(
        self,
        fleet: SimFleet,
        recorder: Recorder,
        arrivals: Iterator[Arrival],
        progress: Progress | None,
        churn: ChurnConfig | None = None,
    ) -> None:
        self.fleet = fleet
        self.churn = churn
        self.recorder = recorder
        self.arrivals = arrivals
        self.progress = progress
        self.callers = len(fleet.dispatchers)
        self.sent = 0
        self.answered = 0
        self.more = True
        self.last_at = 0.0
        self.pending: dict[str, tuple[float, int]] = {}  # request id -> arrival, priority
        self._inputs: dict[int, dict[str, np.ndarray]] = {}
        self._prompts: dict[int, tuple[int, ...]] = {}
        self._next()
        fleet.loop.at(0.0, self._sample)

    def run(self) -> None:
        """Until every arrival is answered; a request still unanswered ``DRAIN_LIMIT_S``
        of simulated time after the last arrival (a bug) ends the run, counted as lost
        and named in the counters, rather than simulating forever."""
        loop = self.fleet.loop
        loop.run(
            until=lambda: (
                not self.more
                and (self.answered >= self.sent or loop.t > self.last_at + DRAIN_LIMIT_S)
            )
        )
        for at, priority in list(self.pending.values()):
            self.recorder.answer(priority, "lost", loop.t - at, -1)
            self.recorder.counter("unanswered")
        self.answered += len(self.pending)
        self.pending.clear()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.update(self.answered)
            self.progress.close()

    def _next(self) -> None:
        a = next(self.arrivals, None)
        if a is None:
            self.more = False
            return
        self.fleet.loop.at(a.at, self._arrive, a)

    def _arrive(self, a: Arrival) -> None:
        loop = self.fleet.loop
        self.last_at = loop.t
        rid = f"r{self.sent}" if a.id is None or a.id in self.pending else a.id
        deadline = None if a.deadline_s is None else loop.t + a.deadline_s
        request: InferRequest | GenerateRequest
        if a.prompt_tokens > 0:
            prompt = self._prompts.get(a.prompt_tokens)
            if prompt is None:
                prompt = self._prompts[a.prompt_tokens] = tuple(range(a.prompt_tokens))
            request = GenerateRequest(
                a.model,
                prompt,
                a.max_new_tokens,
                a.priority,
                rid,
                session=a.session,
                deadline_unix=deadline,
                at_most_once=a.at_most_once,
            )
        else:
            inputs = self._inputs.get(a.rows)
            if inputs is None:
                shape = (a.rows, 1)
                inputs = self._inputs[a.rows] = {"x": np.zeros(shape, np.float32)}
            request = InferRequest(
                a.model, inputs, a.priority, rid, deadline, a.key, a.at_most_once
            )
        fut = self.fleet.submit(request, self.sent % self.callers)
        self.sent += 1
        self.pending[rid] = (loop.t, a.priority)
        fut.add_done_callback(partial(self._answered, rid, loop.t, a.priority))
        self._next()

    def _answered(self, rid: str, at: float, priority: int, fut: cf.Future[Any]) -> None:
        if self.pending.pop(rid, None) is None:
            return  # counted as lost already
        answer = fut.result()
        node = self.fleet.index.get(answer.node, -1)
        self.recorder.answer(priority, outcome(answer.error), self.fleet.loop.t - at, node)
        self.answered += 1
        if self.progress is not None and self.answered % PROGRESS_EVERY == 0:
            self.progress.update(self.answered)

    def _sample(self) -> None:
        fleet = self.fleet
        self.recorder.sample(fleet.loop.t, fleet.queued, fleet.in_flight)
        if self.more or self.answered < self.sent:
            fleet.loop.at(fleet.loop.t + SAMPLE_EVERY_S, self._sample)

    def fleet_event(self, kind: str, node: int, state: str | None) -> None:
        if not (self.more or self.answered < self.sent):
            return  # the run is over
        if kind == "fail":
            self.recorder.counter("node_failures")
            self.fleet.fail(node)
        elif kind == "rejoin":
            self.fleet.rejoin(node)
        elif kind == "leave":
            assert self.churn is not None
            self.recorder.counter("leaves")
            self.fleet.leave(node, self.churn.declared_dead_after_s)
        elif kind == "join":
            assert self.churn is not None
            self.recorder.counter("rejoins")
            self.fleet.join(node, self.churn.start_s)
        elif state is not None:
            self.fleet.set_lifecycle(node, state)
