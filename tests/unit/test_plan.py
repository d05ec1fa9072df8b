"""`edgefleet plan`: the fewest nodes meeting targets, on a workload whose answer is
known by hand: 10 ms calls (no batching) at 450 requests/s need 5 nodes (4 serve at
most 400/s, so their queues grow and fill; 5 serve 500/s at 90 % load)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cluster.cli import main
from edgefleet.config import parse_config
from edgefleet.errors import InvalidInput
from sim.plan import parse_targets

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
        "requests": 3000,
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
