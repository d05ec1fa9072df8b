"""Fleet YAML: defaults, path confinement, and errors that name the YAML path and line."""

from __future__ import annotations

from pathlib import Path
from typing import get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel

from edgefleet.config import BatchingConfig, FleetConfig, load_config, parse_config
from edgefleet.errors import ConfigError
from policies import ClassBound, StarvationParams

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


def test_shipped_fleet_and_production_configs_are_valid():
    fleet = load_config(REPO / "configs" / "fleet.yaml")
    specs = {s.name: s for s in fleet.node_specs()}
    assert sorted(specs) == ["assistant", "camera-0", "camera-1"]
    assert specs["camera-1"].queue.capacity == 16 and specs["camera-0"].queue.capacity == 32
    assert fleet.models["tiny_lm"].kind == "decoder" and specs["assistant"].kv_budget_mb == 128
    prod = load_config(REPO / "configs" / "production.yaml")
    assert prod.ray.auth == "token" and prod.ray.dashboard_port == 8265
    assert all(s.resources == {s.name: 1} and s.num_cpus == 1 for s in prod.node_specs())
    assert prod.router.resources == {"head": 0.01}
    assert prod.node_defaults.token_budget["background"]["offline"] == 0.1


def _keys_cover(model: type[BaseModel], data: object, path: str) -> list[str]:
    """Fields of ``model`` (recursively) that the YAML ``data`` does not mention."""
    missing: list[str] = []
    if not isinstance(data, dict):
        return missing
    for name, field in model.model_fields.items():
        where = f"{path}.{name}" if path else name
        if name not in data:
            missing.append(where)
            continue
        value, kind = data[name], field.annotation
        args = [a for a in get_args(kind) if isinstance(a, type)]
        nested = [a for a in (kind, *args) if isinstance(a, type) and issubclass(a, BaseModel)]
        if not nested:
            continue
        items = value if isinstance(value, list) else [value]
        if isinstance(value, dict) and get_origin(kind) is dict:
            items = list(value.values())
        merged: dict[str, object] = {}
        for item in items:
            if isinstance(item, dict):
                merged.update(item)
        missing += _keys_cover(nested[0], merged, where)
    return missing


def test_reference_config_sets_every_key_of_the_schema(tmp_path):
    # configs/reference.yaml is the "every key at once" block of docs/configuration.md
    # (the generated page embeds it; tests/unit/test_docs.py checks the page is current).
    data = yaml.safe_load((REPO / "configs" / "reference.yaml").read_text())
    config = parse_config(data, tmp_path)  # the reference is itself a valid file
    assert config.fleet.name
    assert _keys_cover(FleetConfig, data, "") == []


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


def test_batching_defaults():
    batching = BatchingConfig()
    assert batching.min_gain == 0.25
    assert batching.lower_priority_cost_bound == 0.10
    assert batching.adaptive_window is True


def test_starvation_resolves_class_names_per_node(tmp_path):
    config = load_config(
        write(
            tmp_path,
            """
models: {a: {path: a.onnx}}
node_defaults:
  starvation: {classes: {offline: {min_share: 0.05, max_wait_ms: 2000}}}
nodes:
  - {name: n0}
  - name: n1
    starvation: {classes: {background: {max_wait_ms: 500}}, protected: [inline]}
""",
        )
    )
    n0, n1 = config.node_specs()
    assert n0.starvation.params(n0.priorities) == StarvationParams(
        {0: ClassBound(0.05, 2.0)}, frozenset({10}), (0, 3, 7, 10)
    )
    assert n1.starvation.params(n1.priorities) == StarvationParams(
        {3: ClassBound(0.0, 0.5)}, frozenset({7}), (0, 3, 7, 10)
    )
    default = load_config(write(tmp_path, "models: {a: {path: a.onnx}}\n")).node_specs()[0]
    assert not default.starvation.params(default.priorities).enabled


BUDGET = "models: {a: {path: a.onnx}}\nnode_defaults: {token_budget: "
STARVE = "models: {a: {path: a.onnx}}\nnode_defaults:\n  starvation: "


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("models:\n  a: {path: a.onnx, colour: red}\n", "models.a.colour (line 2): unknown key"),
        (
            "models:\n  a: {path: a.onnx}\nrouter:\n  placement: {picker: first}\n",
            "router.placement (line 4): unknown picker 'first'; known: best, near_best",
        ),
        (
            "models:\n  a: {path: a.onnx}\nrouter:\n  placement:\n    scorers: {latency: 1}\n",
            "unknown scorer 'latency'; known: expected_completion, model_load",
        ),
        (
            "models:\n  a: {path: a.onnx}\nrouter:\n  placement: {lower_share: 2}\n",
            "router.placement.lower_share (line 4)",
        ),
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
        (
            BUDGET + "{background: {bulk: 0.5}}}\n",
            "node_defaults.token_budget.background.bulk (line 2): unknown priority class 'bulk'",
        ),
        (
            BUDGET + "{background: {offline: 2}}}\n",
            "node_defaults.token_budget.background.offline (line 2) is 2.0; allowed: a fraction "
            "in [0, 1]",
        ),
        (
            BUDGET + "{asleep: {offline: 0}}}\n",
            "node_defaults.token_budget.asleep.[key] (line 2): Input should be 'foreground' or",
        ),
        ("models: {a: {path: a.onnx}}\nray: {auth: password}\n", "ray.auth (line 2)"),
        (
            STARVE + "{classes: {bulk: {min_share: 0.1}}}\n",
            "node_defaults.starvation.classes.bulk (line 3): unknown priority class 'bulk'; known: "
            "foreground, inline, background, offline",
        ),
        (
            STARVE + "{classes: {offline: {min_share: 0.1}}, protected: [vip]}\n",
            "node_defaults.starvation.protected (line 3): unknown priority class 'vip'; known: "
            "foreground",
        ),
        (
            STARVE + "{classes: {offline: {min_share: 0.6}, background: {min_share: 0.5}}}\n",
            "node_defaults.starvation.classes (line 3): min_share values add up to 1.1; at most 1",
        ),
        (
            STARVE + "{classes: {offline: {}}}\n",
            "node_defaults.starvation.classes.offline (line 3): set min_share and/or max_wait_ms",
        ),
        (
            STARVE + "{classes: {offline: {max_wait_ms: 0}}}\n",
            "node_defaults.starvation.classes.offline.max_wait_ms (line 3)",
        ),
        (
            STARVE + "{classes: {offline: {min_share: 1.5}}}\n",
            "node_defaults.starvation.classes.offline.min_share (line 3)",
        ),
        (
            "models: {a: {path: a.onnx}}\n"
            "nodes: [{name: n, starvation: {classes: {bulk: {max_wait_ms: 9}}}}]\n",
            "nodes.0.starvation.classes.bulk (line 2): unknown priority class 'bulk'",
        ),
        (
            "models:\n  a:\n    path: a.onnx\n    batching: {lower_priority_cost_bound: -1}\n",
            "models.a.batching.lower_priority_cost_bound (line 4)",
        ),
        (
            "models:\n  lm: {path: a.onnx, kind: decoder, generation: {max_context: 1}}\n",
            "models.lm.generation.max_context (line 2)",
        ),
    ],
)
def test_bad_configs_name_the_problem(tmp_path, text, expected):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert expected in str(info.value)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")


def test_missing_model_files_point_only_built_in_models_at_models_make(tmp_path):
    from edgefleet.errors import ModelNotFound

    config = load_config(write(tmp_path, "models:\n  mine: {path: mine.onnx}\n"))
    with pytest.raises(ModelNotFound) as own:
        config.require_models()
    assert f"model 'mine': {tmp_path / 'mine.onnx'} does not exist" in str(own.value)
    assert "models make" not in str(own.value)  # nothing can generate a user's own model
    config = load_config(write(tmp_path, "models:\n  clf: {path: classifier.onnx}\n"))
    with pytest.raises(ModelNotFound, match=r"built-in model: .*`edgefleet models make DIR`"):
        config.require_models()


def test_a_symlink_cannot_lead_a_model_path_out_of_model_dir(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "secret.onnx").write_bytes(b"")
    models = tmp_path / "fleet" / "models"
    models.mkdir(parents=True)
    (models / "m.onnx").symlink_to(outside / "secret.onnx")
    path = write(tmp_path / "fleet", "model_dir: models\nmodels:\n  m: {path: m.onnx}\n")
    with pytest.raises(ConfigError, match=r"models\.m\.path .*outside the model directory"):
        load_config(path)


# ------------------------------------------------------------------------- pools


def test_pools_resolve_member_specs_and_take_no_simulated_nodes(tmp_path):
    config = load_config(
        write(
            tmp_path,
            """
models:
  a: {path: a.onnx}
  b: {path: b.onnx}
node_defaults: {queue: {capacity: 8}}
pools:
  - name: cameras
    selector: {device: camera, site: "in(s1, s2)", tier: "!spare"}
    models: [a]
    queue: {capacity: 32}
""",
        )
    )
    assert config.node_specs() == []  # no `nodes:`, no simulated ones either
    spec = config.member_spec("cameras", "cam-7", "abc123")
    assert spec.name == "cameras/cam-7" and spec.pool == "cameras" and spec.ray_node == "abc123"
    assert list(spec.models) == ["a"] and spec.queue.capacity == 32
    assert spec.preemption.min_priority_gap == 5  # the node defaults, as for nodes:
    assert config.served_models() == {"a"}
    selector = config.pools[0].matcher()
    assert selector.matches({"device": "camera", "site": "s2"})
    assert not selector.matches({"device": "camera", "site": "s2", "tier": "spare"})


POOL = "models: {a: {path: a.onnx}}\npools:\n  - name: cams\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (POOL + "    selector: {device: 'in(a,'}\n", "pools.0.selector (line 4): device: 'in(a,'"),
        (POOL + "    selector: {device: '!!a'}\n", "is no Ray label selector; allowed: a value"),
        (POOL + "    selector: {'-bad': a}\n", "label key '-bad' is not a Ray label key"),
        (POOL + "    selector: {}\n", "pools.0.selector (line 4): an empty selector"),
        (
            POOL + "    models: [b]\n    selector: {d: c}\n",
            "pools.0.models (line 4): unknown model",
        ),
        (
            POOL + "    selector: {d: c}\n  - {name: cams, selector: {d: e}}\n",
            "pools.1.name (line 5)",
        ),
        (
            "models: {a: {path: a.onnx}}\nnodes: [{name: cams}]\n"
            "pools: [{name: cams, selector: {d: c}}]\n",
            "pools.0.name (line 3): 'cams' is already the name of the node at nodes.0",
        ),
        (POOL + "    selector: {d: c}\n    resources: {x: 1}\n", "pools.0.resources (line 5)"),
        (POOL + "    selector: {d: c}\n    name: cams/x\n", "pools.0.name"),
    ],
)
def test_bad_pools_name_the_problem(tmp_path, text, expected):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert expected in str(info.value)
