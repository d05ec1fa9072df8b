"""Execution providers: the YAML, which file and providers a device opens a model with,
strict models, and what a node says its sessions run on (on this machine's real ONNX
Runtime build, which has the CPU provider and no GPU)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import onnxruntime as ort
import pytest
import yaml

from actors.engine import device_providers
from actors.node import NodeRuntime
from edgefleet.config import (
    FleetConfig,
    NodeSpec,
    PreemptionConfig,
    QueueConfig,
    load_config,
    parse_config,
)
from edgefleet.errors import ConfigError, EngineError
from edgefleet.providers import (
    CPU,
    ProviderConfig,
    ProviderUnavailable,
    UnknownProvider,
    plan_session,
    provider_name,
)

CPU_ONLY = ["CPUExecutionProvider"]
OPENVINO_BUILD = ["OpenVINOExecutionProvider", "CPUExecutionProvider"]


def providers(*names: str) -> list[ProviderConfig]:
    return [ProviderConfig.model_validate(n) for n in names]


# ------------------------------------------------------------------------ names


@pytest.mark.parametrize(
    ("given", "short"),
    [
        ("openvino", "openvino"),
        ("OpenVINO", "openvino"),
        ("OpenVINOExecutionProvider", "openvino"),
        ("dml", "directml"),
        ("TensorrtExecutionProvider", "tensorrt"),
        ("cpu", "cpu"),
    ],
)
def test_a_provider_is_named_by_its_short_name_or_onnx_runtimes(given, short):
    assert provider_name(given) == short


def test_an_unknown_provider_name_lists_the_known_ones():
    with pytest.raises(UnknownProvider, match=r"unknown execution provider 'npu'.*openvino"):
        provider_name("npu")


def test_options_go_to_onnx_runtime_as_text():
    p = ProviderConfig.model_validate(
        {"name": "OpenVINOExecutionProvider", "options": {"device_type": "CPU", "cache": True}}
    )
    assert (p.name, p.ort_name) == ("openvino", "OpenVINOExecutionProvider")
    assert p.ort_options() == {"device_type": "CPU", "cache": "true"}


# ------------------------------------------------------------------------ plans


def test_the_first_provider_the_build_has_is_asked_for_first():
    plan = plan_session("m", Path("m.onnx"), providers("cuda", "openvino", "cpu"), OPENVINO_BUILD)
    assert [p.name for p in plan.providers] == ["openvino", "cpu"]
    assert "cuda not in this ONNX Runtime build (it has: openvino, cpu)" in plan.fallback


def test_a_device_with_the_first_provider_has_no_fallback():
    plan = plan_session("m", Path("m.onnx"), providers("openvino", "cpu"), OPENVINO_BUILD)
    assert [p.name for p in plan.providers] == ["openvino", "cpu"]
    assert plan.fallback == ""


def test_a_device_with_none_of_the_providers_runs_on_the_cpu_and_says_why():
    plan = plan_session("m", Path("m.onnx"), providers("cuda", "tensorrt"), CPU_ONLY)
    assert plan.providers == (CPU,)
    assert "cuda, tensorrt not in this ONNX Runtime build" in plan.fallback


def test_a_strict_model_refuses_a_device_without_its_first_provider():
    with pytest.raises(ProviderUnavailable) as caught:
        plan_session("det", Path("d.onnx"), providers("openvino", "cpu"), CPU_ONLY, strict=True)
    assert (caught.value.model, caught.value.provider) == ("det", "openvino")
    assert "it has: cpu" in str(caught.value)


@pytest.mark.parametrize(
    ("build", "file", "first"),
    [
        (OPENVINO_BUILD, "det-int8.onnx", "openvino"),
        (CPU_ONLY, "det.onnx", "cpu"),
        (["CUDAExecutionProvider", "CPUExecutionProvider"], "det-fp16.onnx", "cuda"),
    ],
)
def test_variants_pick_the_file_of_the_first_provider_the_device_runs(build, file, first):
    variants = {"openvino": Path("det-int8.onnx"), "cuda": Path("det-fp16.onnx")}
    wanted = providers("cuda", "openvino", "cpu")
    plan = plan_session("det", Path("det.onnx"), wanted, build, variants=variants)
    assert (plan.path, plan.providers[0].name) == (Path(file), first)


# ------------------------------------------------------------------------ YAML


def _fleet(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(body)
    return path


def test_an_unknown_provider_in_yaml_is_a_config_error_with_its_line(tmp_path):
    path = _fleet(
        tmp_path,
        "models:\n  det:\n    path: det.onnx\n    providers:\n      - openvino\n      - npu\n",
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    text = str(caught.value)
    assert "models.det.providers.1" in text and "(line 6)" in text, text
    assert "unknown execution provider 'npu'" in text


def test_providers_variants_and_per_node_overrides_from_yaml(tmp_path):
    data = yaml.safe_load(
        """
        models:
          det:
            variants: {OpenVINO: det-int8.onnx, cpu: det.onnx}
            providers: [{name: openvino, options: {device_type: CPU}}, cpu]
            strict: true
          cls: {path: cls.onnx}
        nodes:
          - {name: plain}
          - {name: jetson, providers: [tensorrt, cuda, cpu]}
        """
    )
    config = parse_config(data, tmp_path)
    det = config.models["det"]
    assert det.path == (tmp_path / "det.onnx").resolve()  # the cpu variant
    assert det.variants == {
        "openvino": (tmp_path / "det-int8.onnx").resolve(),
        "cpu": (tmp_path / "det.onnx").resolve(),
    }
    assert [p.describe() for p in det.providers] == ["openvino(device_type=CPU)", "cpu"]
    assert config.models["cls"].providers == [CPU]
    plain, jetson = config.node_specs()
    assert [p.name for p in plain.models["det"].providers] == ["openvino", "cpu"]
    for model in jetson.models.values():
        assert [p.name for p in model.providers] == ["tensorrt", "cuda", "cpu"]
    assert jetson.models["det"].strict  # the node replaces the list, not the rest


def test_a_variant_outside_the_model_directory_is_refused(tmp_path):
    data = {"models": {"det": {"path": "det.onnx", "variants": {"cuda": "../det.onnx"}}}}
    with pytest.raises(ConfigError, match=r"models\.det\.variants\.cuda: .* outside"):
        parse_config(data, tmp_path)


# ------------------------------------------------------------------------ real nodes


def _spec(models_dir: Path, **model: object) -> NodeSpec:
    config = parse_config(
        {"models": {"classifier": {"path": "classifier.onnx", **model}}}, models_dir
    )
    return _node("edge-7", config)


def _node(name: str, config: FleetConfig) -> NodeSpec:
    return NodeSpec(
        name=name,
        models=dict(config.models),
        priorities=dict(config.priorities),
        queue=QueueConfig(),
        preemption=PreemptionConfig(),
        memory_budget_mb=1024,
    )


def _start(spec: NodeSpec) -> NodeRuntime:
    node = NodeRuntime(spec)

    async def started() -> None:
        await asyncio.wait_for(node.start(), 60)

    asyncio.run(started())
    return node


def test_a_strict_model_without_its_provider_fails_the_node_naming_node_model_provider(
    models_dir,
):
    spec = _spec(models_dir, providers=["cuda", "cpu"], strict=True, warmup=False)
    with pytest.raises(ProviderUnavailable) as caught:
        _start(spec)
    err = caught.value
    assert (err.node, err.model, err.provider) == ("edge-7", "classifier", "cuda")
    assert str(err).startswith("node edge-7: model 'classifier' is strict and needs provider cuda")
    assert isinstance(err, EngineError)


def test_a_model_without_its_provider_falls_back_to_the_cpu_and_status_says_why(models_dir):
    node = _start(_spec(models_dir, providers=["cuda", "cpu"], warmup=False))
    (model,) = node.status().models
    assert model.providers.asked == ("cpu",)  # what the device could be asked for
    assert model.providers.used == ("cpu",)  # what ONNX Runtime took
    assert "cuda not in this ONNX Runtime build" in model.providers.fallback
    assert model.providers.file == str(models_dir / "classifier.onnx")


def test_a_node_says_what_its_device_has(models_dir):
    node = _start(_spec(models_dir, warmup=False))
    device = node.status().device
    assert device == device_providers()
    assert device.version == ort.__version__
    assert "cpu" in device.providers and "onnxruntime" in device.build.split("+")
    (model,) = node.status().models
    assert (model.providers.used, model.providers.fallback) == (("cpu",), "")


def test_a_node_loads_the_variant_of_the_provider_it_runs_on(models_dir, tmp_path):
    shutil.copy(models_dir / "detector.onnx", tmp_path / "detector.onnx")
    shutil.copy(models_dir / "classifier.onnx", tmp_path / "classifier-cpu.onnx")
    config = parse_config(
        {
            "models": {
                "m": {
                    "path": "detector.onnx",
                    "variants": {"cuda": "missing.onnx", "cpu": "classifier-cpu.onnx"},
                    "providers": ["cuda", "cpu"],
                    "warmup": False,
                }
            }
        },
        tmp_path,
    )
    (model,) = _start(_node("edge-8", config)).status().models
    assert model.providers.file == str(tmp_path / "classifier-cpu.onnx")


# ------------------------------------------------------------------------ commands


def _strict_fleet(tmp_path: Path, models_dir: Path, strict: bool) -> Path:
    shutil.copy(models_dir / "classifier.onnx", tmp_path / "classifier.onnx")
    model = {"path": "classifier.onnx", "providers": ["cuda", "cpu"], "strict": strict}
    body = {"models": {"classifier": model}, "nodes": [{"name": "jetson-1"}]}
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def test_models_show_says_what_a_model_asks_for_and_what_this_machine_runs(
    tmp_path, models_dir, capsys
):
    from cluster.cli import main

    assert main(["models", "show", str(_strict_fleet(tmp_path, models_dir, False))]) == 0
    out = capsys.readouterr().out
    assert "providers  cuda, cpu\n" in out
    assert "this machine runs it on cpu, from classifier.onnx (fell back: cuda not in" in out


def test_validate_and_up_name_a_node_whose_machine_lacks_a_strict_models_provider(
    tmp_path, models_dir, capsys
):
    from cluster.cli import main

    path = str(_strict_fleet(tmp_path, models_dir, True))
    assert main(["validate", path]) == 0  # the devices of a real cluster may have it
    out = capsys.readouterr().out
    assert "note: on this machine (where `up` without --address runs nodes): node jetson-1: " in out
    assert "model 'classifier' is strict and needs provider cuda" in out
    assert main(["up", path]) == 2  # an embedded cluster runs its nodes here: refused...
    said = capsys.readouterr()
    assert "node jetson-1: model 'classifier' is strict and needs provider cuda" in said.err
    assert "starting an embedded Ray cluster" not in said.out  # ...before starting anything


def test_a_decoder_opens_on_its_providers_too(models_dir):
    from actors.decoder import DecoderEngine
    from actors.models import load_onnx

    config = parse_config(
        {"models": {"lm": {"path": "tiny_lm.onnx", "kind": "decoder", "providers": ["cuda"]}}},
        models_dir,
    )
    engine = load_onnx("lm", config.models["lm"])
    try:
        assert isinstance(engine, DecoderEngine)
        assert engine.providers.used == ("cpu",)
        assert "cuda not in this ONNX Runtime build" in engine.providers.fallback
    finally:
        engine.close()
