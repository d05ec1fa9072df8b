"""Model and input files as the command line meets them: whether a fleet's models
load the way a node loads them, what a model takes and returns, and the arrays of
an ``.npz`` or ``.npy`` input file.

Models are checked by loading them as a node does (ONNX Runtime on the CPU, through
:func:`actors.models.load_onnx`): that rejects exactly what a node would reject (a
file that is not ONNX, an operator or opset the installed ONNX Runtime lacks, missing
external data, a ``kind: decoder`` model without a KV cache), which ``onnx.checker``
alone does not. It costs one session per model, released at once.
"""

from __future__ import annotations

import keyword
import zipfile
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgefleet.artifacts import split_version
from edgefleet.config import FleetConfig, ModelConfig, missing_model_problem
from edgefleet.errors import ConfigError, EdgeFleetError, InvalidInput, ModelNotFound
from edgefleet.providers import CPU, ProviderUnavailable, plan_session

if TYPE_CHECKING:
    from actors.engine import Signature

NPZ_HOWTO = (
    "save the model's inputs by name with numpy, e.g. "
    "np.savez('in.npz', images=np.zeros((1, 3, 32, 32), 'float32')); "
    "`edgefleet models show` lists a model's inputs"
)
_NPY_MAGIC = b"\x93NUMPY"
_ZIP_MAGIC = b"PK"  # an .npz is a zip archive of .npy files


def model_signature(name: str, model: ModelConfig) -> Signature:
    """Load ``model`` as a node would (each of its files, on the CPU provider: any
    device can run that) and return its inputs and outputs.

    Raises ConfigError naming the model, its file and why a node could not load it:
    the file is missing, is not an ONNX model, or ONNX Runtime refuses it.
    """
    signature = _file_signature(name, model, model.path)
    for path in sorted(set(model.variants.values()) - {model.path}):  # `path` may be one
        _file_signature(name, model, path)
    return signature


def _file_signature(name: str, model: ModelConfig, path: Path) -> Signature:
    from actors.models import load_onnx  # ONNX Runtime: only where models are read

    if not path.is_file():
        raise ConfigError(missing_model_problem(name, path))
    on_cpu = model.model_copy(update={"path": path, "providers": [CPU], "variants": {}})
    try:
        engine = load_onnx(name, on_cpu)
    except EdgeFleetError as exc:
        reason = _not_onnx(path)
        if reason is not None:
            raise ConfigError(f"model {name!r}: {path} is not an ONNX model ({reason})") from None
        raise ConfigError(_naming(name, path, str(exc))) from None
    try:
        return engine.signature
    finally:
        engine.close()


def provider_problems(config: FleetConfig, available: Collection[str]) -> list[str]:
    """Which nodes of ``config`` (``nodes:``, or the embedded default's) could not load
    a strict model on a device whose ONNX Runtime build has ``available`` providers."""
    problems = []
    for spec in config.node_specs():
        for name, model in spec.models.items():
            try:
                plan_session(name, model.path, model.providers, available, strict=model.strict)
            except ProviderUnavailable as exc:
                problems.append(f"node {spec.name}: {exc}")
    return problems


def provider_lines(model: ModelConfig, available: Collection[str]) -> list[str]:
    """What a model asks for (providers, strict, variants) and what a device with
    ``available`` providers would open it with."""
    asked = ", ".join(p.describe() for p in model.providers)
    lines = [f"  providers  {asked}{' (strict)' if model.strict else ''}"]
    lines += [f"  variant    {p}: {path}" for p, path in model.variants.items()]
    try:
        plan = plan_session(
            "",
            model.path,
            model.providers,
            available,
            strict=model.strict,
            variants=model.variants,
        )
    except ProviderUnavailable as exc:
        return [*lines, f"  this machine would not load it: no {exc.provider}"]
    here = ", ".join(p.name for p in plan.providers)
    fallback = f" (fell back: {plan.fallback})" if plan.fallback else ""
    return [*lines, f"  this machine runs it on {here}, from {plan.path.name}{fallback}"]


def model_problems(config: FleetConfig, names: Iterable[str] | None = None) -> list[str]:
    """Why each of ``names`` (default: every model of ``config``) would not load on a
    node: one line per model that fails, naming it, its file and the reason."""
    problems = []
    for name in config.models if names is None else names:
        try:
            model_signature(name, config.models[name])
        except ConfigError as exc:
            problems.append(str(exc))
    return problems


def require_loadable_models(config: FleetConfig, names: Iterable[str] | None = None) -> None:
    """Raise ConfigError listing every model (of ``names``, default all) that would not
    load on a node; call it before starting anything."""
    problems = model_problems(config, names)
    if problems:
        raise ConfigError(f"{len(problems)} model(s) would not load:\n  " + "\n  ".join(problems))


def _not_onnx(path: Path) -> str | None:
    """Why ``path`` is not an ONNX model at all, or None when it parses as one."""
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError, or an unreadable file
        return str(exc) or type(exc).__name__
    return None if model.HasField("graph") else "it has no graph"


def _naming(name: str, path: Path, message: str) -> str:
    """``message`` naming the model and its file (most engine messages name one)."""
    message = message.strip()
    if f"model {name!r}" not in message:
        message = f"model {name!r}: {message}"
    return message if str(path) in message else f"{message} ({path})"


def signature_lines(name: str, model: ModelConfig, sig: Signature) -> list[str]:
    """A model's inputs and outputs for a reader, and how to build its inputs."""
    width = max((len(s.name) for s in sig.inputs + sig.outputs), default=0)
    lines = [f"{name}  {model.path}"]
    from actors.engine import available_providers

    lines += provider_lines(model, available_providers())
    lines += [f"  input   {s.name:<{width}}  {s.describe()}" for s in sig.inputs]
    lines += [f"  output  {s.name:<{width}}  {s.describe()}" for s in sig.outputs]
    if model.kind == "decoder":
        lines.append(f"  a decoder: `edgefleet generate {name} --prompt-ids ...` feeds it")
        from actors.decoder import GENAI_CONFIG, dynamically_quantized, genai_facts

        facts = genai_facts(model.path)
        if facts:
            read = ", ".join(f"{k} {v}" for k, v in facts.items())
            lines.append(f"  read from {GENAI_CONFIG}: {read}")

        if dynamically_quantized(model.path):
            lines.append(
                "  dynamically quantized: its outputs depend on how tokens are grouped into "
                "calls, so a node replays each generation's calls when it rebuilds a cache, "
                "reuses no session or prefix KV for it and never decodes it in a batch"
            )
    else:
        lines.append(f"  an .npz of inputs: {npz_example(name, sig)}")
    return lines


def npz_example(name: str, sig: Signature) -> str:
    """A numpy call writing an ``.npz`` the model takes: zeros, dynamic dimensions 1."""
    values = {
        s.name: f"np.zeros({tuple(d if isinstance(d, int) else 1 for d in s.shape)!r}, "
        f"{s.dtype.name!r})"
        for s in sig.inputs
    }
    if all(n.isidentifier() and not keyword.iskeyword(n) for n in values):
        arrays = ", ".join(f"{n}={v}" for n, v in values.items())
    else:
        arrays = "**{" + ", ".join(f"{n!r}: {v}" for n, v in values.items()) + "}"
    return f"np.savez({name + '.npz'!r}, {arrays})"


def read_input_file(path: str | Path) -> dict[str, np.ndarray] | np.ndarray:
    """The named arrays of an ``.npz``, or the one array of an ``.npy``. Nothing is
    unpickled; anything else is InvalidInput saying how to build the file."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            head = fh.read(len(_NPY_MAGIC))
    except OSError as exc:
        raise InvalidInput(f"cannot read {path}: {exc.strerror}") from None
    if not head.startswith((_NPY_MAGIC, _ZIP_MAGIC)):
        raise InvalidInput(f"{path} is not a NumPy .npz/.npy file; {NPZ_HOWTO}")
    try:
        loaded = np.load(path, allow_pickle=False)
        if isinstance(loaded, np.ndarray):
            return loaded
        with loaded:
            arrays = {k: loaded[k] for k in loaded.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # an object array too
        why = "it holds pickled Python objects" if "allow_pickle" in str(exc) else str(exc)
        raise InvalidInput(
            f"{path} is not a NumPy .npz/.npy file of arrays ({why}); {NPZ_HOWTO}"
        ) from None
    others = [k for k, v in arrays.items() if not isinstance(v, np.ndarray)]
    if others:
        raise InvalidInput(
            f"{path} is not a NumPy .npz file (it holds files that are not arrays: "
            f"{', '.join(others)}); {NPZ_HOWTO}"
        )
    return arrays


def name_single_input(config: FleetConfig, name: str, array: np.ndarray) -> dict[str, np.ndarray]:
    """``{input: array}`` for a model of ``config`` that takes exactly one input; the
    input's name is read from the model file, which must be on this machine.
    ``name`` may pin a version (``name@version``)."""
    name, _ = split_version(name)
    model = config.models.get(name)
    if model is None:
        known = ", ".join(sorted(config.models))
        raise ModelNotFound(f"the fleet has no model {name!r}; it has: {known}")
    if not model.path.is_file():
        raise InvalidInput(
            f"an .npy holds one unnamed array, and the file of model {name!r} ({model.path}) "
            f"is not on this machine to name it: use an .npz instead; {NPZ_HOWTO}"
        )
    sig = model_signature(name, model)
    if len(sig.inputs) != 1:
        raise InvalidInput(
            f"model {name!r} takes {len(sig.inputs)} inputs, {sig.describe()}; an .npy holds "
            f"one array: use an .npz of named arrays; {NPZ_HOWTO}"
        )
    return {sig.inputs[0].name: array}
