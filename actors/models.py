"""ModelManager: load, warm up, measure, switch and unload models within a memory budget."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from statistics import median

import numpy as np

from actors.decoder import DecoderEngine
from actors.engine import Engine, OnnxEngine, Signature, available_providers
from actors.scheduler import configured_batch_limit
from edgefleet.artifacts import ModelArtifact
from edgefleet.config import MiB, ModelConfig
from edgefleet.errors import EdgeFleetError, EngineError, ModelNotFound, VersionFailed
from edgefleet.providers import ProviderUnavailable, ProviderUse, plan_session

Loader = Callable[[str, ModelConfig], Engine]
# Where a model's files are on this device: its config, or one reading them elsewhere
# (from the node's model cache: actors/cache.py), and the artifact it loads if any.
Resolver = Callable[[str, ModelConfig], tuple[ModelConfig, ModelArtifact | None]]
Progress = Callable[[str], None]

SYNTHETIC_DIM = 16  # size given to dynamic non-batch axes when measuring


def load_onnx(name: str, config: ModelConfig) -> Engine:
    """``config``'s model as this device runs it: on the first of its providers that the
    device's ONNX Runtime build has (ProviderUnavailable for a strict model whose first
    provider it lacks), from that provider's variant of the file."""
    plan = plan_session(
        name,
        config.path,
        config.providers,
        available_providers(),
        strict=config.strict,
        variants=config.variants,
    )
    if config.kind == "decoder":
        return DecoderEngine(
            name,
            plan.path,
            threads=config.threads,
            max_context=config.generation.max_context,
            stop_ids=config.generation.stop_ids,
            prefill_chunk=config.generation.prefill_chunk,
            plan=plan,
        )
    return OnnxEngine(
        name, plan.path, threads=config.threads, pad_to=config.batching.pad_to, plan=plan
    )


@dataclass
class ModelInfo:
    """What the node knows of a model whether or not it is resident."""

    name: str
    config: ModelConfig
    signature: Signature
    memory_mb: float
    costs_s: dict[int, float] = field(default_factory=dict)  # engine seconds per call, by rows
    batch_limit: int = 1
    loads: int = 0
    load_s: float = 0.0
    vocab: int | None = None  # decoders: vocabulary size and context length
    max_context: int | None = None
    stop_ids: tuple[int, ...] = ()  # the config's, else the model's eos_token_id
    exact_grouping: bool = False  # outputs depend on how tokens are grouped into calls
    providers: ProviderUse = ProviderUse()  # what its session runs on, as last loaded
    artifact: ModelArtifact | None = None  # the files it was loaded from, as published

    def max_call_s(self, rows: int, factor: float, floor_s: float) -> float:
        """How long one engine call of ``rows`` rows (a decoder: generations) may run:
        the configured ``max_call_s``, else ``factor`` times the measured cost of the
        largest batch measured (scaled up by rows past it), and at least ``floor_s``."""
        if self.config.max_call_s is not None:
            return self.config.max_call_s
        if not self.costs_s:
            return floor_s
        size, cost = max(self.costs_s.items())
        return max(floor_s, factor * cost * max(1.0, rows / size))


class ModelManager:
    """Keeps the node's resident models within ``budget_mb``, least recently used out first.

    Every method that loads runs on the engine thread: loading is blocking I/O and
    must never run while another engine call is in progress.
    """

    def __init__(
        self,
        models: Mapping[str, ModelConfig],
        budget_mb: float,
        loader: Loader = load_onnx,
        *,
        node: str = "",
        resolve: Resolver | None = None,
    ) -> None:
        self._node = node  # named in load errors
        self._resolve = resolve
        self._configs = dict(models)
        self._budget_mb = budget_mb
        self._loader = loader
        self._info: dict[str, ModelInfo] = {}
        self._replaced: dict[str, ModelInfo] = {}  # models whose new version is loading
        self._resident: OrderedDict[str, Engine] = OrderedDict()  # LRU order, newest last

    def probe_all(self, progress: Progress | None = None) -> None:
        """Load every model once: read its signature, warm it up, measure its cost per
        batch size, and keep it resident while the budget allows (in config order)."""
        for name in self._configs:
            self._probe(name)
            if progress:
                progress(f"{name}: loaded in {self._info[name].load_s * 1000:.0f} ms")

    def _probe(self, name: str) -> None:
        # Probing may briefly exceed the budget by one model: residents stay put.
        engine = self._load(name, evict=False)
        info = self._info[name]
        if isinstance(engine, DecoderEngine):  # generations run one at a time
            if info.config.warmup or engine.vocab is None:
                info.costs_s = engine.warmup()
            info.vocab, info.max_context = engine.vocab, engine.max_context
            info.stop_ids = engine.stop_ids
            info.exact_grouping = engine.exact_grouping
        else:
            if info.config.warmup:
                info.costs_s = measure_costs(engine, info.config)
            info.batch_limit = _batch_limit(info)
        if sum(self._info[m].memory_mb for m in self._resident) > self._budget_mb:
            self.unload(name)

    def replace(
        self, name: str, config: ModelConfig, restore: Callable[[], None] | None = None
    ) -> ModelInfo:
        """Serve ``name`` from ``config`` (another version of its files) from now on:
        unload it, then load, warm up and measure the new one. When that fails, or its
        warm-up fails where the old version's ran, the old version comes back (loaded
        again, after ``restore`` put back what the resolver reads) and VersionFailed
        says why; when even the old one does not load again, EngineError."""
        old_config, old_info = self._configs[name], self.info(name)
        self.unload(name)
        self._configs[name] = config
        self._replaced[name] = self._info.pop(name)  # still listed while the new one loads
        try:
            self._probe(name)
            info = self._info[name]
            if old_info.costs_s and config.warmup and not info.costs_s:
                raise EngineError("its warm-up failed on inputs the old version ran")
        except EdgeFleetError as exc:
            self.unload(name)
            self._configs[name], self._info[name] = old_config, old_info
            if restore is not None:
                restore()
            try:
                self.ensure(name)
            except EdgeFleetError as again:
                raise EngineError(
                    f"model {name!r}: the new version failed ({exc}) and the old one did "
                    f"not load again: {again}"
                ) from None
            raise VersionFailed(f"model {name!r}: the new version failed: {exc}") from None
        finally:
            del self._replaced[name]
        return info

    def info(self, name: str) -> ModelInfo:
        try:
            return self._info[name]
        except KeyError:
            known = ", ".join(sorted(self._configs)) or "none"
            raise ModelNotFound(
                f"model {name!r} is not served here; this node has: {known}"
            ) from None

    def models(self) -> list[ModelInfo]:
        """Every model, one being replaced included (as its old version until the new
        one is in)."""
        replaced = [i for n, i in self._replaced.items() if n not in self._info]
        return [*self._info.values(), *replaced]

    def resident(self, name: str) -> Engine | None:
        engine = self._resident.get(name)
        if engine is not None:
            self._resident.move_to_end(name)
        return engine

    def loaded(self) -> list[str]:
        return list(self._resident)

    def ensure(self, name: str) -> Engine:
        """Make ``name`` resident, unloading the least recently used models to fit."""
        engine = self.resident(name)
        return engine if engine is not None else self._load(name)

    def unload(self, name: str) -> None:
        engine = self._resident.pop(name, None)
        if engine is not None:
            engine.close()

    def close(self) -> None:
        for name in list(self._resident):
            self.unload(name)

    def _load(self, name: str, *, evict: bool = True) -> Engine:
        config = self._configs.get(name)
        if config is None:
            self.info(name)  # raises ModelNotFound with the list of known models
            raise AssertionError("unreachable")
        artifact = None
        if self._resolve is not None:
            config, artifact = self._resolve(name, config)
        need = config.memory_mb or _estimate_mb(config, artifact)
        if need > self._budget_mb:
            raise EngineError(
                f"model {name!r} needs about {need:.0f} MB, more than the node's memory "
                f"budget of {self._budget_mb:.0f} MB; raise memory_budget_mb or memory_mb"
            )
        while (
            evict
            and self._resident
            and sum(self._info[m].memory_mb for m in self._resident) + need > self._budget_mb
        ):
            self.unload(next(iter(self._resident)))
        t0 = time.perf_counter()
        try:
            engine = self._loader(name, config)
        except ProviderUnavailable as exc:
            raise ProviderUnavailable(
                f"node {self._node}: {exc}",
                model=exc.model,
                provider=exc.provider,
                node=self._node,
            ) from None
        elapsed = time.perf_counter() - t0
        info = self._info.get(name)
        if info is None:
            info = self._info[name] = ModelInfo(name, config, engine.signature, need)
        # A test's fake engine has no providers: it runs on no real device.
        info.providers = getattr(engine, "providers", ProviderUse())
        info.artifact = artifact
        info.loads += 1
        info.load_s = elapsed
        self._resident[name] = engine
        return engine


def _batch_limit(info: ModelInfo) -> int:
    return configured_batch_limit(info.config, info.signature.batchable, info.costs_s)


def _estimate_mb(config: ModelConfig, artifact: ModelArtifact | None = None) -> float:
    # Weights plus ONNX Runtime's working memory, which is of the same order. The
    # artifact's files include the weights kept as external data.
    if artifact is not None:
        others = set(artifact.variants.values()) - {artifact.path}  # other providers' files
        size = sum(f.size for f in artifact.files if f.name not in others)
        return max(1.0, 2 * size / MiB)
    try:
        return max(1.0, 2 * config.path.stat().st_size / MiB)
    except OSError:
        return 1.0


def synthetic_inputs(sig: Signature, rows: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs that satisfy ``sig``, with ``rows`` on the batch axis when the model batches."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for spec in sig.inputs:
        shape = [d if isinstance(d, int) else SYNTHETIC_DIM for d in spec.shape]
        if sig.batchable:
            shape[0] = rows
        if spec.dtype.kind == "f":
            out[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        else:
            out[spec.name] = np.zeros(shape, dtype=spec.dtype)
    return out


def measure_costs(engine: Engine, config: ModelConfig, repeats: int = 3) -> dict[int, float]:
    """Median engine seconds per call at batch sizes 1, 2, 4, ... up to max_batch_size.

    Also serves as warm-up. A model whose synthetic inputs fail (for example a
    dynamic axis that must match another) gets no table: batching then follows
    the configuration.
    """
    sig = engine.signature
    max_rows = config.batching.max_batch_size if sig.batchable else 1
    sizes = sorted({1, max_rows, *(2**k for k in range(1, 13) if 2**k < max_rows)})
    costs: dict[int, float] = {}
    try:
        for size in sizes:
            feed = synthetic_inputs(sig, size)
            engine.run([feed])  # warm-up for this shape
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                engine.run([feed])
                times.append(time.perf_counter() - t0)
            costs[size] = median(times)
    except EdgeFleetError:
        return {}
    return costs
