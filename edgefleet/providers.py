"""Execution providers: which hardware a model's ONNX Runtime session runs on.

A model (or a pool, or a node, for every model it serves) lists the providers it
wants, best first: ``providers: [{name: openvino, options: {device_type: CPU}}, cpu]``.
Each device has the ONNX Runtime build installed for its hardware (``onnxruntime``,
``onnxruntime-gpu``, ``onnxruntime-openvino``, ...), and a build has only some
providers. :func:`plan_session` decides, from the providers a device's build has,
which file of the model to load (``variants:``: one file per provider) and which
providers to open the session with; a ``strict`` model refuses a device without its
first provider. ONNX Runtime falls back to the CPU without an error (a provider the
build lacks is a warning; graph nodes a provider cannot run go to the CPU), so the
node says what its session really uses: :class:`ProviderUse`.

No ONNX Runtime import here: the configuration and the tools use it too.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from edgefleet.errors import EngineError

# Short name -> ONNX Runtime's name, in the order help texts list them.
PROVIDERS: Mapping[str, str] = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
    "openvino": "OpenVINOExecutionProvider",
    "qnn": "QNNExecutionProvider",
    "coreml": "CoreMLExecutionProvider",
    "directml": "DmlExecutionProvider",
    "rocm": "ROCMExecutionProvider",
    "migraphx": "MIGraphXExecutionProvider",
    "xnnpack": "XnnpackExecutionProvider",
    "nnapi": "NnapiExecutionProvider",
    "webgpu": "WebGpuExecutionProvider",
}
_BY_ORT_NAME = {ort: short for short, ort in PROVIDERS.items()}
_ALIASES = {"dml": "directml", "trt": "tensorrt"}

# The ONNX Runtime builds a device may have installed: each provides the module
# ``onnxruntime``, and two of them installed side by side overwrite each other's files.
BUILDS = (
    "onnxruntime",
    "onnxruntime-gpu",
    "onnxruntime-openvino",
    "onnxruntime-qnn",
    "onnxruntime-directml",
    "onnxruntime-rocm",
    "onnxruntime-migraphx",
    "onnxruntime-training",
)


class UnknownProvider(ValueError):
    """A provider name that is neither a short name nor ONNX Runtime's name of one."""


def provider_name(name: str) -> str:
    """The short name of a provider given by its short name (any case), an alias, or
    ONNX Runtime's name (``OpenVINOExecutionProvider``). UnknownProvider otherwise."""
    if name in _BY_ORT_NAME:
        return _BY_ORT_NAME[name]
    short = _ALIASES.get(name.lower(), name.lower())
    if short in PROVIDERS:
        return short
    known = ", ".join(PROVIDERS)
    raise UnknownProvider(
        f"unknown execution provider {name!r}; known: {known} (or ONNX Runtime's names, "
        "e.g. OpenVINOExecutionProvider)"
    )


def short_names(ort_names: Sequence[str]) -> tuple[str, ...]:
    """ONNX Runtime's provider names as short names (one this module does not know
    keeps ONNX Runtime's name)."""
    return tuple(_BY_ORT_NAME.get(n, n) for n in ort_names)


OptionValue = str | int | float | bool


class ProviderConfig(BaseModel):
    """One execution provider and its options, as ONNX Runtime documents them for it
    (OpenVINO: ``device_type``, ``precision``, ...; TensorRT: ``trt_fp16_enable``, ...).
    In YAML a bare name stands for a provider without options."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        description="short name (" + ", ".join(PROVIDERS) + ") or ONNX Runtime's name"
    )
    options: dict[str, OptionValue] = Field(
        default_factory=dict, description="provider options, passed to ONNX Runtime as text"
    )

    @model_validator(mode="before")
    @classmethod
    def _bare_name(cls, data: Any) -> Any:
        if isinstance(data, str):
            data = {"name": data}
        if isinstance(data, Mapping) and isinstance(data.get("name"), str):
            data = {**data, "name": provider_name(data["name"])}
        return data

    @property
    def ort_name(self) -> str:
        return PROVIDERS[self.name]

    def ort_options(self) -> dict[str, str]:
        return {
            k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in self.options.items()
        }

    def describe(self) -> str:
        if not self.options:
            return self.name
        return f"{self.name}({', '.join(f'{k}={v}' for k, v in self.options.items())})"


CPU = ProviderConfig(name="cpu")


class ProviderUnavailable(EngineError):
    """A ``strict`` model's first provider is not in the device's ONNX Runtime build, or
    its session would run part of the graph on the CPU: the node does not load it."""

    def __init__(self, message: str, *, model: str, provider: str, node: str = "") -> None:
        super().__init__(message)
        self.model = model
        self.provider = provider
        self.node = node


PROVIDERS_LABEL = "edgefleet.io/providers"
"""The Ray node label of a device's providers, short names joined by dots
(``openvino.cpu``): ``edgefleet join`` sets it from the device's ONNX Runtime build."""


def providers_label(short: Sequence[str]) -> str:
    return ".".join(n for n in short if n in PROVIDERS)


def missing_strict_provider(
    models: Mapping[str, Any], labels: Mapping[str, str]
) -> ProviderUnavailable | None:
    """Why a device whose Ray node carries ``labels`` cannot load one of ``models``
    (name -> ModelConfig): a strict model whose first provider its
    :data:`PROVIDERS_LABEL` lacks. None when none does, or when the label is not there
    (the node then finds out when it loads the model)."""
    if PROVIDERS_LABEL not in labels:
        return None
    has = set(labels[PROVIDERS_LABEL].split("."))
    for name, model in models.items():
        first = model.providers[0].name if model.providers else CPU.name
        if model.strict and first not in has:
            return ProviderUnavailable(
                f"model {name!r} is strict and needs provider {first}, which this device's "
                f"ONNX Runtime build lacks (its {PROVIDERS_LABEL} label: "
                f"{labels[PROVIDERS_LABEL] or 'none'})",
                model=name,
                provider=first,
            )
    return None


@dataclass(frozen=True)
class SessionPlan:
    """How a device opens a model's session: the file, and the providers it asks
    ONNX Runtime for (those its build has, best first)."""

    path: Path
    providers: tuple[ProviderConfig, ...]
    strict: bool = False
    # Why the model's first provider is not among them ("" when it is).
    fallback: str = ""


def plan_session(
    model: str,
    path: Path,
    providers: Sequence[ProviderConfig],
    available: Collection[str],
    *,
    strict: bool = False,
    variants: Mapping[str, Path] | None = None,
) -> SessionPlan:
    """The session a device whose ONNX Runtime build has ``available`` providers (ONNX
    Runtime's names) opens for ``model``: the first of ``providers`` it has picks the
    file (its variant, else ``path``); it and the later ones the device has are asked
    for. ProviderUnavailable when ``strict`` and the first provider is missing."""
    wanted = list(providers) or [CPU]
    have = [p for p in wanted if p.ort_name in available]
    first = wanted[0]
    if strict and (not have or have[0] != first):
        raise ProviderUnavailable(
            f"model {model!r} is strict and needs provider {first.name}, which this "
            f"device's ONNX Runtime build lacks (it has: {_listed(available)})",
            model=model,
            provider=first.name,
        )
    fallback = ""
    if not have or have[0] != first:
        missing = [p.name for p in wanted if p.ort_name not in available]
        fallback = (
            f"{', '.join(missing)} not in this ONNX Runtime build (it has: {_listed(available)})"
        )
    if not have:
        have = [CPU]
    file = (variants or {}).get(have[0].name, path)
    return SessionPlan(file, tuple(have), strict, fallback)


def _listed(available: Collection[str]) -> str:
    return ", ".join(short_names(list(available))) or "none"


@dataclass(frozen=True)
class ProviderUse:
    """What a model's session runs on: the providers asked for and those ONNX Runtime
    took (``session.get_providers()``), the file loaded, and why the session does not
    run wholly on the first provider asked for ("" when it does)."""

    asked: tuple[str, ...] = ("cpu",)
    used: tuple[str, ...] = ("cpu",)
    file: str = ""
    fallback: str = ""

    @property
    def runs_on(self) -> str:
        return self.used[0] if self.used else "cpu"

    def describe(self) -> str:
        text = ", ".join(self.used)
        return f"{text}; fell back: {self.fallback}" if self.fallback else text


@dataclass(frozen=True)
class DeviceProviders:
    """A device's ONNX Runtime: its build (the installed package), version and
    providers (short names)."""

    build: str = ""
    version: str = ""
    providers: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"{self.build or 'onnxruntime'} {self.version}: {', '.join(self.providers)}"
