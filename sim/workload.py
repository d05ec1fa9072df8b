"""The workload of a fleet simulation: what arrives, when, and what happens to the nodes.

A workload is a YAML file, validated like the fleet config (unknown keys are errors, and
:func:`load_workload` names each problem by its dotted YAML path and line)::

    seed: 1                      # the run's random seed
    duration_s: 60               # stop generating at this simulated time ...
    requests: 100000             # ... or after this many arrivals (at least one of the two)
    arrivals:
      process: poisson           # poisson | bursts | diurnal | periodic
      rate_per_node: 40          # or rate: requests/s for the whole fleet
    mix:                         # classes of traffic, drawn by weight
      - {model: classifier, priority: foreground, weight: 0.2, deadline_ms: 200}
      - {model: tiny_lm, priority: inline, sessions: 50,
         generate: {prompt_tokens: 32, max_new_tokens: 16}}
    events:
      node_failures: {per_minute: 0.01, down_s: 30}
      lifecycle: [{at_s: 10, state: background, share: 0.5}]
    churn:                       # devices leaving and coming back (instead of node_failures)
      leave_per_device_per_hour: 2
      declared_dead_after_s: 15
      rejoin_after_s: 120

or, instead of ``arrivals`` and ``mix``, ``trace: recorded.jsonl``: a recorded trace to
replay (see :func:`read_trace`). ``costs_from: calls/`` draws the engine time of each
inference call from those a live fleet's calls took, as a call record has them (see
:func:`read_engine_times`).

:meth:`Workload.arrivals` yields the arrivals lazily and in time order; every random draw
comes from a NumPy generator seeded from the ``random.Random`` it is given, so the same
seed gives the same arrivals, and a run bounded sooner (fewer requests, a shorter
duration) gets a prefix of a longer run's arrivals. Arrivals of the bursts and diurnal
processes are drawn exactly, by thinning a Poisson process at the peak rate
(Lewis and Shedler). The periodic process sends each stream at a fixed interval, as
cameras send frames: a class of the mix is one stream, or one per dedup key with
``keys: N`` (each stream keeps its key), its rate split evenly between them; each
stream starts at a random phase within its first interval (``periodic: {phase:
aligned}``: all at 0), and ``periodic: {jitter: 0.1}`` delays each arrival by up to a
tenth of the interval, drawn uniformly. :meth:`Workload.events` lists node failures,
rejoins, lifecycle changes and churn (devices leaving and coming back) up to a horizon.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeGuard

import numpy as np
from pydantic import (
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from edgefleet.config import _format_errors, _Strict, _where, read_yaml
from edgefleet.errors import ConfigError
from edgefleet.priorities import DEFAULT_PRIORITIES, PRIORITY_RANGE, is_priority
from policies.budget import Lifecycle

_CHUNK = 16_384  # candidate arrivals drawn per NumPy call


class RecordedCall(NamedTuple):
    """One engine call a call record shows, as one of its requests saw it."""

    at: float  # when the call started, seconds after the record's first arrival
    ms: float  # its engine time
    outside_ms: float | None = None  # the request's time outside its node, when recorded
    node: str | None = None  # the node that ran it, when recorded
    handoff_ms: float | None = None  # its node's time from being ready for it to its start
    abort_ms: float | None = None  # the wait for the call aborted just before it to stop


# recorded calls: model -> batch size -> the calls, in the order they started
EngineTimes = dict[str, dict[int, list[RecordedCall]]]


class RecordedGeneration(NamedTuple):
    """One completed generation a call record shows."""

    prefilled: int  # tokens it ran through the model other than one a step (fed - made)
    made: int  # tokens it made
    ms: float  # its engine time over all its calls
    outside_ms: float | None = None  # its latency less its queue and engine time


# recorded generations: model -> the generations, in the record's order
GenerationTimes = dict[str, list[RecordedGeneration]]
_DEFER = "defer_cross_checks"  # validation context: parse_workload reports them with lines


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request arriving at the fleet."""

    at: float  # seconds from the start of the run
    model: str
    priority: int  # 0..10, higher runs first
    rows: int = 1
    deadline_s: float | None = None  # relative to `at`
    key: str | None = None  # dedup key
    session: str | None = None  # chat session
    prompt_tokens: int = 0  # > 0: a generation
    max_new_tokens: int = 0
    id: str | None = None  # from a recorded trace; None: the simulator names it
    at_most_once: bool = False  # never run twice: NodeLost when its node is lost with it


@dataclass(frozen=True, slots=True)
class FleetEvent:
    """Something that happens to one simulated node."""

    at: float
    kind: Literal["fail", "rejoin", "lifecycle", "leave", "join"]
    node: int  # index into the simulated fleet's node list (0..nodes-1)
    state: str | None = None  # lifecycle: "foreground" | "background"


# -- the schema ------------------------------------------------------------------------


class BurstsConfig(_Strict):
    """Bursts of traffic: a burst of ``length_s`` every ``every_s`` seconds, the first at
    ``every_s`` (the run starts with ``every_s - length_s`` seconds at the base rate)."""

    every_s: float = Field(gt=0, description="seconds from the start of one burst to the next")
    length_s: float = Field(gt=0, description="seconds each burst lasts; less than every_s")
    factor: float = Field(gt=0, description="the rate during a burst is rate x factor")


class DiurnalConfig(_Strict):
    """A daily cycle, compressed: the rate follows a sinusoid from ``low x rate`` at the
    start of each period up to ``rate`` half-way through and back down."""

    period_s: float = Field(gt=0, description="seconds of one cycle")
    low: float = Field(ge=0, le=1, description="the rate at the trough, as a fraction of rate")


class PeriodicConfig(_Strict):
    """Arrivals at a fixed interval, as a camera sends frames: each class of the mix is
    one stream, or with ``keys: N`` N streams (one per dedup key, a camera each), and a
    class's rate is split evenly between its streams. Stream ``i`` sends at
    ``phase_i + n x interval``, each arrival up to ``jitter x interval`` late."""

    jitter: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="each arrival comes a uniformly drawn 0 to jitter x interval after "
        "its slot (0: exactly on time); below 1, so a stream's arrivals keep their order",
    )
    phase: Literal["random", "aligned"] = Field(
        "random",
        description="'random': each stream's first slot drawn uniformly within its first "
        "interval; 'aligned': every stream's first slot at 0",
    )


class ArrivalsConfig(_Strict):
    """When requests arrive: the process and its rate."""

    process: Literal["poisson", "bursts", "diurnal", "periodic"] = Field(
        "poisson",
        description="'poisson': a constant rate; 'bursts': rate x factor during periodic "
        "bursts (see bursts:); 'diurnal': a sinusoidal cycle (see diurnal:); 'periodic': "
        "each stream at a fixed interval (see periodic:)",
    )
    rate: float | None = Field(
        None, gt=0, description="requests/s for the whole fleet (or rate_per_node)"
    )
    rate_per_node: float | None = Field(
        None, gt=0, description="requests/s per simulated node (or rate)"
    )
    bursts: BurstsConfig | None = Field(None, description="process: bursts only")
    diurnal: DiurnalConfig | None = Field(None, description="process: diurnal only")
    periodic: PeriodicConfig | None = Field(
        None, description="process: periodic only; default: no jitter, random phases"
    )


class GenerateConfig(_Strict):
    """Makes a class of traffic generations (``generate()`` on a decoder model)."""

    prompt_tokens: int = Field(ge=1, description="tokens in each prompt")
    max_new_tokens: int = Field(ge=1, description="tokens each generation asks for")


class MixClass(_Strict):
    """One class of traffic."""

    model: str = Field(min_length=1, description="a model the fleet serves")
    priority: str | int = Field(
        description=f"a priority class of the fleet (e.g. foreground) or an int {PRIORITY_RANGE}"
    )
    weight: float = Field(1.0, ge=0, description="share of arrivals; weights are normalised")
    rows: int = Field(1, ge=1, description="rows on the batch axis of each request")
    deadline_ms: float | None = Field(
        None, gt=0, description="deadline after arrival; default: none"
    )
    keys: int | None = Field(
        None,
        ge=1,
        description="draw a dedup key from this many distinct keys (k0, k1, ...); default: no key",
    )
    sessions: int | None = Field(
        None,
        ge=1,
        description="draw a chat session from this many (s0, s1, ...); generations only; "
        "default: no session",
    )
    generate: GenerateConfig | None = Field(
        None, description="makes the class generations; default: inferences"
    )
    at_most_once: bool = Field(
        False,
        description="never run twice: a request whose node is lost with it ends NodeLost "
        "instead of being placed again",
    )

    @field_validator("priority", mode="before")
    @classmethod
    def _class_or_int(cls, v: object) -> object:
        if isinstance(v, bool) or not isinstance(v, str | int):
            raise ValueError(f"a priority class name or an int {PRIORITY_RANGE}, got {v!r}")
        if isinstance(v, int) and not is_priority(v):
            raise ValueError(f"priority {v} is out of range; allowed {PRIORITY_RANGE}")
        if isinstance(v, str) and not v:
            raise ValueError(f"a priority class name or an int {PRIORITY_RANGE}, got ''")
        return v


class NodeFailures(_Strict):
    """Nodes failing at random: each node that is up fails at ``per_minute`` per minute
    (a Poisson process), and rejoins ``down_s`` later."""

    per_minute: float = Field(ge=0, description="failures per node per minute (0.01: 1 %)")
    down_s: float | None = Field(
        None, gt=0, description="seconds until a failed node rejoins; default: never"
    )


class ChurnConfig(_Strict):
    """Devices that leave the fleet and come back, as pool members do: each churning
    device that is in the fleet leaves at ``leave_per_device_per_hour`` (a Poisson
    process). It stops serving at once; what it held waits until the head declares it
    dead, ``declared_dead_after_s`` later (Ray's health checks), and is then placed
    again (``at_most_once`` requests end NodeLost). It comes back ``rejoin_after_s``
    after it left (drawn as ``rejoin_distribution`` says) as a new member, serving
    ``start_s`` after that."""

    leave_per_device_per_hour: float = Field(
        gt=0, description="leaves per churning device and hour in the fleet (2: one per 30 min)"
    )
    declared_dead_after_s: float = Field(
        gt=0,
        le=300,
        description="seconds from a device leaving until the head declares it dead: only "
        "then are the requests it held placed again (or answered NodeLost); at most 300 "
        "(Ray's defaults declare a device that is cut off dead in about 64 s)",
    )
    rejoin_after_s: float | None = Field(
        None,
        gt=0,
        description="mean seconds from leaving to coming back; default: a device that "
        "leaves does not come back",
    )
    rejoin_distribution: Literal["exponential", "fixed"] = Field(
        "exponential",
        description="'exponential': each absence drawn with mean rejoin_after_s; "
        "'fixed': every absence exactly rejoin_after_s",
    )
    start_s: float = Field(
        0.0,
        ge=0,
        description="seconds from coming back to serving (models loaded and warmed up)",
    )
    share: float = Field(
        1.0, gt=0, le=1, description="fraction of the devices that churn (drawn at random)"
    )


class LifecycleChange(_Strict):
    """At ``at_s``, ``share`` of the fleet's nodes (drawn at random) switch to ``state``."""

    at_s: float = Field(ge=0, description="seconds from the start of the run")
    state: Lifecycle
    share: float = Field(
        gt=0,
        le=1,
        description="fraction of all nodes that switch (rounded, at least one); nodes "
        "already in the state stay in it",
    )


class EventsConfig(_Strict):
    """What happens to the nodes during the run."""

    node_failures: NodeFailures | None = Field(None, description="default: no failures")
    lifecycle: list[LifecycleChange] = Field(
        default_factory=list, description="lifecycle changes; default: none"
    )


class CostConfig(_Strict):
    """Engine time of one model on a node of speed 1: a call by batch rows, or for a
    decoder prefill per prompt token and one decode step by generations together."""

    call_ms: dict[int, float] | None = Field(
        None, description="batch rows -> ms per call (linear between the sizes given)"
    )
    prefill_ms_per_token: float | None = Field(None, ge=0, description="decoders")
    step_ms: dict[int, float] | None = Field(
        None, description="decoders: generations decoding together -> ms per token step"
    )

    @model_validator(mode="after")
    def _complete(self) -> CostConfig:
        if self.call_ms is None and self.step_ms is None:
            raise ValueError("give call_ms (a tensor model) or step_ms (a decoder)")
        for table in (self.call_ms or {}, self.step_ms or {}):
            if any(k < 1 or v <= 0 for k, v in table.items()):
                raise ValueError("sizes must be >= 1 and costs > 0 ms")
        return self


class NodeClass(_Strict):
    """A share of the simulated nodes and how fast their engines are."""

    share: float = Field(gt=0, le=1, description="fraction of the nodes")
    speed: float = Field(gt=0, description="engine speed; 0.5 takes twice the cost tables' time")


class NodeTypeConfig(_Strict):
    """What the simulator takes of one node type of the fleet (an entry of ``nodes:``, a
    pool of ``pools:``, or ``local`` for the ``local.nodes`` identical nodes): how fast
    its engines are, and what one node of it costs (``edgefleet plan``)."""

    speed: float = Field(
        1.0, gt=0, description="engine speed; 2 takes half the cost tables' time; default 1"
    )
    price: float | None = Field(
        None,
        ge=0,
        description="what one node of the type costs, in any unit: `edgefleet plan` also "
        "finds the cheapest mix; default: no price",
    )
    costs: dict[str, CostConfig] = Field(
        default_factory=dict,
        description="model -> engine time on the type's nodes (at speed 1, as costs:), in "
        "place of the workload's costs: and costs_from: for those models; default: theirs",
    )


class NetworkConfig(_Strict):
    """Simulated delays."""

    hop_ms: float = Field(0.5, ge=0, description="one way between a caller and a node")
    report_delay_ms: float = Field(
        0.0, ge=0, description="how much older node reports are when callers get them"
    )


class Workload(_Strict):
    """A simulated workload: the arrivals (generated, or a recorded trace) and the events
    that happen to the nodes."""

    seed: int = Field(0, description="the run's random seed")
    requests: int | None = Field(
        None, ge=1, description="stop after this many arrivals; default: no limit"
    )
    duration_s: float | None = Field(
        None, gt=0, description="stop at this simulated time (seconds); default: no limit"
    )
    # YAML `arrivals:` and `events:`, named apart from the arrivals() and events() methods
    arrival_process: ArrivalsConfig | None = Field(
        None,
        alias="arrivals",
        description="the arrival process; required unless trace: is set",
    )
    mix: list[MixClass] | None = Field(
        None, description="the classes of traffic; required unless trace: is set"
    )
    fleet_events: EventsConfig = Field(
        default_factory=EventsConfig,
        alias="events",
        description="node failures and lifecycle changes",
    )
    costs: dict[str, CostConfig] = Field(
        default_factory=dict, description="model -> engine time, for every model the fleet serves"
    )
    node_classes: list[NodeClass] = Field(
        default_factory=list, description="speeds of shares of the nodes; default: all speed 1"
    )
    node_types: dict[str, NodeTypeConfig] = Field(
        default_factory=dict,
        description="node type of the fleet (an entry of nodes:, a pool, or local) -> its "
        "speed (times node_classes') and price; default: speed 1, no price",
    )
    network: NetworkConfig = Field(default_factory=NetworkConfig)
    churn: ChurnConfig | None = Field(
        None, description="devices leaving and coming back (see ChurnConfig); default: none"
    )
    shared_cores: float | None = Field(
        None,
        gt=0,
        description="every simulated node on one machine with this many cores: while "
        "more engine calls run than cores, they share them; default: each node its own device",
    )
    callers: int = Field(
        1,
        ge=1,
        le=1024,
        description="processes placing the requests (arrivals go to them in turn); each "
        "sees the fleet through its own reports and in-flight work, as live callers do",
    )
    trace: Path | None = Field(
        None,
        description="replay this recorded trace (JSONL, see read_trace) instead of "
        "arrivals and mix; relative to the YAML file's folder",
    )
    costs_from: Path | None = Field(
        None,
        description="a call record (router.record_dir: a .jsonl file or a folder of them): "
        "each inference call takes the engine time of one of the recorded calls of its "
        "model and batch size, drawn at random among those that started near its own time "
        "into the run (the node of its name's first, when the record has one); models it "
        "has no calls of keep costs:; "
        "relative to the YAML file's folder; default: the costs: tables",
    )

    _source: str = PrivateAttr("workload")
    _lines: dict[str, int] = PrivateAttr(default_factory=dict)
    _trace_cache: list[Arrival] | None = PrivateAttr(None)
    _times_cache: EngineTimes | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> Workload:
        if info.context and info.context.get(_DEFER):
            return self  # parse_workload reports the problems with their lines
        problems = self._problems()
        if problems:
            raise ValueError("; ".join(f"{path}: {msg}" for path, msg in problems))
        return self

    def _problems(self) -> list[tuple[str, str]]:
        """What the schema cannot say on its own, each as (dotted path, message)."""
        out: list[tuple[str, str]] = []
        if self.churn is not None and self.fleet_events.node_failures is not None:
            out.append(
                (
                    "churn",
                    "churn and events.node_failures both take devices down and bring them "
                    "back; use one of them",
                )
            )
        if (
            self.churn is not None
            and self.churn.rejoin_after_s is None
            and self.churn.rejoin_distribution != "exponential"
        ):
            out.append(("churn.rejoin_distribution", "needs rejoin_after_s"))
        if self.trace is not None:
            for name, value in (("arrivals", self.arrival_process), ("mix", self.mix)):
                if value is not None:
                    out.append((name, "a trace replaces arrivals and mix; remove one or the other"))
            return out
        a = self.arrival_process
        if a is None:
            out.append(("arrivals", "required (or trace: to replay a recorded trace)"))
        else:
            if a.rate is None and a.rate_per_node is None:
                out.append(("arrivals", "set rate (the fleet's) or rate_per_node"))
            elif a.rate is not None and a.rate_per_node is not None:
                out.append(("arrivals.rate_per_node", "set only one of rate and rate_per_node"))
            for name in ("bursts", "diurnal", "periodic"):
                required = name != "periodic"  # periodic: its defaults are exact, random phases
                if a.process == name and getattr(a, name) is None and required:
                    out.append((f"arrivals.{name}", f"required with process: {name}"))
                elif a.process != name and getattr(a, name) is not None:
                    out.append((f"arrivals.{name}", f"only used with process: {name}"))
            if a.bursts is not None and a.bursts.length_s >= a.bursts.every_s:
                out.append(("arrivals.bursts.length_s", "must be shorter than every_s"))
            if self.requests is None and self.duration_s is None:
                out.append(
                    ("arrivals", "nothing ends the arrivals: set requests and/or duration_s")
                )
        if self.mix is not None:
            if not self.mix:
                out.append(("mix", "at least one class of traffic is required"))
            elif sum(c.weight for c in self.mix) <= 0:
                out.append(("mix", "the weights add up to 0"))
            for i, c in enumerate(self.mix):
                if c.sessions is not None and c.generate is None:
                    out.append((f"mix.{i}.sessions", "sessions are for generations; add generate:"))
        elif a is not None:
            out.append(("mix", "required: at least one class of traffic"))
        return out

    # -- checks against the fleet ------------------------------------------------------

    def _at(self, path: str) -> str:
        return f"{path}{_where(self._lines, path)}"

    def check(
        self,
        priorities: Mapping[str, int],
        models: Collection[str],
        costed: Collection[str] | None = None,
    ) -> None:
        """Raise ConfigError naming every class of traffic the fleet cannot take: a model
        it does not serve (``mix.N.model``), an unknown priority class (``mix.N.priority``),
        a model of the recorded trace it does not serve."""
        served = ", ".join(sorted(models))
        known = ", ".join(f"{k} ({v})" for k, v in priorities.items())
        problems: list[str] = []
        for i, c in enumerate(self.mix or []):
            if c.model not in models:
                problems.append(
                    f"{self._at(f'mix.{i}.model')}: the fleet does not serve {c.model!r}; "
                    f"it serves: {served}"
                )
            if isinstance(c.priority, str) and c.priority not in priorities:
                problems.append(
                    f"{self._at(f'mix.{i}.priority')}: unknown priority class "
                    f"{c.priority!r}; known: {known}, or an int {PRIORITY_RANGE}"
                )
        used = self.models()
        costed = self.costs if costed is None else costed
        for model in sorted(used & set(models) - set(costed)):
            problems.append(
                f"{self._at('costs')}: no engine time for {model!r}: add "
                f"costs.{model}.call_ms (a decoder: prefill_ms_per_token and step_ms)"
            )
        if sum(c.share for c in self.node_classes) > 1 + 1e-9:
            problems.append(f"{self._at('node_classes')}: the shares add up to more than 1")
        if self.trace is not None:
            counts = Counter(a.model for a in self._recorded() if a.model not in models)
            for model, n in sorted(counts.items()):
                problems.append(
                    f"{self._at('trace')}: {n} arrivals of {self.trace} are for {model!r}, "
                    f"which the fleet does not serve; it serves: {served}"
                )
        if problems:
            raise ConfigError(
                f"workload {self._source} does not fit the fleet:\n  " + "\n  ".join(problems)
            )

    def models(self) -> set[str]:
        """The models the arrivals are for (of the mix, or of the recorded trace)."""
        used = {c.model for c in self.mix or []}
        if self.trace is not None:
            used |= {a.model for a in self._recorded()}
        return used

    def speeds(self, nodes: int) -> list[float]:
        """Engine speed of each of ``nodes`` nodes: the classes in order, by share; the
        rest speed 1."""
        out: list[float] = []
        for c in self.node_classes:
            out += [c.speed] * round(c.share * nodes)
        return (out + [1.0] * nodes)[:nodes]

    def _resolve_priorities(self, priorities: Mapping[str, int]) -> list[int]:
        out: list[int] = []
        known = ", ".join(f"{k} ({v})" for k, v in priorities.items())
        for i, c in enumerate(self.mix or []):
            if isinstance(c.priority, int):
                out.append(c.priority)
            elif c.priority in priorities:
                out.append(priorities[c.priority])
            else:
                raise ConfigError(
                    f"workload {self._source}: {self._at(f'mix.{i}.priority')}: unknown "
                    f"priority class {c.priority!r}; known: {known}, or an int {PRIORITY_RANGE}"
                )
        return out

    def _recorded(self) -> list[Arrival]:
        if self._trace_cache is None:
            assert self.trace is not None
            self._trace_cache = read_trace(self.trace)
        return self._trace_cache

    def engine_times(self) -> EngineTimes:
        """The recorded engine times of ``costs_from`` (read once); empty without it."""
        if self.costs_from is None:
            return {}
        if self._times_cache is None:
            self._times_cache = read_engine_times(self.costs_from)
        return self._times_cache

    # -- arrivals ----------------------------------------------------------------------

    def fleet_rate(self, nodes: int) -> float | None:
        """The base arrival rate (requests/s) of a fleet of ``nodes``; None for a trace."""
        a = self.arrival_process
        if a is None:
            return None
        return a.rate if a.rate is not None else (a.rate_per_node or 0.0) * nodes

    def mean_rate(self, nodes: int) -> float | None:
        """The long-run mean arrival rate (requests/s) of a fleet of ``nodes``: the base
        rate, raised by the bursts or lowered by the diurnal trough; None for a trace."""
        rate, a = self.fleet_rate(nodes), self.arrival_process
        if rate is None or a is None:
            return None
        if a.process == "bursts" and a.bursts is not None:
            b = a.bursts
            return rate * (1 + (b.factor - 1) * b.length_s / b.every_s)
        if a.process == "diurnal" and a.diurnal is not None:
            return rate * (1 + a.diurnal.low) / 2
        return rate

    def arrivals(
        self,
        rng: random.Random,
        *,
        nodes: int,
        requests: int | None = None,
        priorities: Mapping[str, int] = DEFAULT_PRIORITIES,
    ) -> Iterator[Arrival]:
        """The arrivals, lazily and in time order, until ``requests`` of them (the argument,
        else the file's ``requests``) or ``duration_s``, whichever comes first.

        Draws from ``rng`` once, now (a seed for the generator's own stream), so later
        uses of ``rng`` do not change the arrivals. Raises ConfigError for a priority class
        not in ``priorities`` (:meth:`check` reports that and more before a run).
        """
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        if requests is not None and requests < 0:
            raise ValueError(f"requests must be >= 0, got {requests}")
        limit = requests if requests is not None else self.requests
        if self.trace is not None:
            return _replay(self._recorded(), limit, self.duration_s)
        if limit is None and self.duration_s is None:
            raise ConfigError(
                f"workload {self._source}: nothing ends the arrivals: set requests and/or "
                "duration_s"
            )
        assert self.arrival_process is not None and self.mix is not None
        resolved = self._resolve_priorities(priorities)
        rate = self.fleet_rate(nodes)
        assert rate is not None
        gen = np.random.default_rng(rng.getrandbits(128))
        classes = [
            _Class(
                model=c.model,
                priority=p,
                rows=c.rows,
                deadline_s=None if c.deadline_ms is None else c.deadline_ms / 1000.0,
                keys=c.keys or 0,
                sessions=c.sessions or 0,
                prompt_tokens=c.generate.prompt_tokens if c.generate else 0,
                max_new_tokens=c.generate.max_new_tokens if c.generate else 0,
                at_most_once=c.at_most_once,
            )
            for c, p in zip(self.mix, resolved, strict=True)
        ]
        weights = np.array([c.weight for c in self.mix], dtype=float)
        if self.arrival_process.process == "periodic":
            periodic = self.arrival_process.periodic or PeriodicConfig()
            streams = _streams(gen, periodic, rate * weights / weights.sum(), classes)
            return _merge(streams, limit=limit, duration_s=self.duration_s)
        peak, accept = _intensity(self.arrival_process, rate)
        return _generate(
            gen,
            peak=peak,
            accept=accept,
            cumulative=np.cumsum(weights / weights.sum()),
            classes=classes,
            limit=limit,
            duration_s=self.duration_s,
        )

    # -- events ------------------------------------------------------------------------

    def events(self, rng: random.Random, *, nodes: int, horizon_s: float) -> list[FleetEvent]:
        """Node failures, rejoins and lifecycle changes up to ``horizon_s``, in time order.

        A failure picks a node that is up; a failed node rejoins ``down_s`` later (if that
        is within the horizon) and can fail again after. A lifecycle change picks its nodes
        at random from the whole fleet, whether up or down. With ``churn``, the churning
        devices (``share`` of them, drawn at random) leave and come back (``leave`` and
        ``join`` events; see :class:`ChurnConfig`), drawn after the rest so they do not
        change them.
        """
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        out: list[FleetEvent] = []
        failures = self.fleet_events.node_failures
        if failures is not None and failures.per_minute > 0:
            out += _failures(rng, nodes, horizon_s, failures.per_minute / 60.0, failures.down_s)
        for change in self.fleet_events.lifecycle:
            if change.at_s > horizon_s:
                continue
            count = min(nodes, max(1, round(change.share * nodes)))
            for node in sorted(rng.sample(range(nodes), count)):
                out.append(FleetEvent(change.at_s, "lifecycle", node, change.state))
        if self.churn is not None:
            out += _churn(rng, nodes, horizon_s, self.churn)
        out.sort(key=lambda e: e.at)  # stable: failures before lifecycle changes at a tie
        return out


# -- generation ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Class:
    model: str
    priority: int
    rows: int
    deadline_s: float | None
    keys: int  # 0: no key
    sessions: int  # 0: no session
    prompt_tokens: int
    max_new_tokens: int
    at_most_once: bool = False

    def arrival(self, at: float, key: str | None, session: str | None) -> Arrival:
        return Arrival(
            at,
            self.model,
            self.priority,
            self.rows,
            self.deadline_s,
            key,
            session,
            self.prompt_tokens,
            self.max_new_tokens,
            at_most_once=self.at_most_once,
        )


_Accept = Callable[[np.ndarray], np.ndarray] | None


def _intensity(a: ArrivalsConfig, rate: float) -> tuple[float, _Accept]:
    """The peak rate, and the probability of keeping a candidate arriving at each time
    (None: keep all), for thinning a Poisson process at the peak rate."""
    if a.process == "bursts":
        assert a.bursts is not None
        every, length, factor = a.bursts.every_s, a.bursts.length_s, a.bursts.factor
        peak = rate * max(1.0, factor)
        inside, outside = rate * factor / peak, rate / peak

        def bursts(t: np.ndarray) -> np.ndarray:
            in_burst = (t >= every) & (np.fmod(t, every) < length)
            return np.where(in_burst, inside, outside)

        return peak, bursts
    if a.process == "diurnal":
        assert a.diurnal is not None
        period, low = a.diurnal.period_s, a.diurnal.low

        def diurnal(t: np.ndarray) -> np.ndarray:
            return low + (1 - low) * (1 - np.cos(2 * np.pi * t / period)) / 2

        return rate, diurnal
    return rate, None


def _generate(
    gen: np.random.Generator,
    *,
    peak: float,
    accept: _Accept,
    cumulative: np.ndarray,
    classes: Sequence[_Class],
    limit: int | None,
    duration_s: float | None,
) -> Iterator[Arrival]:
    """Arrivals from candidates at the peak rate, drawn a chunk at a time. Every draw is
    made for every candidate, so a run cut short gets a prefix of a longer one."""
    left = math.inf if limit is None else limit
    end = math.inf if duration_s is None else duration_s
    t = 0.0
    last = len(classes) - 1
    keys = np.array([c.keys for c in classes])
    sessions = np.array([c.sessions for c in classes])
    while left > 0 and t < end:
        times = t + np.cumsum(gen.exponential(1.0 / peak, _CHUNK))
        keep = gen.random(_CHUNK)
        which = np.minimum(np.searchsorted(cumulative, gen.random(_CHUNK), side="right"), last)
        key = (gen.random(_CHUNK) * keys[which]).astype(np.int64)
        session = (gen.random(_CHUNK) * sessions[which]).astype(np.int64)
        t = float(times[-1])
        mask = times < end
        if accept is not None:
            mask &= keep < accept(times)
        if not mask.all():
            times, which, key, session = times[mask], which[mask], key[mask], session[mask]
        if len(times) > left:
            n = int(left)
            times, which, key, session = times[:n], which[:n], key[:n], session[:n]
        left -= len(times)
        for at, c, k, s in zip(
            times.tolist(), which.tolist(), key.tolist(), session.tolist(), strict=True
        ):
            spec = classes[c]
            yield spec.arrival(
                at, f"k{k}" if spec.keys else None, f"s{s}" if spec.sessions else None
            )


class _Stream:
    """One periodic stream: slot ``n`` at ``(phase + n) x interval``, each arrival up to
    ``jitter x interval`` after its slot. Its draws (jitter, session) come from its own
    generator, so they do not depend on the other streams or on where a run stops."""

    def __init__(
        self,
        spec: _Class,
        key: str | None,
        interval: float,
        phase: float,
        jitter: float,
        gen: np.random.Generator,
    ) -> None:
        self.spec, self.key, self.interval = spec, key, interval
        self._phase, self._jitter, self._gen = phase, jitter, gen
        self._n = 0
        self._draws = np.empty((0, 2))
        self._used = 0

    def next(self) -> tuple[float, str | None]:
        """The time of the stream's next arrival, and its session."""
        if self._used == len(self._draws):
            self._draws, self._used = self._gen.random((_STREAM_CHUNK, 2)), 0
        late, session = self._draws[self._used]
        self._used += 1
        at = (self._phase + self._n) * self.interval + late * self._jitter * self.interval
        self._n += 1
        sessions = self.spec.sessions
        return at, f"s{int(session * sessions)}" if sessions else None


_STREAM_CHUNK = 256  # draws per periodic stream and NumPy call


def _streams(
    gen: np.random.Generator,
    config: PeriodicConfig,
    class_rates: np.ndarray,
    classes: Sequence[_Class],
) -> list[_Stream]:
    """The periodic streams of the mix: one per class, or one per dedup key of a class
    with keys, each at the class's rate over its streams (classes of weight 0: none)."""
    shape: list[tuple[_Class, str | None, float]] = []
    for spec, class_rate in zip(classes, class_rates.tolist(), strict=True):
        if class_rate <= 0:
            continue
        n = spec.keys or 1
        for k in range(n):
            shape.append((spec, f"k{k}" if spec.keys else None, n / class_rate))
    aligned = config.phase == "aligned"
    phases = [0.0] * len(shape) if aligned else gen.random(len(shape)).tolist()
    gens = gen.spawn(len(shape))
    return [
        _Stream(spec, key, interval, phase, config.jitter, g)
        for (spec, key, interval), phase, g in zip(shape, phases, gens, strict=True)
    ]


def _merge(
    streams: Sequence[_Stream], *, limit: int | None, duration_s: float | None
) -> Iterator[Arrival]:
    """The streams' arrivals in time order (a tie: the earlier stream first)."""
    left = math.inf if limit is None else limit
    end = math.inf if duration_s is None else duration_s
    heap: list[tuple[float, int, str | None]] = []
    for i, stream in enumerate(streams):
        at, session = stream.next()
        if at < end:
            heap.append((at, i, session))
    heapq.heapify(heap)
    while heap and left > 0:
        at, i, session = heap[0]
        stream = streams[i]
        yield stream.spec.arrival(at, stream.key, session)
        left -= 1
        nxt, session = stream.next()
        if nxt < end:
            heapq.heapreplace(heap, (nxt, i, session))
        else:
            heapq.heappop(heap)


def _replay(
    recorded: Sequence[Arrival], limit: int | None, duration_s: float | None
) -> Iterator[Arrival]:
    for i, arrival in enumerate(recorded):
        if (limit is not None and i >= limit) or (
            duration_s is not None and arrival.at >= duration_s
        ):
            return
        yield arrival


def _failures(
    rng: random.Random, nodes: int, horizon_s: float, per_node_s: float, down_s: float | None
) -> list[FleetEvent]:
    """Failures of the nodes that are up, each node at ``per_node_s`` per second, and the
    rejoins ``down_s`` after each."""
    away = None if down_s is None else (lambda: down_s)
    return _absences(rng, list(range(nodes)), horizon_s, per_node_s, away, ("fail", "rejoin"))


def _churn(rng: random.Random, nodes: int, horizon_s: float, c: ChurnConfig) -> list[FleetEvent]:
    """Leaves of the churning devices that are in the fleet, each at
    ``leave_per_device_per_hour``, and the joins after each (an absence drawn as
    ``rejoin_distribution`` says, with mean ``rejoin_after_s``)."""
    count = min(nodes, max(1, round(c.share * nodes)))
    churning = list(range(nodes)) if count == nodes else sorted(rng.sample(range(nodes), count))
    mean = c.rejoin_after_s
    away: Callable[[], float] | None = None
    if mean is not None:
        exponential = c.rejoin_distribution == "exponential"
        away = (lambda: rng.expovariate(1.0 / mean)) if exponential else (lambda: mean)
    per_s = c.leave_per_device_per_hour / 3600.0
    return _absences(rng, churning, horizon_s, per_s, away, ("leave", "join"))


def _absences(
    rng: random.Random,
    members: list[int],
    horizon_s: float,
    per_s: float,
    away: Callable[[], float] | None,
    kinds: tuple[Literal["fail", "leave"], Literal["rejoin", "join"]],
) -> list[FleetEvent]:
    """Each of ``members`` that is present leaves at ``per_s`` per second (a Poisson
    process over the present ones) and comes back ``away()`` seconds later (never, with
    no ``away``); the events, ``kinds`` naming a departure and a return."""
    gone, back = kinds
    out: list[FleetEvent] = []
    present = list(members)
    returns: list[tuple[float, int]] = []
    t = 0.0
    while True:
        leave_at = t + rng.expovariate(len(present) * per_s) if present else math.inf
        return_at = returns[0][0] if returns else math.inf
        if min(leave_at, return_at) > horizon_s:
            return out
        if return_at <= leave_at:  # a return first; the leave clock restarts (memoryless)
            t, node = heapq.heappop(returns)
            present.append(node)
            out.append(FleetEvent(t, back, node))
            continue
        t = leave_at
        i = rng.randrange(len(present))
        node = present[i]
        present[i] = present[-1]
        present.pop()
        out.append(FleetEvent(t, gone, node))
        if away is not None:
            heapq.heappush(returns, (t + away(), node))


# -- reading files ---------------------------------------------------------------------


def parse_workload(
    data: Mapping[str, Any],
    *,
    source: str = "workload",
    lines: Mapping[str, int] | None = None,
    base_dir: str | Path | None = None,
) -> Workload:
    """Validate a parsed YAML mapping. ``source`` names it in errors, ``lines`` maps dotted
    YAML paths to line numbers for them; a relative ``trace`` or ``costs_from`` resolves
    against ``base_dir`` (default: the working directory) and must exist."""
    lines = dict(lines or {})
    header = f"invalid workload {source}:\n"
    try:
        workload = Workload.model_validate(data, context={_DEFER: True})
    except ValidationError as exc:
        raise ConfigError(header + _format_errors(exc, lines).partition("\n")[2]) from None
    problems = [f"{path}{_where(lines, path)}: {msg}" for path, msg in workload._problems()]
    for name in ("trace", "costs_from"):
        value = getattr(workload, name)
        if value is None:
            continue
        resolved = Path(base_dir or ".") / value
        if not resolved.exists():
            problems.append(f"{name}{_where(lines, name)}: no such file or folder: {resolved}")
        workload = workload.model_copy(update={name: resolved})
    if problems:
        raise ConfigError(header + "  " + "\n  ".join(problems))
    workload._source = source
    workload._lines = lines
    return workload


def load_workload(path: str | Path) -> Workload:
    """Read and validate a workload YAML file."""
    path = Path(path)
    data, lines = read_yaml(path, "workload", "(arrivals:, mix:, ...)")
    return parse_workload(data, source=str(path), lines=lines, base_dir=path.parent)


def _number(v: object) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _integer(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _text(v: object) -> bool:
    return isinstance(v, str) and v != ""


# field -> (required, is it valid, what it must be)
_TRACE_FIELDS: dict[str, tuple[bool, Callable[[Any], bool], str]] = {
    "at": (True, _number, "a number (seconds)"),
    "model": (True, _text, "a non-empty string"),
    "priority": (
        True,
        lambda v: _integer(v) and is_priority(v),
        f"an int {PRIORITY_RANGE}",
    ),
    "rows": (False, lambda v: _integer(v) and v >= 1, "an int >= 1"),
    "deadline_s": (False, lambda v: v is None or (_number(v) and v > 0), "null or a number > 0"),
    "key": (False, lambda v: v is None or _text(v), "null or a non-empty string"),
    "session": (False, lambda v: v is None or _text(v), "null or a non-empty string"),
    "prompt_tokens": (False, lambda v: _integer(v) and v >= 0, "an int >= 0"),
    "max_new_tokens": (False, lambda v: _integer(v) and v >= 0, "an int >= 0"),
    "id": (False, lambda v: v is None or _text(v), "null or a non-empty string"),
}


def read_trace(path: str | Path) -> list[Arrival]:
    """The arrivals of a recorded trace, sorted by time, the first at 0.

    ``path`` is a file, or a folder: every ``*.jsonl`` file in it (the call records of a
    fleet's callers, ``router.record_dir``), merged by ``at``. One JSON object a line, as
    callers record it (see ``cluster/record.py``)::

        {"at": 1767268800.123, "id": "r-1", "model": "classifier", "priority": 10,
         "rows": 1, "deadline_s": 0.2, "key": null, "session": null, "prompt_tokens": 0,
         "max_new_tokens": 0, "outcome": "completed", "latency_s": 0.0123, "node": "edge-0",
         "service_ms": 4.1, "queue_ms": 0.3, "batch": 1}

    ``at`` (seconds on any time line the files share, unix time as recorded),
    ``model`` and ``priority`` are required; the other fields of :class:`Arrival` take
    its defaults when missing, and keys it does not have (``outcome``, ``latency_s``,
    ``node``, ``service_ms``, ``queue_ms``, ``batch``: what the live fleet answered)
    are ignored. Blank lines are skipped, as is
    a file's last line that is cut short (no newline at its end, not valid JSON: the
    recorder was stopped while writing it). Anything else that is wrong raises
    ConfigError naming ``file:line`` and the field; so does a folder without a
    ``*.jsonl`` file.
    """
    path = Path(path)
    rows = [row for file in _jsonl_files(path, "trace") for row in _read_rows(file)]
    rows.sort(key=lambda r: r[0])
    start = rows[0][0] if rows else 0.0
    return [
        Arrival(at - start, model, priority, n, deadline, key, session, prompt, new, rid)
        for at, model, priority, n, deadline, key, session, prompt, new, rid in rows
    ]


def read_engine_times(path: str | Path) -> EngineTimes:
    """Engine time of the calls a call record's completed inferences ran in, by model and
    the call's size in rows (``service_ms`` and ``call_rows`` of each line, see
    ``cluster/record.py``; a line without ``call_rows``: ``batch``, its requests),
    each with when it started (``at`` plus ``queue_ms``, seconds after the record's first
    arrival), in that order; a call of ``n`` requests appears once for each of them.
    Each also has the time its request spent outside its node (``latency_s`` less
    ``queue_ms`` and ``service_ms``: both hops and the caller's own work), None on a line
    without ``latency_s``: a call slowed by a busy machine tends to come with a slow way
    back, and a simulation draws the two together. And the node that ran it (``node``)
    and the call's hand-off (``handoff_ms``: its node's time from being ready for it to
    its start, the last part of ``queue_ms``) and abort wait (``abort_ms``: how long the
    call aborted just before it took to stop), None on a line without them.

    ``path`` is a file or a folder of ``*.jsonl`` files, read as :func:`read_trace` reads
    them, each line checked as a trace line is. Lines without the figures (no node
    answered, a generation, a line written without them) and lines of requests that did
    not complete are skipped. ConfigError names ``file:line`` and the field of a wrong
    figure, and says so when no line has an engine time.
    """
    path = Path(path)
    out: EngineTimes = {}
    first = math.inf
    for file in _jsonl_files(path, "call record"):
        for number, obj in _objects(file, "call record"):
            problem = _engine_problem(obj)
            if problem is not None:
                raise ConfigError(f"{file}:{number}: {problem}")
            first = min(first, obj["at"])
            service, batch = obj.get("service_ms"), obj.get("call_rows") or obj.get("batch")
            if (
                obj.get("outcome") == "completed"
                and obj.get("prompt_tokens", 0) == 0
                and service is not None
                and service > 0
                and batch is not None
                and batch >= 1
            ):
                queue = obj.get("queue_ms") or 0.0
                started = obj["at"] + queue / 1000.0
                latency = obj.get("latency_s")
                outside = None
                if _number(latency):
                    outside = max(0.0, latency * 1000.0 - queue - service)
                calls = out.setdefault(obj["model"], {}).setdefault(batch, [])
                node = obj.get("node")
                node = node if isinstance(node, str) else None
                handoff, abort = obj.get("handoff_ms"), obj.get("abort_ms")
                calls.append(
                    RecordedCall(
                        started,
                        float(service),
                        outside,
                        node,
                        float(handoff) if _number(handoff) else None,
                        float(abort) if _number(abort) else None,
                    )
                )
    for by_size in out.values():
        for size, calls in by_size.items():
            by_size[size] = sorted(
                (c._replace(at=c.at - first) for c in calls), key=lambda c: (c.at, c.ms)
            )
    if not out and not read_generation_times(path):
        raise ConfigError(
            f"{path}: no engine times in this call record: no line of a completed inference "
            "has service_ms and batch, nor of a completed generation service_ms and "
            "new_tokens (recorded by a caller with router.record_dir)"
        )
    return out


def read_generation_times(path: str | Path) -> GenerationTimes:
    """The completed generations of a call record (``service_ms``, ``new_tokens`` and
    ``fed_tokens`` of each line of a generation, see ``cluster/record.py``), by model,
    each with its time outside its node (``latency_s`` less ``queue_ms`` and
    ``service_ms``: both hops and its tokens' way back); lines without them are
    skipped. Read as :func:`read_engine_times` reads a record."""
    out: GenerationTimes = {}
    for file in _jsonl_files(Path(path), "call record"):
        for number, obj in _objects(file, "call record"):
            problem = _engine_problem(obj)
            if problem is not None:
                raise ConfigError(f"{file}:{number}: {problem}")
            ms, made, fed = obj.get("service_ms"), obj.get("new_tokens"), obj.get("fed_tokens")
            if (
                obj.get("outcome") == "completed"
                and obj.get("prompt_tokens", 0) > 0
                and _number(ms)
                and ms > 0
                and isinstance(made, int)
                and isinstance(fed, int)
                and 1 <= made <= fed
            ):
                latency, queue = obj.get("latency_s"), obj.get("queue_ms") or 0.0
                outside = None
                if _number(latency):
                    outside = max(0.0, latency * 1000.0 - queue - ms)
                generation = RecordedGeneration(fed - made, made, float(ms), outside)
                out.setdefault(obj["model"], []).append(generation)
    return out


# field -> (is it valid, what it must be): the node's figures in a call record's line
_MS: tuple[Callable[[Any], bool], str] = (
    lambda v: v is None or (_number(v) and v >= 0),
    "null or a number >= 0",
)
_ENGINE_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "service_ms": _MS,
    "queue_ms": _MS,
    "batch": (lambda v: v is None or (_integer(v) and v >= 0), "null or an int >= 0"),
    "call_rows": (lambda v: v is None or (_integer(v) and v >= 0), "null or an int >= 0"),
    "handoff_ms": _MS,
    "abort_ms": _MS,
    "new_tokens": (lambda v: v is None or (_integer(v) and v >= 0), "null or an int >= 0"),
    "fed_tokens": (lambda v: v is None or (_integer(v) and v >= 0), "null or an int >= 0"),
    "outcome": (lambda v: isinstance(v, str), "a string"),
}


def _engine_problem(obj: dict[str, Any]) -> str | None:
    """What is wrong with a call record's line, naming the field; None: nothing."""
    if _trace_row(obj) is None:
        return _trace_problem(obj)
    for name, (valid, what) in _ENGINE_FIELDS.items():
        if name in obj and not valid(obj[name]):
            return f"{name}: must be {what}, got {obj[name]!r}"
    return None


def _jsonl_files(path: Path, what: str) -> list[Path]:
    """``path``, or the ``*.jsonl`` files of the folder ``path`` in name order."""
    if not path.is_dir():
        return [path]
    files = sorted(path.glob("*.jsonl"))
    if not files:
        raise ConfigError(f"cannot read {what} {path}: a folder without *.jsonl files")
    return files


def _objects(path: Path, what: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """Each line of a JSONL file as (line number, object); blank lines skipped, and a last
    line cut short (no newline after it, not valid JSON)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    lines = text.split("\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):  # no newline after it: a write cut short
                return
            raise ConfigError(f"{path}:{number}: not valid JSON: {exc.msg}") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{path}:{number}: a line must be a JSON object")
        yield number, obj


def _read_rows(path: Path) -> list[_TraceRow]:
    """The lines of one trace file, in file order."""
    rows: list[_TraceRow] = []
    for number, obj in _objects(path, "trace"):
        row = _trace_row(obj)
        if row is None:
            raise ConfigError(f"{path}:{number}: {_trace_problem(obj)}")
        rows.append(row)
    return rows


_TraceRow = tuple[float, str, int, int, float | None, str | None, str | None, int, int, str | None]


def _trace_row(obj: dict[str, Any]) -> _TraceRow | None:
    """The fields of one trace line, or None when one is missing or wrong."""
    get = obj.get
    at, model, priority = get("at"), get("model"), get("priority")
    rows, deadline = get("rows", 1), get("deadline_s")
    key, session, rid = get("key"), get("session"), get("id")
    prompt, new = get("prompt_tokens", 0), get("max_new_tokens", 0)
    if (
        (type(at) is float or type(at) is int)
        and math.isfinite(at)
        and type(model) is str
        and model
        and type(priority) is int
        and is_priority(priority)
        and type(rows) is int
        and rows >= 1
        and (deadline is None or _TRACE_FIELDS["deadline_s"][1](deadline))
        and (key is None or (type(key) is str and key))
        and (session is None or (type(session) is str and session))
        and (rid is None or (type(rid) is str and rid))
        and type(prompt) is int
        and prompt >= 0
        and type(new) is int
        and new >= 0
    ):
        deadline = None if deadline is None else float(deadline)
        return (float(at), model, priority, rows, deadline, key, session, prompt, new, rid)
    return None


def _trace_problem(obj: dict[str, Any]) -> str:
    """What is wrong with a trace line :func:`_trace_row` refused, naming the field."""
    for name, (required, valid, what) in _TRACE_FIELDS.items():
        if name not in obj:
            if required:
                return f"{name}: missing"
        elif not valid(obj[name]):
            return f"{name}: must be {what}, got {obj[name]!r}"
    return "not a trace line"


__all__ = [
    "Arrival",
    "ChurnConfig",
    "EngineTimes",
    "RecordedCall",
    "FleetEvent",
    "Workload",
    "load_workload",
    "parse_workload",
    "read_engine_times",
    "read_trace",
]
