"""Fleet YAML: defaults, path confinement, and errors that name the YAML path and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgefleet.config import load_config
from edgefleet.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    return path


def test_shipped_local_config_is_valid():
    config = load_config(REPO / "configs" / "local.yaml")
    specs = config.node_specs()
    assert [s.name for s in specs] == ["edge-0", "edge-1"]
    assert specs[0].models["detector"].batching.max_batch_size == 4
    assert config.models["heavy"].path == REPO / "configs" / "models" / "heavy.onnx"


def test_defaults_and_explicit_nodes(tmp_path):
    config = load_config(
        write(
            tmp_path,
            """
models:
  a: {path: a.onnx}
  b: {path: b.onnx, dedup: follow}
node_defaults: {queue: {capacity: 8}}
nodes:
  - {name: n0, models: [a]}
  - {name: n1, queue: {capacity: 2}, order: fifo}
""",
        )
    )
    n0, n1 = config.node_specs()
    assert list(n0.models) == ["a"] and list(n1.models) == ["a", "b"]
    assert n0.queue.capacity == 8 and n1.queue.capacity == 2
    assert n0.order == "priority" and n1.order == "fifo"
    assert n0.preemption.min_priority_gap == 5
    assert config.priorities["foreground"] == 10


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("models:\n  a: {path: a.onnx, colour: red}\n", "models.a.colour (line 2): unknown key"),
        (
            "models:\n  a:\n    path: a.onnx\n    batching: {window_ms: -1}\n",
            "models.a.batching.window_ms (line 4)",
        ),
        ("models:\n  a: {path: a.onnx, kind: llm}\n", "models.a.kind (line 2): Input should be"),
        (
            "models:\n  a: {path: ../../etc/a.onnx}\n",
            "models.a.path (line 2): ../../etc/a.onnx is outside",
        ),
        ("models: {}\n", "at least one model"),
        ("priorities: {urgent: 11}\nmodels: {a: {path: a.onnx}}\n", "priorities (line 1)"),
        ("models: {a: {path: a.onnx}}\nnodes: [{name: n, models: [b]}]\n", "unknown model 'b'"),
        ("models: {a: {path: a.onnx}}\nnodes: [{name: n}, {name: n}]\n", "duplicate node name"),
        ("models: {a: {path: a.onnx}}\nnode_defaults: {order: lifo}\n", "node_defaults.order"),
        ("- just\n- a list\n", "top level must be a mapping"),
        ("models: {a: {path: a.onnx}\n", "not valid YAML"),
    ],
)
def test_bad_configs_name_the_problem(tmp_path, text, expected):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert expected in str(info.value)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")
