"""`edgefleet plan`: the fewest nodes meeting targets, on a workload whose answer is
known by hand: 10 ms calls (no batching) at 450 requests/s need 5 nodes (4 serve at
most 400/s, so their queues grow and fill; 5 serve 500/s at 90 % load)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.cli import main
from edgefleet.config import load_config, parse_config
from edgefleet.errors import ConfigError, InvalidInput
from sim.plan import UnknownNodeType, parse_targets, plan
from sim.run import node_types, simulate
from sim.workload import load_workload

CLASSES = ["foreground", "inline", "background", "offline"]


@pytest.mark.parametrize(
    ("text", "figure", "op", "value"),
    [
        ("foreground.p99<=50ms", "p99", "<=", 0.05),
        ("all.p50 <= 1.5s", "p50", "<=", 1.5),
        ("offline.completed>=0.99", "completed", ">=", 0.99),
        ("offline.completed>=95%", "completed", ">=", 0.95),
    ],
)
def test_targets_read_as_written(text, figure, op, value):
    (target,) = parse_targets(text, CLASSES)
    assert (target.figure, target.op, target.value) == (figure, op, pytest.approx(value))


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("vip.p99<=50ms", "unknown class 'vip'"),
        ("foreground.p99<=50", "give the latency in ms or s"),
        ("foreground.completed>=50ms", "completed is a share"),
        ("foreground.completed>=1.5", "a share from 0 to 1"),
        ("foreground.p98<=5ms", "is not CLASS.FIGURE"),
        (" , ", "no target given"),
    ],
)
def test_a_bad_target_is_refused_naming_it(text, complaint):
    with pytest.raises(InvalidInput, match=complaint):
        parse_targets(text, CLASSES)


def _files(tmp_path: Path) -> tuple[str, str]:
    fleet = {"fleet": {"name": "plan"}, "models": {"m": {"path": "m.onnx", "warmup": False}}}
    workload = {
        "seed": 3,
        "requests": 1500,
        "arrivals": {"process": "poisson", "rate_per_node": 450},  # at the config's 1 node
        "mix": [{"model": "m", "priority": "foreground"}],
        "costs": {"m": {"call_ms": {1: 10.0}}},
    }
    parse_config(fleet, tmp_path)  # valid
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(fleet))
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(workload))
    return str(tmp_path / "fleet.yaml"), str(tmp_path / "w.yaml")


def test_plan_finds_the_fleet_size_computed_by_hand(tmp_path, capsys):
    fleet, workload = _files(tmp_path)
    target = "all.p99<=200ms,foreground.completed>=99%"
    out = tmp_path / "report"
    assert main(["plan", fleet, "--workload", workload, "--target", target, "--out", str(out)]) == 0
    said = capsys.readouterr()
    assert said.out.startswith("5 node(s) meet every target for 450 requests/s\n"), said.out
    assert "at 4 node(s) " in said.out  # what fails just below the answer
    assert "    4 node(s): " in said.err and ": missed" in said.err  # each size as tried
    assert (out / "plan.png").stat().st_size > 0
    assert "5 node(s) meet every target" in (out / "plan.md").read_text()

    # No size up to the limit meets the targets: exit 1, saying what still misses.
    code = main(["plan", fleet, "--workload", workload, "--target", target, "--max-nodes", "4",
                 "--out", str(out)])  # fmt: skip
    assert code == 1
    text = capsys.readouterr().out
    assert text.startswith("no fleet of up to 4 nodes meets every target for 450 requests/s")
    assert "all.p99<=200ms: " in text and "missed" in text


# Node types: a fast type (speed 2: 5 ms calls, 200/s a node, price 3) and a slow one
# (10 ms, 100/s, price 1) at 450 requests/s. As above, 400/s of capacity misses and
# 500/s meets the targets, so a mix of a fast and b slow meets them iff 2a + b >= 5:
# the fewest nodes are 3, as 3 fast (price 9) or 2 fast + 1 slow (price 7, the cheaper);
# the cheapest mix is 5 slow (price 5; 1 fast + 3 slow costs 6).
TARGET = "all.p99<=200ms,foreground.completed>=99%"


def _typed_files(tmp_path: Path, node_types: dict | None = None) -> tuple[str, str]:
    fleet = {
        "fleet": {"name": "plan"},
        "models": {"m": {"path": "m.onnx", "warmup": False}},
        "nodes": [{"name": "fast"}, {"name": "slow"}],
    }
    workload = {
        "seed": 3,
        "requests": 3000,
        "arrivals": {"process": "poisson", "rate": 450},
        "mix": [{"model": "m", "priority": "foreground"}],
        "costs": {"m": {"call_ms": {1: 10.0}}},
        "node_types": node_types
        if node_types is not None
        else {"fast": {"speed": 2, "price": 3}, "slow": {"price": 1}},
    }
    parse_config(fleet, tmp_path)  # valid
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(fleet))
    (tmp_path / "w.yaml").write_text(yaml.safe_dump(workload))
    return str(tmp_path / "fleet.yaml"), str(tmp_path / "w.yaml")


def test_plan_finds_the_mix_of_two_node_types_computed_by_hand(tmp_path, capsys):
    fleet, workload = _typed_files(tmp_path)
    out = tmp_path / "report"
    code = main(["plan", fleet, "--workload", workload, "--target", TARGET, "--out", str(out)])
    assert code == 0
    said = capsys.readouterr()
    lines = said.out.splitlines()
    assert lines[0] == "3 node(s) meet every target for 450 requests/s: 2 fast + 1 slow, price 7"
    assert "cheapest: 5 slow (5 node(s), price 5)" in lines
    assert "  at 4 slow all.p99<=200ms, foreground.completed>=99% fail(s) first" in lines
    assert "| fast | slow | nodes | price |" in said.out  # the table of every mix tried
    assert "(2 fast + 1 slow): " in said.err  # each mix as tried
    assert (out / "plan.png").stat().st_size > 0
    assert "2 fast + 1 slow" in (out / "plan.md").read_text()

    # No mix up to the limit: exit 1, the mix that came closest and what misses there.
    code = main(["plan", fleet, "--workload", workload, "--target", TARGET, "--max-nodes", "2",
                 "--out", str(out)])  # fmt: skip
    assert code == 1
    text = capsys.readouterr().out
    assert text.startswith(
        "no mix of up to 2 nodes of types fast, slow meets every target for 450 requests/s; "
        "at 2 fast, price 6:\n"
    ), text
    assert "missed there, furthest first: all.p99<=200ms, foreground.completed>=99%" in text


def test_node_type_restricts_the_search_to_that_type(tmp_path, capsys):
    fleet, workload = _typed_files(tmp_path)
    args = ["plan", fleet, "--workload", workload, "--target", TARGET, "--out", str(tmp_path)]
    assert main([*args, "--node-type", "fast"]) == 0
    said = capsys.readouterr()
    assert said.out.startswith("3 node(s) meet every target for 450 requests/s: 3 fast, price 9")
    assert "slow" not in said.out and "slow" not in said.err
    assert "cheapest" not in said.out  # one type: the fewest is the cheapest


def test_an_unknown_node_type_is_refused_naming_the_known(tmp_path, capsys):
    fleet, workload = _typed_files(tmp_path)
    config, w = load_config(fleet), load_workload(workload)
    targets = parse_targets(TARGET, CLASSES)
    with pytest.raises(UnknownNodeType, match=r"unknown node type 'gpu'; the config's: fast, slow"):
        plan(config, w, targets, types=["fast", "gpu"])
    args = ["plan", fleet, "--workload", workload, "--target", TARGET]
    assert main([*args, "--node-type", "fast", "--node-type", "gpu,tpu"]) == 2
    assert "unknown node type 'gpu', 'tpu'; the config's: fast, slow" in capsys.readouterr().err

    # The workload's node_types: name types of the fleet too.
    fleet, workload = _typed_files(tmp_path, {"gpu": {"speed": 4}})
    with pytest.raises(ConfigError, match=r"'gpu' is not a node type of the fleet; known: fast"):
        plan(load_config(fleet), load_workload(workload), targets)


def test_a_config_of_one_type_takes_its_speed(tmp_path, capsys):
    """One type is planned as before (by size, not by mix), at the speed the workload
    gives it: 5 ms calls at 450 requests/s need 3 nodes (2 serve 400/s)."""
    fleet, workload = _files(tmp_path)
    w = yaml.safe_load(Path(workload).read_text())
    w["node_types"] = {"local": {"speed": 2}}
    Path(workload).write_text(yaml.safe_dump(w))
    args = ["plan", fleet, "--workload", workload, "--target", TARGET, "--out", str(tmp_path)]
    assert main(args) == 0
    said = capsys.readouterr()
    assert said.out.startswith("3 node(s) meet every target for 450 requests/s\n"), said.out
    assert "    3 node(s): " in said.err


def test_node_types_that_do_not_serve_the_workload_are_refused(tmp_path):
    fleet, workload = _typed_files(tmp_path, {})
    config = parse_config(
        {
            "fleet": {"name": "plan"},
            "models": {"m": {"path": "m.onnx", "warmup": False}, "n": {"path": "n.onnx"}},
            "nodes": [{"name": "fast", "models": ["m"]}, {"name": "other", "models": ["n"]}],
        },
        tmp_path,
    )
    targets = parse_targets(TARGET, CLASSES)
    with pytest.raises(InvalidInput, match="node types other serve no m, which the workload"):
        plan(config, load_workload(workload), targets, types=["other"])


def test_a_node_type_takes_its_own_costs_and_speed(tmp_path):
    """Requests one at a time (10 a second, each 1 ms of network): on a fast node of
    its own 5 ms table, 6 ms each; on a slow node (speed 0.5 of 10 ms), 21 ms."""
    fleet, workload = _typed_files(
        tmp_path, {"fast": {"costs": {"m": {"call_ms": {1: 5.0}}}}, "slow": {"speed": 0.5}}
    )
    w = load_workload(workload).model_copy(update={"requests": 20})
    w = w.model_copy(update={"arrival_process": w.arrival_process.model_copy(update={"rate": 10})})
    config = load_config(fleet)
    types = node_types(config, w)
    for name, ms in (("fast", 6.0), ("slow", 21.0)):
        t = types[name]
        run = simulate(config, w, specs=[t.spec(config, 0)], types=[t])
        assert run.latency_table()[-1]["p50_ms"] == pytest.approx(ms, abs=0.5), name
