"""The fleet configuration: one pydantic schema for the whole YAML file.

Unknown keys are errors. Paths resolve relative to the YAML file and must stay
inside ``model_dir``. :func:`load_config` reports every problem by its YAML path,
with the line where it can.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from edgefleet.artifacts import ModelArtifact
from edgefleet.errors import ConfigError, ModelNotFound
from edgefleet.labels import Selector, parse_selector
from edgefleet.priorities import (
    DEFAULT_PRIORITIES,
    MAX_PRIORITY,
    MIN_PRIORITY,
    PRIORITY_RANGE,
    is_priority,
)
from edgefleet.providers import CPU, ProviderConfig, provider_name
from policies.budget import Lifecycle
from policies.ordering import QueueOrderName
from policies.placement.registry import DEFAULT_SHED, PipelineParams, PlacementParams
from policies.starvation import ClassBound, StarvationParams

MiB = 1024 * 1024
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"  # fleets, nodes and pools
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$"  # no '@': `model@version` names one
MODEL_CACHE_HELP = (
    "where a node keeps the model files it fetched, on its own device (an absolute path "
    "or one starting with ~); default: edgefleet/models under the device's user cache "
    "folder ($XDG_CACHE_HOME, else ~/.cache)"
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BatchingConfig(_Strict):
    """How a node groups requests for one model into a batch."""

    window_ms: float = Field(0.0, ge=0, le=10_000, description="0 = never wait for a batch")
    max_batch_size: int = Field(1, ge=1, le=4096, description="rows per engine call")
    pad_to: list[int] = Field(
        default_factory=list, description="batch sizes to pad to; padded rows are dropped"
    )
    only_if_faster: bool = Field(
        True, description="measure at warm-up; never wait for a batch that would not pay"
    )
    min_gain: float = Field(
        0.25,
        ge=0,
        lt=1,
        description="per-row cost must fall by this fraction to batch at all: waiting for "
        "companions costs latency, and a smaller gain is within the noise of the warm-up "
        "measurement (e.g. 0.25: four rows must cost at most three single calls)",
    )
    lower_priority_cost_bound: float = Field(
        0.10,
        ge=0,
        description="rows of lower priority than a call's leader join it only while the "
        "measured cost per batch size says they lengthen the call by at most this fraction",
    )
    adaptive_window: bool = Field(
        True,
        description="a request alone does not wait when recent arrivals say no request that "
        "could join it is due before the window ends (once one has joined, the window runs "
        "its course); false: always wait the window out",
    )

    @field_validator("pad_to")
    @classmethod
    def _sorted_positive(cls, v: list[int]) -> list[int]:
        if any(size < 1 for size in v):
            raise ValueError("pad sizes must be >= 1")
        return sorted(set(v))


class GenerationConfig(_Strict):
    """Settings of a decoder (``kind: decoder``) model."""

    max_context: int | None = Field(
        None,
        ge=2,
        description="tokens the model can attend to; default: read from the model "
        "(metadata or a config.json beside it)",
    )
    stop_ids: list[int] = Field(
        default_factory=list,
        description="token ids that end a generation; default: the model's eos_token_id "
        "(generation_config.json or config.json beside it); a request's own replace them",
    )
    max_new_tokens: int = Field(4096, ge=1, description="the most a request may ask for")
    decode_batch: int = Field(
        4,
        ge=1,
        le=64,
        description="generations of one priority decoded together, sharing each engine "
        "step (1: one at a time)",
    )
    prefill_chunk: int = Field(
        0,
        ge=0,
        description="prompt tokens fed per engine call (0: the whole prompt at once); a "
        "pause aborts the prefill call in progress, so this bounds the work redone",
    )


class ModelConfig(_Strict):
    """One model a node can serve."""

    path: Path = Field(
        description="the ONNX file, relative to model_dir; it must resolve (symlinks "
        "followed) inside model_dir. May be left out when `variants` gives the files: "
        "then the cpu variant, else the first"
    )
    kind: Literal["tensor", "decoder"] = Field(
        "tensor",
        description="'tensor': infer() with named arrays; 'decoder': a causal language "
        "model in the Optimum layout (input_ids, attention_mask, past_key_values.*), "
        "used with generate()",
    )
    version: str | None = Field(
        None,
        pattern=VERSION_PATTERN,
        description="the version nodes report and callers may pin (`model@version`); "
        "default: the first 12 hex digits of the sha256 of the model's files",
    )
    generation: GenerationConfig = GenerationConfig()
    threads: int = Field(1, ge=1, le=64, description="ONNX Runtime intra-op threads")
    providers: list[ProviderConfig] = Field(
        default_factory=lambda: [CPU],
        description="execution providers, best first: a name (cpu, cuda, tensorrt, "
        "openvino, qnn, coreml, directml, ...) or {name: ..., options: {...}}. A node "
        "uses those its device's ONNX Runtime build has; a pool's or node's `providers` "
        "replaces this list on its devices",
    )
    strict: bool = Field(
        False,
        description="refuse to load (ProviderUnavailable) on a device whose ONNX Runtime "
        "lacks the first provider, or where part of the graph would fall back to the CPU; "
        "false: fall back, and say why in status",
    )
    variants: dict[str, Path] = Field(
        default_factory=dict,
        description="a file per provider, e.g. {openvino: detector-int8.onnx, cpu: "
        "detector.onnx}: a device loads the file of the first provider it runs the model "
        "on (`path` for a provider without one)",
    )
    batching: BatchingConfig = BatchingConfig()
    dedup: Literal["supersede", "follow"] = Field(
        "supersede",
        description="what the older caller of a replaced duplicate gets: "
        "'supersede' = a Superseded error, 'follow' = the newer request's result",
    )
    max_input_bytes: int = Field(
        64 * MiB,
        ge=1,
        description="the most bytes a request's inputs may hold; larger ones get "
        "InvalidInput before they are queued",
    )
    reject_non_finite: bool = Field(
        True,
        description="refuse floating-point inputs holding NaN or infinity (InvalidInput "
        "naming the input): their outputs would be NaN served as a success. Costs about "
        "25 us per MB of input; turn off for models that take infinities (masks)",
    )
    memory_mb: float | None = Field(
        None, gt=0, description="memory the loaded model takes; default: estimated at load"
    )
    warmup: bool = Field(
        True,
        description="measure the model's cost per batch size when a node starts (the costs "
        "batching, placement and max_call_s go by); false: nothing measured",
    )
    max_call_s: float | None = Field(
        None,
        gt=0,
        description="the longest one engine call of this model may run (a decoder: the "
        "longest a generation may go without making a token); a call past it is "
        "terminated and its requests get EngineTimeout. Default: "
        "node_defaults.call_timeout_factor times the cost measured at warm-up (of its "
        "largest batch, scaled up for larger calls), at least "
        "node_defaults.call_timeout_floor_s; the floor alone without warm-up. Warm-up "
        "inputs give dynamic axes other than the batch axis a size of 16: set this for "
        "a model whose calls grow with such an axis (large images) past the floor",
    )

    @model_validator(mode="before")
    @classmethod
    def _path_from_variants(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "path" not in data and data.get("variants"):
            variants = data["variants"]
            if isinstance(variants, Mapping):
                cpu = [k for k in variants if str(k).lower() in ("cpu", CPU.ort_name.lower())]
                data = {**data, "path": variants[(cpu or list(variants))[0]]}
        return data

    @field_validator("variants", mode="before")
    @classmethod
    def _variant_names(cls, v: Any) -> Any:
        if isinstance(v, Mapping):
            return {provider_name(str(k)): p for k, p in v.items()}
        return v

    def files(self) -> dict[str, Path]:
        """Every file of the model: ``path`` under the name "", and each variant."""
        return {"": self.path, **self.variants}


class QueueConfig(_Strict):
    """A node's bounded queue. When it is full, an arrival that outranks the
    lowest-priority queued request evicts it (Evicted); otherwise the arrival gets
    Rejected with a retry-after estimate."""

    capacity: int = Field(64, ge=1, le=1_000_000, description="queued requests")
    max_bytes: int = Field(256 * MiB, ge=1, description="bytes of queued inputs")


class PreemptionConfig(_Strict):
    """When an arrival aborts the engine call in progress (a generation: pauses it at the
    next token) to run first."""

    enabled: bool = Field(True, description="false: a running call always runs to its end")
    min_priority_gap: int = Field(
        5,
        ge=1,
        le=MAX_PRIORITY - MIN_PRIORITY,
        description="an arrival preempts only a call whose priority is at least this much "
        "lower than its own",
    )


class StarvationClass(_Strict):
    """What one priority class is guaranteed against higher classes."""

    min_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="share of engine time (over the last 2 s) below which the class's "
        "queued work leads the next call; 0: none",
    )
    max_wait_ms: float | None = Field(
        None,
        gt=0,
        description="the longest a request of the class should wait: it leads a call (its "
        "priority rises) once three more calls would take it past this; default: no maximum",
    )

    @model_validator(mode="after")
    def _sets_a_bound(self) -> StarvationClass:
        if self.min_share == 0 and self.max_wait_ms is None:
            raise ValueError("set min_share and/or max_wait_ms")
        return self


class StarvationConfig(_Strict):
    """Starvation bounds: promoted lower-priority work runs ahead of higher classes, except
    protected ones (see policies/starvation.py)."""

    classes: dict[str, StarvationClass] = Field(
        default_factory=dict, description="priority class -> its bound; default: none"
    )
    protected: list[str] | None = Field(
        None,
        description="classes that promoted lower work never delays; default: the highest class",
    )

    def problems(self, where: str, priorities: Mapping[str, int]) -> list[str]:
        """What is wrong with the class names and shares, each naming its YAML path."""
        known = ", ".join(priorities)
        out = [
            f"{where}.classes.{name}: unknown priority class {name!r}; known: {known}"
            for name in self.classes
            if name not in priorities
        ]
        out += [
            f"{where}.protected: unknown priority class {name!r}; known: {known}"
            for name in self.protected or []
            if name not in priorities
        ]
        total = sum(c.min_share for c in self.classes.values())
        if total > 1:
            out.append(f"{where}.classes: min_share values add up to {total:g}; at most 1")
        return out

    def params(self, priorities: Mapping[str, int]) -> StarvationParams:
        """The scheduler's parameters, with class names resolved to priorities."""
        protected = self.protected
        if protected is None:
            protected = [max(priorities, key=lambda n: priorities[n])] if priorities else []
        return StarvationParams(
            bounds={
                priorities[name]: ClassBound(
                    c.min_share, None if c.max_wait_ms is None else c.max_wait_ms / 1000.0
                )
                for name, c in self.classes.items()
            },
            protected=frozenset(priorities[name] for name in protected),
            classes=tuple(sorted(set(priorities.values()))),
        )


def _default_token_budget() -> dict[Lifecycle, dict[str, float]]:
    return {"background": {"background": 0.25, "offline": 0.25}}


class NodeDefaults(_Strict):
    """Settings of every node; a node of ``nodes:`` or a pool may override some."""

    queue: QueueConfig = QueueConfig()
    preemption: PreemptionConfig = PreemptionConfig()
    memory_budget_mb: float = Field(
        2048,
        gt=0,
        description="memory for resident models; past it the least recently used model "
        "is unloaded to make room for one loaded on demand",
    )
    kv_budget_mb: float = Field(
        256,
        gt=0,
        description="memory for the KV caches of running and paused generations, sessions "
        "and shared prefixes",
    )
    token_budget: dict[Lifecycle, dict[str, float]] = Field(
        default_factory=_default_token_budget,
        description="lifecycle state -> priority class -> share of max_new_tokens "
        "(0-1); unlisted classes get all of it",
    )
    lifecycle: Lifecycle = Field("foreground", description="the state a node starts in")
    order: QueueOrderName = Field(
        "priority", description="queue discipline; 'fifo' ignores priorities (a baseline)"
    )
    starvation: StarvationConfig = StarvationConfig()
    num_cpus: float = Field(0, ge=0, description="Ray CPUs reserved per node actor")
    call_timeout_factor: float = Field(
        10.0,
        ge=1,
        description="a model's default max_call_s: this many times its measured cost. "
        "Warm-up measures an idle engine; on a busy or thermally throttled device calls "
        "run a few times slower, and 10x leaves room for that while still ending a call "
        "that will not finish",
    )
    call_timeout_floor_s: float = Field(
        5.0,
        gt=0,
        description="the least default max_call_s: sub-millisecond models are measured "
        "too finely to scale, and no call of a model that fits on an edge node should "
        "take seconds unless it hangs",
    )
    stuck_after_s: float = Field(
        10.0,
        gt=0,
        description="an engine call terminated for running past max_call_s that has not "
        "stopped after this long (ONNX Runtime stops at the next operator; a wedged "
        "driver never does) makes the node stuck: it refuses new work, evicts what is "
        "queued, and reports state 'stuck' so that it can be restarted; it serves again "
        "if the call ever returns",
    )
    trace_dir: Path | None = Field(
        None,
        description="write a trace of every request each node settles (one JSON line "
        "each, a file per node process: see actors/trace.py) into this folder; relative "
        "to the YAML file's folder; default: no trace",
    )
    model_cache: Path | None = Field(None, description=MODEL_CACHE_HELP)
    model_cache_mb: float = Field(
        8192,
        gt=0,
        description="the most a node's model cache holds; past it the files of the models "
        "no node on the device used for longest are removed",
    )

    @field_validator("model_cache")
    @classmethod
    def _device_path(cls, v: Path | None) -> Path | None:
        return _device_path(v)


def _device_path(v: Path | None) -> Path | None:
    if v is not None and not (v.is_absolute() or str(v).startswith("~")):
        raise ValueError(f"{v} is relative: give an absolute path, or one starting with ~")
    return v


class _NodeSettings(_Strict):
    """What a node (``nodes:``) or every member of a pool (``pools:``) may set for itself;
    unset: the node defaults."""

    name: str = Field(
        pattern=NAME_PATTERN,
        description="the node's name (a pool's: its members are named POOL/DEVICE)",
    )
    models: list[str] | None = Field(None, description="default: every model in the file")
    queue: QueueConfig | None = Field(None, description="default: node_defaults.queue")
    preemption: PreemptionConfig | None = Field(
        None, description="default: node_defaults.preemption"
    )
    memory_budget_mb: float | None = Field(
        None, gt=0, description="default: node_defaults.memory_budget_mb"
    )
    kv_budget_mb: float | None = Field(
        None, gt=0, description="default: node_defaults.kv_budget_mb"
    )
    order: QueueOrderName | None = Field(None, description="default: node_defaults.order")
    starvation: StarvationConfig | None = Field(
        None, description="replaces node_defaults.starvation; default: node_defaults.starvation"
    )
    num_cpus: float | None = Field(None, ge=0, description="default: node_defaults.num_cpus")
    providers: list[ProviderConfig] | None = Field(
        None,
        description="execution providers for every model on this device, replacing each "
        "model's `providers`; default: the model's",
    )
    model_cache: Path | None = Field(None, description="default: node_defaults.model_cache")

    @field_validator("model_cache")
    @classmethod
    def _device_path(cls, v: Path | None) -> Path | None:
        return _device_path(v)


class NodeConfig(_NodeSettings):
    """One node of a fixed list: a node actor, placed on a machine that offers its
    ``resources`` and carries its ``labels``."""

    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources the node actor needs: pins it to matching machines",
    )
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="Ray node labels the node actor's machine must carry "
        "(`ray start --labels key=value`), e.g. {device: camera}",
    )


class PoolConfig(_NodeSettings):
    """Every Ray node whose labels match ``selector`` gets a node actor of its own,
    started when it joins the cluster and named ``POOL/DEVICE`` (see
    :mod:`edgefleet.labels`)."""

    selector: dict[str, str] = Field(
        description="Ray node labels, in Ray's selector syntax: {device: camera}, "
        "{site: 'in(s1, s2)'}, {tier: '!spare'}"
    )

    @field_validator("selector")
    @classmethod
    def _ray_syntax(cls, v: dict[str, str]) -> dict[str, str]:
        parse_selector(v)
        return v

    def matcher(self) -> Selector:
        return parse_selector(self.selector)


class LocalConfig(_Strict):
    """The embedded default: a Ray cluster on 127.0.0.1 started by ``demo``, ``up``
    without ``--address`` and ``FleetClient.local``."""

    nodes: int = Field(1, ge=1, le=64, description="simulated nodes when `nodes:` is empty")
    num_cpus: int | None = Field(None, ge=1, description="CPUs of the embedded Ray cluster")


class FleetMeta(_Strict):
    """The fleet's identity."""

    name: str = Field(
        "edgefleet",
        pattern=NAME_PATTERN,
        description="names the fleet's actors and the `fleet` label of its metrics; "
        "commands find a running fleet by it (--fleet)",
    )


class PlacementConfig(PipelineParams):
    """How callers choose a node (see policies/placement): the pipeline's plugins, the
    shedding limits by priority class, and the seed of each caller's random choices."""

    shed: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_SHED),
        description="priority class -> largest queue occupancy (0-1] that work of that "
        "priority or lower may fill on a node; keeps headroom for urgent work",
    )
    seed: int = Field(0, description="seeds each caller's random choices, with its identity")

    @field_validator("shed")
    @classmethod
    def _fractions(cls, v: dict[str, float]) -> dict[str, float]:
        for name, frac in v.items():
            if not 0 < frac <= 1:
                raise ValueError(f"shed.{name} is {frac}; allowed: a fraction in (0, 1]")
        return v

    def params(self, priorities: Mapping[str, int]) -> PlacementParams:
        """The pipeline's parameters, with shedding limits by integer priority."""
        plugins = self.model_dump(include=set(PipelineParams.model_fields))
        shed = {priorities[name]: frac for name, frac in self.shed.items()}
        return PlacementParams(**plugins, shed=shed)


class MembershipConfig(_Strict):
    """How the router follows Ray's node table for the pools (cluster/membership.py)."""

    interval_s: float = Field(
        1.0, gt=0, le=60, description="Ray's node table is read and the pools reconciled this often"
    )
    timeout_s: float = Field(
        10.0,
        gt=0,
        description="the longest a read of Ray's node table, or creating or ending a pool "
        "member's actor, may take",
    )
    retry_s: float = Field(
        1.0, gt=0, description="a member that failed to start is tried again after this..."
    )
    retry_max_s: float = Field(
        60.0,
        gt=0,
        description="...doubling each time up to this (also the longest wait "
        "between reads of a node table that cannot be read)",
    )


class RouterConfig(_Strict):
    """The fleet's router (membership, health, the fleet view) and how callers place,
    spill and bound their requests."""

    placement: PlacementConfig = PlacementConfig()
    max_attempts: int = Field(3, ge=1, le=64, description="nodes tried per request")
    report_interval_s: float = Field(0.5, gt=0, le=60, description="node status polling")
    lost_after_s: float = Field(
        3.0,
        gt=0,
        description="a node whose actor is alive but has not reported for this long is "
        "unresponsive (callers stop sending to it); one that died is lost at once",
    )
    probe_timeout_s: float = Field(
        1.0,
        gt=0,
        description="how long the router polling a node, or a caller asking a node about a "
        "request it holds, waits for the answer",
    )
    call_limit_factor: float = Field(
        4.0,
        ge=1,
        description="a request in flight past its deadline or past its expected completion "
        "x this + call_grace_s makes its caller ask the node about it: a node still holding "
        "it extends the limit; a node that does not answer within probe_timeout_s is "
        "unresponsive to that caller and the request is placed again (at_most_once ones end "
        "NodeLost)",
    )
    call_grace_s: float = Field(
        2.0, gt=0, description="added to every call's limit (see call_limit_factor)"
    )
    restart_after_s: float | None = Field(
        30.0,
        gt=0,
        description="a node unresponsive or stuck for this long is killed and Ray starts it "
        "again in place (its requests follow the node-loss rules); null: never",
    )
    membership: MembershipConfig = MembershipConfig()
    num_cpus: float = Field(0, ge=0, description="Ray CPUs reserved for the router actor")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Ray custom resources: pins the router to a machine"
    )
    record_dir: Path | None = Field(
        None,
        description="each caller (a FleetClient) appends a JSON line per request it placed, "
        "when its answer is known, to its own file in this folder (cluster/record.py), for "
        "`edgefleet simulate` to replay; relative to the YAML file's folder; default: no record",
    )


class RayClusterConfig(_Strict):
    """The Ray cluster a fleet runs on, when edgefleet starts or joins it."""

    auth: Literal["token", "none"] = Field(
        "token",
        description="'token': Ray token authentication (RAY_AUTH_MODE=token) for the Ray "
        "edgefleet starts (embedded, or the head `up --detach` starts) and for connecting "
        "to a cluster; 'none': without (RAY_AUTH_MODE=disabled)",
    )
    dashboard_port: int | None = Field(
        None,
        ge=1024,
        le=65535,
        description="serve Ray's dashboard and job API on 127.0.0.1:PORT from the head "
        "`up --detach` starts (for `ray job submit`); default: no dashboard",
    )
    start_timeout_s: float = Field(
        300.0,
        gt=0,
        description="how long `up` waits for the nodes and the router to be placed and "
        "started before it gives up, naming what they ask for, and stops what it started",
    )
    redis: bool = Field(
        False,
        description="the head `up --detach` starts keeps the cluster's state in a Redis of "
        "its own (Debian's redis-server, on 127.0.0.1, data in /tmp/edgefleet-FLEET/redis; "
        "Ray's GCS fault tolerance), so a crashed head restarted with the same settings "
        "(cluster.head.restart_head) takes the cluster back: nodes on other machines serve "
        "throughout and the router comes back. Without it a head restart ends the cluster. "
        "Costs one more process (a few MB) and a Redis write per change of cluster state",
    )


class NodeSpec(_Strict):
    """Everything one node actor needs, resolved from the fleet file."""

    name: str
    models: dict[str, ModelConfig]
    priorities: dict[str, int]
    fleet: str = "edgefleet"  # the fleet it belongs to (a label of its metrics)
    queue: QueueConfig
    preemption: PreemptionConfig
    memory_budget_mb: float
    kv_budget_mb: float = 256
    token_budget: dict[Lifecycle, dict[str, float]] = Field(default_factory=dict)
    lifecycle: Lifecycle = "foreground"
    order: QueueOrderName = "priority"
    starvation: StarvationConfig = StarvationConfig()
    num_cpus: float = 0
    resources: dict[str, float] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    pool: str | None = None  # the pool of a pool member (None: a node of `nodes:`)
    ray_node: str | None = None  # the Ray node id a pool member is pinned to
    trace_dir: Path | None = None  # where the node writes its trace (None: no trace)
    call_timeout_factor: float = 10.0  # see NodeDefaults
    call_timeout_floor_s: float = 5.0
    stuck_after_s: float = 10.0
    # The models' files as the deploy published them, fetched from the fleet's store
    # (an actor of that name) into model_cache; none: loaded from their paths.
    artifacts: dict[str, ModelArtifact] = Field(default_factory=dict)
    store: str | None = None
    model_cache: Path | None = None  # None: the device's default (see NodeDefaults)
    model_cache_mb: float = 8192


class FleetConfig(_Strict):
    """A fleet file: its models, its nodes (a fixed list and/or pools that follow the Ray
    cluster), the router and the Ray cluster it runs on."""

    fleet: FleetMeta = FleetMeta()
    local: LocalConfig = LocalConfig()
    priorities: dict[str, int] = Field(
        default_factory=lambda: dict(DEFAULT_PRIORITIES),
        description="priority class -> priority (0-10, higher runs first); requests name a "
        "class or give an integer",
    )
    model_dir: Path | None = Field(
        None, description="models must live under this folder; default: the YAML's folder"
    )
    models: dict[str, ModelConfig]
    node_defaults: NodeDefaults = NodeDefaults()
    nodes: list[NodeConfig] = Field(
        default_factory=list,
        description="a fixed list of nodes; with neither nodes nor pools, local.nodes "
        "identical nodes",
    )
    pools: list[PoolConfig] = Field(
        default_factory=list,
        description="nodes started on every Ray node whose labels match, as such nodes "
        "join the cluster (see docs/operations.md, A fleet of devices)",
    )
    router: RouterConfig = RouterConfig()
    ray: RayClusterConfig = RayClusterConfig()
    # What the deploy published (cluster/store.py): not written in the file.
    _artifacts: dict[str, ModelArtifact] = PrivateAttr(default_factory=dict)
    _store: str | None = PrivateAttr(None)

    @property
    def artifacts(self) -> dict[str, ModelArtifact]:
        """Each served model's files as the deploy published them (empty before)."""
        return dict(self._artifacts)

    @property
    def store(self) -> str | None:
        """The name of the store actor the models were published to (None before)."""
        return self._store

    def with_artifacts(self, artifacts: Mapping[str, ModelArtifact], store: str) -> FleetConfig:
        """This config with its models published to the store actor named ``store``:
        its nodes load them from their caches."""
        copy = self.model_copy()
        copy._artifacts = dict(artifacts)
        copy._store = store
        return copy

    def with_placement(self, **placement: Any) -> FleetConfig:
        """This config placing with other ``router.placement`` settings (a new
        ``policy`` brings its own preset scorers and picker); settings not given are
        kept. ConfigError naming a bad setting."""
        current = self.router.placement.model_dump(exclude_unset=True)
        if "policy" in placement:
            current.pop("scorers", None)
            current.pop("picker", None)
        try:
            changed = PlacementConfig.model_validate({**current, **placement})
        except ValidationError as exc:
            problems = "; ".join(
                f"router.placement.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()
            )
            raise ConfigError(f"invalid placement: {problems}") from None
        router = self.router.model_copy(update={"placement": changed})
        return self.model_copy(update={"router": router})

    @field_validator("priorities")
    @classmethod
    def _priority_range(cls, v: dict[str, int]) -> dict[str, int]:
        for name, value in v.items():
            if not is_priority(value):
                raise ValueError(f"priority class {name!r} is {value}; allowed {PRIORITY_RANGE}")
        return v

    @model_validator(mode="after")
    def _references(self) -> FleetConfig:
        if not self.models:
            raise ValueError("models: at least one model is required")
        known = ", ".join(self.priorities)
        for name in self.router.placement.shed:
            if name not in self.priorities:
                raise ValueError(
                    f"router.placement.shed: unknown priority class {name!r}; known: {known}"
                )
        for state, shares in self.node_defaults.token_budget.items():
            for name, share in shares.items():
                where = f"node_defaults.token_budget.{state}.{name}"
                if name not in self.priorities:
                    raise ValueError(f"{where}: unknown priority class {name!r}; known: {known}")
                if not 0 <= share <= 1:
                    raise ValueError(f"{where} is {share}; allowed: a fraction in [0, 1]")
        problems = self.node_defaults.starvation.problems(
            "node_defaults.starvation", self.priorities
        )
        for kind, items in (("nodes", self.nodes), ("pools", self.pools)):
            for i, item in enumerate(items):
                if item.starvation is not None:
                    where = f"{kind}.{i}.starvation"
                    problems += item.starvation.problems(where, self.priorities)
        seen: dict[str, str] = {}  # name -> where it was first given
        for kind, items in (("nodes", self.nodes), ("pools", self.pools)):
            for i, item in enumerate(items):
                where = f"{kind}.{i}"
                first = seen.setdefault(item.name, where)
                if first != where:
                    what = "node" if first.startswith("nodes") else "pool"
                    problems.append(
                        f"{where}.name: {item.name!r} is already the name of the {what} at {first}"
                        if not first.startswith(kind)
                        else f"{where}.name: duplicate {what} name {item.name!r} (as {first})"
                    )
                for m in item.models or []:
                    if m not in self.models:
                        known = ", ".join(sorted(self.models))
                        problems.append(f"{where}.models: unknown model {m!r}; known: {known}")
        if problems:
            raise ValueError("\n".join(problems))  # each names its path: see _format_errors
        return self

    def require_models(self) -> None:
        """Raise ModelNotFound naming every missing model file (see
        :func:`missing_model_problem`)."""
        missing = [
            missing_model_problem(n, m.path) for n, m in self.models.items() if not m.path.is_file()
        ]
        if missing:
            raise ModelNotFound("model files missing: " + "; ".join(missing))

    def node_specs(self) -> list[NodeSpec]:
        """One spec per node of ``nodes:``; with neither ``nodes:`` nor ``pools:``,
        ``local.nodes`` identical nodes. Pool members come and go: see
        :meth:`member_spec`."""
        nodes = self.nodes
        if not nodes and not self.pools:
            nodes = [NodeConfig(name=f"edge-{i}") for i in range(self.local.nodes)]
        return [self._spec(n.name, n, resources=n.resources, labels=n.labels) for n in nodes]

    def pool(self, name: str) -> PoolConfig:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)

    def member_spec(self, pool: str, device: str, ray_node: str) -> NodeSpec:
        """The spec of ``pool``'s node on ``device``, pinned to the Ray node ``ray_node``:
        named ``POOL/DEVICE``."""
        p = self.pool(pool)
        return self._spec(f"{pool}/{device}", p, pool=pool, ray_node=ray_node)

    def served_models(self) -> set[str]:
        """The models some node serves, or some pool member will when one joins."""
        served = {m for spec in self.node_specs() for m in spec.models}
        for p in self.pools:
            served.update(p.models or self.models)
        return served

    def _model_on(self, name: str, n: _NodeSettings) -> ModelConfig:
        model = self.models[name]
        if n.providers is None:
            return model
        return model.model_copy(update={"providers": list(n.providers)})

    def _spec(self, name: str, n: _NodeSettings, **where: Any) -> NodeSpec:
        d = self.node_defaults
        models = n.models or list(self.models)
        return NodeSpec(
            name=name,
            fleet=self.fleet.name,
            models={m: self._model_on(m, n) for m in models},
            priorities=dict(self.priorities),
            queue=n.queue or d.queue,
            preemption=n.preemption or d.preemption,
            memory_budget_mb=n.memory_budget_mb or d.memory_budget_mb,
            kv_budget_mb=n.kv_budget_mb or d.kv_budget_mb,
            token_budget=d.token_budget,
            lifecycle=d.lifecycle,
            order=n.order or d.order,
            starvation=n.starvation or d.starvation,
            num_cpus=d.num_cpus if n.num_cpus is None else n.num_cpus,
            trace_dir=d.trace_dir,
            call_timeout_factor=d.call_timeout_factor,
            call_timeout_floor_s=d.call_timeout_floor_s,
            stuck_after_s=d.stuck_after_s,
            artifacts={m: self._artifacts[m] for m in models if m in self._artifacts},
            store=self._store,
            model_cache=n.model_cache or d.model_cache,
            model_cache_mb=d.model_cache_mb,
            **where,
        )


def missing_model_problem(name: str, path: Path) -> str:
    """What to say of a model whose file is missing. Only a built-in model (see
    :func:`edgefleet.modelgen.builtin_model`) is pointed at the commands that write it;
    a user's own model has to be put at its path."""
    from edgefleet.modelgen import builtin_model  # imports onnx: only for a missing file

    if builtin_model(path) is None:
        return f"model {name!r}: {path} does not exist"
    return (
        f"model {name!r}: {path} does not exist yet (a built-in model: `edgefleet up` and "
        "`edgefleet demo` write it, as does `edgefleet models make DIR`)"
    )


def parse_config(
    data: Mapping[str, Any], base_dir: Path, *, lines: Mapping[str, int] | None = None
) -> FleetConfig:
    """Validate a parsed YAML mapping; resolve and confine model paths under ``base_dir``."""
    try:
        cfg = FleetConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, lines or {})) from None
    model_dir = (base_dir / (cfg.model_dir or ".")).resolve()
    models: dict[str, ModelConfig] = {}
    problems: list[str] = []
    for name, m in cfg.models.items():
        resolved: dict[str, Path] = {}
        for variant, file in m.files().items():
            key = f"models.{name}.variants.{variant}" if variant else f"models.{name}.path"
            path = (model_dir / file).resolve() if not file.is_absolute() else file.resolve()
            if not path.is_relative_to(model_dir):
                where = _where(lines or {}, key)
                problems.append(f"{key}{where}: {file} is outside the model directory {model_dir}")
            resolved[variant] = path
        path = resolved.pop("")
        models[name] = m.model_copy(update={"path": path, "variants": resolved})
    if problems:
        raise ConfigError("invalid fleet config:\n  " + "\n  ".join(problems))
    update: dict[str, Any] = {"models": models, "model_dir": model_dir}
    trace_dir = cfg.node_defaults.trace_dir
    if trace_dir is not None:
        traced = {"trace_dir": (base_dir / trace_dir).resolve()}
        update["node_defaults"] = cfg.node_defaults.model_copy(update=traced)
    record_dir = cfg.router.record_dir
    if record_dir is not None:
        recorded = {"record_dir": (base_dir / record_dir).resolve()}
        update["router"] = cfg.router.model_copy(update=recorded)
    return cfg.model_copy(update=update)


def load_config(path: str | Path) -> FleetConfig:
    """Read, validate and resolve a fleet YAML file."""
    path = Path(path)
    data, lines = read_yaml(path, "config", "with at least 'models:'")
    return parse_config(data, path.parent, lines=lines)


def read_yaml(path: Path, what: str, expected: str) -> tuple[dict[str, Any], dict[str, int]]:
    """A YAML mapping and the line of each dotted path in it; ConfigError naming the
    file (``what`` it is) when it cannot be read, is not YAML or not a mapping
    (``expected`` says what it should hold)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
        lines = _line_index(yaml.compose(text))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping {expected}")
    return data, lines


def _line_index(node: yaml.Node | None, prefix: str = "") -> dict[str, int]:
    """Map dotted YAML paths (``models.clf.batching``) to 1-based line numbers."""
    index: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            path = f"{prefix}.{key.value}" if prefix else str(key.value)
            index[path] = key.start_mark.line + 1
            index.update(_line_index(value, path))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            path = f"{prefix}.{i}" if prefix else str(i)
            index[path] = item.start_mark.line + 1
            index.update(_line_index(item, path))
    return index


def _where(lines: Mapping[str, int], path: str) -> str:
    while path:
        if path in lines:
            return f" (line {lines[path]})"
        path = path.rpartition(".")[0]
    return ""


def _format_errors(exc: ValidationError, lines: Mapping[str, int]) -> str:
    out = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif err["type"] == "literal_error":
            msg = f"{msg}"
        elif err["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
        if path or err["type"] != "value_error":
            out.append(f"{path or '(top)'}{_where(lines, path)}: {msg}")
            continue
        # A check across the file: one problem a line, each starting with its YAML path.
        for problem in msg.splitlines():
            named = re.match(r"[\w.-]+(?=:| is )", problem)
            if named is None or not _where(lines, named.group()):
                out.append(f"(top): {problem}")
            else:
                where = named.group()
                out.append(f"{where}{_where(lines, where)}{problem[len(where) :]}")
    return "invalid fleet config:\n  " + "\n  ".join(out)
