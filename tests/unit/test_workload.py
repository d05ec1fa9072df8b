"""The simulator's workload: the YAML schema and its errors, seeded arrivals, fleet events
and recorded traces."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from pathlib import Path

import pytest

from edgefleet.config import load_config
from edgefleet.errors import ConfigError
from sim.fleet import ModelCost
from sim.run import fitted_decoder, workload_costs
from sim.workload import (
    Arrival,
    FleetEvent,
    RecordedGeneration,
    Workload,
    load_workload,
    parse_workload,
    read_engine_times,
    read_generation_times,
    read_trace,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "configs" / "sim").glob("*.yaml"))


def write(tmp_path: Path, text: str, name: str = "workload.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def workload(**overrides: object) -> Workload:
    data: dict[str, object] = {
        "duration_s": 10,
        "arrivals": {"rate": 1000},
        "mix": [{"model": "m", "priority": "foreground"}],
    }
    data.update(overrides)
    return parse_workload(data)


def arrivals(w: Workload, seed: int = 1, nodes: int = 1, **kw: object) -> list[Arrival]:
    return list(w.arrivals(random.Random(seed), nodes=nodes, **kw))  # type: ignore[arg-type]


# -- files -----------------------------------------------------------------------------


def test_the_examples_load_and_fit_the_local_fleet():
    assert {p.name for p in EXAMPLES} >= {
        "steady.yaml",
        "bursts.yaml",
        "diurnal.yaml",
        "failures.yaml",
        "chat.yaml",
    }
    fleet = load_config(REPO / "configs" / "local.yaml")
    for path in EXAMPLES:
        assert path.read_text().startswith("# "), f"{path.name} says what it models"
        w = load_workload(path)
        w.check(fleet.priorities, set(fleet.models))
        first = next(w.arrivals(random.Random(w.seed), nodes=2, priorities=fleet.priorities))
        assert first.at >= 0 and first.model in fleet.models
    failures = load_workload(REPO / "configs" / "sim" / "failures.yaml").fleet_events
    assert failures.node_failures is not None and failures.node_failures.down_s == 30
    chat = load_workload(REPO / "configs" / "sim" / "chat.yaml")
    assert any(c.sessions and c.generate and c.model == "tiny_lm" for c in chat.mix or [])


BROKEN = [
    (  # an unknown key
        "duration_s: 5\narrivals:\n  rate: 5\n  burst: {every_s: 1}\n"
        "mix: [{model: m, priority: 1}]\n",
        r"arrivals\.burst \(line 4\): unknown key",
    ),
    (  # an unknown process
        "duration_s: 5\narrivals:\n  process: waves\n  rate: 5\nmix: [{model: m, priority: 1}]\n",
        r"arrivals\.process \(line 3\): Input should be 'poisson', 'bursts', 'diurnal' "
        r"or 'periodic'",
    ),
    (  # both rates
        "duration_s: 5\narrivals:\n  rate: 5\n  rate_per_node: 1\nmix: [{model: m, priority: 1}]\n",
        r"arrivals\.rate_per_node \(line 4\): set only one of rate and rate_per_node",
    ),
    (  # no rate
        "duration_s: 5\narrivals:\n  process: poisson\nmix: [{model: m, priority: 1}]\n",
        r"arrivals \(line 2\): set rate",
    ),
    (  # nothing ends it
        "seed: 3\narrivals:\n  rate: 5\nmix: [{model: m, priority: 1}]\n",
        r"arrivals \(line 2\): nothing ends the arrivals: set requests and/or duration_s",
    ),
    (  # a negative weight
        "requests: 9\narrivals: {rate: 5}\nmix:\n  - {model: m, priority: 1}\n"
        "  - {model: m, priority: 2, weight: -1}\n",
        r"mix\.1\.weight \(line 5\): Input should be greater than or equal to 0",
    ),
    (  # a priority out of range
        "requests: 9\narrivals: {rate: 5}\nmix:\n  - {model: m, priority: 11}\n",
        r"mix\.0\.priority \(line 4\): priority 11 is out of range",
    ),
    (  # sessions on inferences
        "requests: 9\narrivals: {rate: 5}\nmix:\n  - {model: m, priority: 1, sessions: 4}\n",
        r"mix\.0\.sessions \(line 4\): sessions are for generations",
    ),
    (  # bursts without their settings
        "requests: 9\narrivals:\n  process: bursts\n  rate: 5\nmix: [{model: m, priority: 1}]\n",
        r"arrivals\.bursts \(line 2\): required with process: bursts",
    ),
    (  # a burst as long as its period
        "requests: 9\narrivals:\n  process: bursts\n  rate: 5\n"
        "  bursts: {every_s: 1, length_s: 1, factor: 2}\nmix: [{model: m, priority: 1}]\n",
        r"arrivals\.bursts\.length_s \(line 5\): must be shorter than every_s",
    ),
    (  # no mix
        "requests: 9\narrivals: {rate: 5}\n",
        r"mix: required",
    ),
    (  # a trace and generated arrivals
        "requests: 9\narrivals: {rate: 5}\nmix: [{model: m, priority: 1}]\ntrace: t.jsonl\n",
        r"arrivals \(line 2\): a trace replaces arrivals and mix(.|\n)*"
        r"trace \(line 4\): no such file",
    ),
    (  # engine times from a call record that is not there
        "requests: 9\narrivals: {rate: 5}\nmix: [{model: m, priority: 1}]\ncosts_from: calls/\n",
        r"costs_from \(line 4\): no such file or folder: .*calls",
    ),
]
_ARRIVING = "requests: 9\narrivals: {rate: 5}\nmix: [{model: m, priority: 1}]\n"
BROKEN += [
    (  # churn without a leave rate
        _ARRIVING + "churn:\n  declared_dead_after_s: 15\n",
        r"churn\.leave_per_device_per_hour \(line 4\): Field required",
    ),
    (  # churn without the head's limit
        _ARRIVING + "churn: {leave_per_device_per_hour: 2}\n",
        r"churn\.declared_dead_after_s \(line 4\): Field required",
    ),
    (  # a leave rate of 0
        _ARRIVING + "churn:\n  leave_per_device_per_hour: 0\n  declared_dead_after_s: 15\n",
        r"churn\.leave_per_device_per_hour \(line 5\): Input should be greater than 0",
    ),
    (  # a head that never declares a device dead
        _ARRIVING + "churn:\n  leave_per_device_per_hour: 2\n  declared_dead_after_s: 3600\n",
        r"churn\.declared_dead_after_s \(line 6\): Input should be less than or equal to 300",
    ),
    (  # a negative time to come back
        _ARRIVING + "churn:\n  leave_per_device_per_hour: 2\n  declared_dead_after_s: 15\n"
        "  rejoin_after_s: -1\n",
        r"churn\.rejoin_after_s \(line 7\): Input should be greater than 0",
    ),
    (  # an unknown distribution
        _ARRIVING + "churn:\n  leave_per_device_per_hour: 2\n  declared_dead_after_s: 15\n"
        "  rejoin_after_s: 30\n  rejoin_distribution: normal\n",
        r"churn\.rejoin_distribution \(line 8\): Input should be 'exponential' or 'fixed'",
    ),
    (  # a distribution of nothing
        _ARRIVING + "churn:\n  leave_per_device_per_hour: 2\n  declared_dead_after_s: 15\n"
        "  rejoin_distribution: fixed\n",
        r"churn\.rejoin_distribution \(line 7\): needs rejoin_after_s",
    ),
    (  # a share of none
        _ARRIVING + "churn: {leave_per_device_per_hour: 2, declared_dead_after_s: 15, share: 0}\n",
        r"churn\.share \(line 4\): Input should be greater than 0",
    ),
    (  # an unknown key
        _ARRIVING + "churn: {leave_per_hour: 2, declared_dead_after_s: 15}\n",
        r"churn\.leave_per_hour \(line 4\): unknown key",
    ),
    (  # churn and node failures together
        _ARRIVING + "events: {node_failures: {per_minute: 1}}\n"
        "churn: {leave_per_device_per_hour: 2, declared_dead_after_s: 15}\n",
        r"churn \(line 5\): churn and events\.node_failures both take devices down",
    ),
]


@pytest.mark.parametrize(("text", "message"), BROKEN)
def test_broken_files_name_the_path_and_line(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as info:
        load_workload(path)
    assert str(info.value).startswith(f"invalid workload {path}:")


def test_unreadable_and_non_mapping_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read workload"):
        load_workload(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_workload(write(tmp_path, "- 1\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_workload(write(tmp_path, "a: [1\n"))


def test_check_names_unserved_models_and_unknown_classes(tmp_path):
    path = write(
        tmp_path,
        "duration_s: 5\narrivals: {rate: 5}\nmix:\n"
        "  - {model: classifier, priority: urgent}\n"
        "  - {model: ghost, priority: 3}\n"
        "costs: {classifier: {call_ms: {1: 1}}}\n",
    )
    w = load_workload(path)
    priorities = {"foreground": 10, "offline": 0}
    with pytest.raises(ConfigError) as info:
        w.check(priorities, {"classifier", "heavy"})
    message = str(info.value)
    assert str(path) in message
    assert "mix.0.priority (line 4): unknown priority class 'urgent'" in message
    assert "foreground (10), offline (0)" in message
    assert "mix.1.model (line 5): the fleet does not serve 'ghost'" in message
    assert "classifier, heavy" in message
    with pytest.raises(ConfigError, match=r"costs \(line 6\): no engine time for 'ghost'"):
        w.check(priorities | {"urgent": 9}, {"classifier", "ghost"})
    fits = w.model_copy(update={"costs": w.costs | {"ghost": w.costs["classifier"]}})
    fits.check(priorities | {"urgent": 9}, {"classifier", "ghost"})  # no error
    # arrivals() refuses an unknown class too, when it is called
    with pytest.raises(ConfigError, match=r"mix\.0\.priority \(line 4\): unknown priority"):
        w.arrivals(random.Random(1), nodes=1, priorities=priorities)


def test_direct_construction_is_validated_too():
    with pytest.raises(ValueError, match="set only one of rate and rate_per_node"):
        Workload.model_validate(
            {
                "requests": 5,
                "arrivals": {"rate": 1, "rate_per_node": 1},
                "mix": [{"model": "m", "priority": 1}],
            }
        )


# -- arrivals --------------------------------------------------------------------------


def test_poisson_count_rate_and_mix_are_as_configured():
    w = workload(
        arrivals={"rate_per_node": 250},
        mix=[
            {"model": "a", "priority": "foreground", "weight": 1},
            {"model": "b", "priority": 3, "weight": 3},
        ],
    )
    got = arrivals(w, nodes=4)  # 1000/s for 10 s: 10000 expected, sd 100
    assert abs(len(got) - 10_000) < 300
    assert all(0 <= a.at < 10 for a in got)
    assert all(x.at <= y.at for x, y in zip(got, got[1:], strict=False))
    gaps = [y.at - x.at for x, y in zip(got, got[1:], strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(1e-3, rel=0.03)
    models = Counter(a.model for a in got)
    assert models["b"] / len(got) == pytest.approx(0.75, abs=0.015)
    assert {(a.model, a.priority) for a in got} == {("a", 10), ("b", 3)}
    assert w.mean_rate(4) == 1000


def test_bursts_have_the_higher_rate_inside_bursts():
    w = workload(
        duration_s=40,
        arrivals={
            "process": "bursts",
            "rate": 200,
            "bursts": {"every_s": 4, "length_s": 1, "factor": 5},
        },
    )
    got = arrivals(w)
    inside = [a for a in got if a.at >= 4 and a.at % 4 < 1]  # 9 bursts of 1 s
    outside = len(got) - len(inside)  # 31 s at the base rate
    assert len(inside) / 9 == pytest.approx(1000, rel=0.05)
    assert outside / 31 == pytest.approx(200, rel=0.05)
    first = [a for a in got if a.at < 1]  # no burst before every_s
    assert len(first) == pytest.approx(200, rel=0.2)


def test_diurnal_follows_the_ramp():
    period, low, rate = 20.0, 0.2, 1000.0
    w = workload(
        duration_s=60,
        arrivals={"process": "diurnal", "rate": rate, "diurnal": {"period_s": period, "low": low}},
    )
    got = arrivals(w)
    bins = Counter(int(a.at) for a in got)  # one-second bins, over three periods

    def expected(second: int) -> float:  # the rate integrated over [second, second + 1)
        w_ = 2 * math.pi / period
        cos_integral = (math.sin(w_ * (second + 1)) - math.sin(w_ * second)) / w_
        return rate * (low + (1 - low) / 2 * (1 - cos_integral))

    for second in range(60):
        assert bins[second] == pytest.approx(expected(second), abs=5 * math.sqrt(expected(second)))
    trough = sum(bins[s] for s in (0, 19, 20, 39, 40, 59))
    peak = sum(bins[s] for s in (9, 10, 29, 30, 49, 50))
    assert peak > 3.5 * trough
    assert len(got) / 60 == pytest.approx(w.mean_rate(1), rel=0.03)


def test_the_same_seed_gives_the_same_arrivals_and_a_shorter_run_a_prefix():
    w = workload(
        mix=[
            {"model": "a", "priority": 1, "keys": 10},
            {"model": "b", "priority": 2, "deadline_ms": 50},
        ]
    )
    full = arrivals(w, seed=7)
    assert arrivals(w, seed=7) == full
    assert arrivals(w, seed=8) != full
    assert arrivals(w, seed=7, requests=123) == full[:123]
    shorter = arrivals(parse_workload({**w.model_dump(by_alias=True), "duration_s": 3}), seed=7)
    assert shorter == [a for a in full if a.at < 3]


def test_arrivals_use_the_rng_once_when_called():
    w = workload()
    rng = random.Random(3)
    lazy = w.arrivals(rng, nodes=1)
    rng.random()  # later use of the same rng does not change the arrivals
    assert list(lazy) == arrivals(w, seed=3)


def test_requests_bound_the_arrivals():
    w = workload(requests=500, duration_s=None)
    assert len(arrivals(w)) == 500
    assert len(arrivals(w, requests=40_000)) == 40_000  # the argument overrides the file
    assert arrivals(w, requests=0) == []
    # whichever comes first: 10 s at 1000/s ends before 50000 requests
    assert len(arrivals(workload(requests=50_000))) < 11_000
    with pytest.raises(ValueError, match="nodes"):
        workload().arrivals(random.Random(1), nodes=0)


def test_deadlines_keys_sessions_and_generations_are_drawn():
    w = workload(
        mix=[
            {"model": "clf", "priority": "inline", "deadline_ms": 200, "keys": 50, "rows": 3},
            {
                "model": "lm",
                "priority": "background",
                "sessions": 20,
                "generate": {"prompt_tokens": 32, "max_new_tokens": 16},
            },
        ]
    )
    got = arrivals(w)
    clf = [a for a in got if a.model == "clf"]
    lm = [a for a in got if a.model == "lm"]
    assert {(a.deadline_s, a.rows, a.priority, a.session, a.prompt_tokens) for a in clf} == {
        (0.2, 3, 7, None, 0)
    }
    assert {a.key for a in clf} == {f"k{i}" for i in range(50)}
    assert {(a.deadline_s, a.key, a.priority, a.prompt_tokens, a.max_new_tokens) for a in lm} == {
        (None, None, 3, 32, 16)
    }
    assert {a.session for a in lm} == {f"s{i}" for i in range(20)}
    assert all(a.id is None for a in got)


def test_custom_priority_classes_resolve():
    w = workload(mix=[{"model": "m", "priority": "urgent"}, {"model": "m", "priority": 4}])
    got = arrivals(w, priorities={"urgent": 9})
    assert {a.priority for a in got} == {9, 4}


# -- events ----------------------------------------------------------------------------


def test_node_failures_come_at_the_configured_rate_and_rejoin_down_s_later():
    w = workload(events={"node_failures": {"per_minute": 0.01, "down_s": 30}})
    events = w.events(random.Random(5), nodes=1000, horizon_s=600)
    fails = [e for e in events if e.kind == "fail"]
    # 1000 nodes x 1 % a minute x 10 minutes: 100 expected (a few nodes are down at a time)
    assert 70 <= len(fails) <= 130
    assert all(x.at <= y.at for x, y in zip(events, events[1:], strict=False))
    assert all(0 <= e.node < 1000 and 0 <= e.at <= 600 for e in events)
    rejoins = {(e.node, round(e.at, 9)) for e in events if e.kind == "rejoin"}
    for f in fails:
        if f.at + 30 <= 600:
            assert (f.node, round(f.at + 30, 9)) in rejoins
    assert len(rejoins) == sum(f.at + 30 <= 600 for f in fails)
    down: set[int] = set()
    for e in events:  # a node fails only while up, rejoins only while down
        if e.kind == "fail":
            assert e.node not in down
            down.add(e.node)
        else:
            down.remove(e.node)
    assert w.events(random.Random(5), nodes=1000, horizon_s=600) == events


def test_failed_nodes_never_rejoin_without_down_s():
    w = workload(events={"node_failures": {"per_minute": 60}})  # one a second per node
    events = w.events(random.Random(1), nodes=3, horizon_s=100)
    assert [e.kind for e in events] == ["fail"] * 3
    assert sorted(e.node for e in events) == [0, 1, 2]


def churning(**churn: object) -> Workload:
    return workload(churn={"leave_per_device_per_hour": 60, "declared_dead_after_s": 5, **churn})


def test_churning_devices_leave_at_the_configured_rate_and_come_back():
    w = churning(rejoin_after_s=30)  # once a minute per device, 30 s away on average
    events = w.events(random.Random(5), nodes=200, horizon_s=600)
    leaves = [e for e in events if e.kind == "leave"]
    joins = [e for e in events if e.kind == "join"]
    # 200 devices x 1 a minute x 10 minutes, each away a third of the time: about 1,330
    assert 1150 <= len(leaves) <= 1500 and len(leaves) - 200 <= len(joins) <= len(leaves)
    assert all(x.at <= y.at for x, y in zip(events, events[1:], strict=False))
    away: dict[int, float] = {}
    absences = []
    for e in events:  # a device leaves only while in the fleet, joins only while away
        if e.kind == "leave":
            assert e.node not in away
            away[e.node] = e.at
        else:
            absences.append(e.at - away.pop(e.node))
    assert 25 <= sum(absences) / len(absences) <= 35  # exponential, mean 30 s
    assert min(absences) < 5 < 60 < max(absences)
    assert w.events(random.Random(5), nodes=200, horizon_s=600) == events


def test_churn_draws_after_the_other_events_and_can_be_fixed_or_partial():
    lifecycle = {"lifecycle": [{"at_s": 10, "state": "background", "share": 0.5}]}
    plain = workload(events=lifecycle).events(random.Random(3), nodes=10, horizon_s=600)
    churn = {"leave_per_device_per_hour": 60, "declared_dead_after_s": 5}
    fixed = {"rejoin_after_s": 4, "rejoin_distribution": "fixed", "share": 0.3}
    both = workload(events=lifecycle, churn=churn | fixed)
    events = both.events(random.Random(3), nodes=10, horizon_s=600)
    assert [e for e in events if e.kind == "lifecycle"] == plain  # unchanged by churn
    churned = [e for e in events if e.kind in ("leave", "join")]
    assert len({e.node for e in churned}) == 3  # 30 % of 10 devices
    away: dict[int, float] = {}
    for e in churned:
        if e.kind == "leave":
            away[e.node] = e.at
        else:
            assert e.at - away.pop(e.node) == pytest.approx(4.0)
    never = churning().events(random.Random(3), nodes=4, horizon_s=600)
    assert [e.kind for e in never] == ["leave"] * 4  # no rejoin_after_s: they stay away


def test_lifecycle_changes_switch_a_share_of_the_nodes():
    w = workload(
        events={
            "lifecycle": [
                {"at_s": 10, "state": "background", "share": 0.5},
                {"at_s": 30, "state": "foreground", "share": 1.0},
                {"at_s": 99, "state": "background", "share": 0.1},
            ]
        }
    )
    events = w.events(random.Random(2), nodes=10, horizon_s=60)
    assert [(e.at, e.state) for e in events] == [(10, "background")] * 5 + [(30, "foreground")] * 10
    assert all(e.kind == "lifecycle" for e in events)
    assert len({e.node for e in events[:5]}) == 5
    assert workload().events(random.Random(1), nodes=4, horizon_s=60) == []
    one = w.events(random.Random(2), nodes=1, horizon_s=10)
    assert one == [FleetEvent(10, "lifecycle", 0, "background")]


# -- traces ----------------------------------------------------------------------------


def test_read_trace_round_trip(tmp_path):
    recorded = [
        Arrival(1000.5, "clf", 10, rows=2, deadline_s=0.2, key="cam-1", id="r-2"),
        Arrival(1000.0, "lm", 3, session="s1", prompt_tokens=8, max_new_tokens=4, id="r-1"),
        Arrival(1002.25, "clf", 0, id="r-3"),
    ]
    lines = []
    for a in recorded:
        line = {name: getattr(a, name) for name in Arrival.__slots__}
        line |= {"outcome": "completed", "latency_s": 0.01, "node": "edge-0"}
        lines.append(json.dumps(line))
    lines.insert(1, "")  # blank lines are skipped
    lines.append(json.dumps({"at": 1001, "model": "clf", "priority": 5}))  # defaults
    path = write(tmp_path, "\n".join(lines) + "\n", "trace.jsonl")
    got = read_trace(path)
    assert [a.at for a in got] == [0.0, 0.5, 1.0, 2.25]
    assert got[0] == Arrival(
        0.0, "lm", 3, session="s1", prompt_tokens=8, max_new_tokens=4, id="r-1"
    )
    assert got[1] == Arrival(0.5, "clf", 10, rows=2, deadline_s=0.2, key="cam-1", id="r-2")
    assert got[2] == Arrival(1.0, "clf", 5)
    assert read_trace(write(tmp_path, "", "empty.jsonl")) == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"at": 1, "model": "m", "priority": 1}\n{"at": 2,\n', r":2: not valid JSON"),
        ('{"at": 1, "priority": 1}\n', r":1: model: missing"),
        ('{"at": 1, "model": "m", "priority": 11}\n', r":1: priority: must be an int 0-10, got 11"),
        ('{"at": "1", "model": "m", "priority": 1}\n', r":1: at: must be a number"),
        ('{"at": 1, "model": "m", "priority": 1, "rows": 0}\n', r":1: rows: must be an int >= 1"),
        ('{"at": 1, "model": "m", "priority": 1, "key": ""}\n', r":1: key: must be null or a"),
        ("[1, 2]\n", r":1: a line must be a JSON object"),
    ],
)
def test_read_trace_names_the_line_and_field(tmp_path, text, message):
    path = write(tmp_path, text, "trace.jsonl")
    with pytest.raises(ConfigError, match=f"{path}{message}"):
        read_trace(path)


def test_read_trace_skips_a_last_line_cut_short(tmp_path):
    path = write(tmp_path, '{"at": 1, "model": "m", "priority": 1}\n{"at": 2, "mo', "t.jsonl")
    assert read_trace(path) == [Arrival(0.0, "m", 1)]
    with pytest.raises(ConfigError, match="cannot read trace"):
        read_trace(tmp_path / "nope.jsonl")


def test_a_workload_replays_its_trace(tmp_path):
    lines = [json.dumps({"at": 50 + i, "model": "clf", "priority": 7}) for i in range(10)]
    (tmp_path / "traces").mkdir()
    write(tmp_path, "\n".join(lines) + "\n", "traces/rec.jsonl")
    path = write(
        tmp_path, "requests: 6\ntrace: traces/rec.jsonl\ncosts: {clf: {call_ms: {1: 1}}}\n"
    )
    w = load_workload(path)
    got = arrivals(w)
    assert [a.at for a in got] == [0, 1, 2, 3, 4, 5]
    assert len(arrivals(w, requests=100)) == 10
    bounded = load_workload(write(tmp_path, "duration_s: 3.5\ntrace: traces/rec.jsonl\n"))
    assert len(arrivals(bounded)) == 4
    assert w.mean_rate(3) is None
    w.check({}, {"clf"})
    with pytest.raises(ConfigError, match=r"trace \(line 2\): 10 arrivals .* for 'clf'"):
        w.check({}, {"heavy"})


# -- engine times from a call record ---------------------------------------------------


def engine_ms(times):
    """Recorded engine times without when each call started."""
    return {m: {n: [c.ms for c in calls] for n, calls in by.items()} for m, by in times.items()}


def test_recorded_calls_are_in_the_order_they_started(tmp_path):
    lines = [
        call_line(
            at=10.0, service_ms=1.0, queue_ms=30.0, latency_s=0.04, handoff_ms=0.3, abort_ms=2.5
        ),
        call_line(at=10.01, service_ms=2.0, queue_ms=0.0),
        call_line(at=9.0, service_ms=3.0, queue_ms=None, node=None),
    ]
    times = read_engine_times(write(tmp_path, "".join(lines), "calls.jsonl"))
    # each with its request's time outside the node where the line has its latency
    # (40 ms less 30 queued and 1 on the engine), the node that ran it, its hand-off and
    # the wait for the call aborted before it
    assert times["m"][1] == [
        (0.0, 3.0, None, None, None, None),
        (pytest.approx(1.01), 2.0, None, "edge-0", None, None),
        (pytest.approx(1.03), 1.0, pytest.approx(9.0), "edge-0", 0.3, 2.5),  # at 10.03
    ]


def call_line(**fields: object) -> str:
    """A call record's line: a completed batch-1 inference of m unless ``fields`` say."""
    line: dict[str, object] = {
        "at": 1.0,
        "model": "m",
        "priority": 5,
        "rows": 1,
        "prompt_tokens": 0,
        "outcome": "completed",
        "node": "edge-0",
        "service_ms": 4.0,
        "queue_ms": 0.5,
        "batch": 1,
    }
    return json.dumps(line | fields) + "\n"


def test_engine_times_come_from_completed_inferences_of_a_call_record(tmp_path):
    (tmp_path / "calls").mkdir()
    write(
        tmp_path,
        call_line()
        + call_line(service_ms=6.0)
        + call_line(service_ms=9.5, batch=4)
        + call_line(model="n", service_ms=2.0)
        + call_line(service_ms=50.0, outcome="deadlineexceeded")  # not completed
        + call_line(service_ms=None, queue_ms=None, batch=None, node="", outcome="rejected")
        + call_line(service_ms=0.0, batch=0, outcome="completed")  # no call served it
        + call_line(model="lm", prompt_tokens=8, service_ms=None, batch=None)  # a generation
        + json.dumps({"at": 2.0, "model": "m", "priority": 1, "outcome": "completed"})  # old
        + "\n",
        "calls/calls-a.jsonl",
    )
    write(tmp_path, call_line(service_ms=5.0), "calls/calls-b.jsonl")
    expected = {"m": {1: [4.0, 5.0, 6.0], 4: [9.5]}, "n": {1: [2.0]}}
    times = read_engine_times(tmp_path / "calls")
    assert engine_ms(times) == expected
    # each call started queue_ms after its arrival, 1 s into the record (the old line)
    starts = [c.at for by_size in times.values() for calls in by_size.values() for c in calls]
    assert starts == [pytest.approx(0.0005)] * 5
    # a workload names the record relative to its own folder
    path = write(
        tmp_path,
        "requests: 9\narrivals: {rate: 5}\nmix: [{model: m, priority: 1}]\ncosts_from: calls\n",
    )
    w = load_workload(path)
    assert w.costs_from == tmp_path / "calls"
    assert engine_ms(w.engine_times()) == expected
    assert workload().engine_times() == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (call_line(service_ms=-1.0), r":1: service_ms: must be null or a number >= 0, got -1.0"),
        (call_line(batch=1.5), r":1: batch: must be null or an int >= 0, got 1.5"),
        (call_line(queue_ms="1"), r":1: queue_ms: must be null or a number >= 0"),
        (call_line(handoff_ms=-0.1), r":1: handoff_ms: must be null or a number >= 0"),
        (call_line(abort_ms="2"), r":1: abort_ms: must be null or a number >= 0, got '2'"),
        (call_line() + call_line(priority=12), r":2: priority: must be an int 0-10"),
        (call_line(outcome="rejected"), r": no engine times in this call record"),
        (call_line(service_ms=None, batch=None), r": no engine times in this call record"),
    ],
)
def test_a_call_record_names_the_line_and_field_of_a_bad_figure(tmp_path, text, message):
    path = write(tmp_path, text, "calls.jsonl")
    with pytest.raises(ConfigError, match=f"{path}{message}"):
        read_engine_times(path)


def generation_line(prompt: int, made: int, ms: float, **fields: object) -> str:
    """A call record's line of a completed generation of lm: its prompt prefilled once,
    then a step for each token after the first."""
    figures = {"model": "lm", "prompt_tokens": prompt, "service_ms": ms, "batch": None}
    figures |= {"latency_s": 0.020}
    figures |= {"new_tokens": made, "fed_tokens": prompt + made - 1}
    return call_line(**(figures | fields))


def test_generation_times_come_from_completed_generations_of_a_call_record(tmp_path):
    text = (
        generation_line(32, 32, 10.0)
        + generation_line(256, 64, 40.0, node="edge-1")
        + generation_line(32, 32, 99.0, outcome="cancelled")  # not completed
        + generation_line(32, 0, 1.0)  # made nothing
        + call_line()  # an inference
        + call_line(model="lm", prompt_tokens=8, service_ms=None, batch=None)  # an old line
    )
    path = write(tmp_path, text, "calls.jsonl")
    # outside: the latency (20 ms) less the queue (0.5 ms) and the engine time
    assert read_generation_times(path) == {
        "lm": [
            RecordedGeneration(32 - 1, 32, 10.0, pytest.approx(9.5)),
            RecordedGeneration(256 - 1, 64, 40.0, 0.0),  # a latency below them: none
        ]
    }
    assert engine_ms(read_engine_times(path)) == {"m": {1: [4.0]}}
    # a record of generations alone has engine times for the simulator too
    only = write(tmp_path, generation_line(32, 32, 10.0), "generations.jsonl")
    assert read_engine_times(only) == {} and read_generation_times(only)
    bad = write(tmp_path, generation_line(32, 32, 10.0, new_tokens=-1), "bad.jsonl")
    with pytest.raises(ConfigError, match=r":1: new_tokens: must be null or an int >= 0"):
        read_generation_times(bad)


def test_a_decoders_costs_are_fitted_to_its_recorded_generations(tmp_path):
    table = ModelCost(prefill_ms_per_token=0.05, step_ms={1: 0.15, 4: 0.3})
    # engine ms = 0.02 a token prefilled + 0.9 a token made, in two shapes
    shapes = [(31, 32), (255, 64), (31, 32), (255, 64)]
    recorded = [RecordedGeneration(p, m, 0.02 * p + 0.9 * m) for p, m in shapes]
    fitted = fitted_decoder(recorded, table)
    assert fitted.prefill_ms_per_token == pytest.approx(0.02)
    assert fitted.step_ms == pytest.approx({1: 0.9, 4: 1.8})  # the table's shape, scaled
    # one shape cannot tell prefill from steps apart: the table scaled to match it
    one = fitted_decoder(recorded[:1], table)
    assert one.prefill_ms_per_token / one.step_ms[1] == pytest.approx(0.05 / 0.15)
    assert 31 * one.prefill_ms_per_token + 32 * one.step_ms[1] == pytest.approx(recorded[0].ms)
    # no table: all of it a step's
    bare = fitted_decoder(recorded[:1], ModelCost())
    assert bare.prefill_ms_per_token == 0 and bare.step_ms == {
        1: pytest.approx(recorded[0].ms / 32)
    }
    # through workload_costs, from a call record
    lines = [generation_line(p + 1, m, r.ms) for (p, m), r in zip(shapes, recorded, strict=True)]
    record = write(tmp_path, "".join(lines), "c.jsonl")
    w = parse_workload(
        {"requests": 9, "arrivals": {"rate": 5}, "mix": [{"model": "lm", "priority": 1,
         "generate": {"prompt_tokens": 8, "max_new_tokens": 4}}],
         "costs": {"lm": {"prefill_ms_per_token": 0.05, "step_ms": {1: 0.15, 4: 0.3}}}}
    )  # fmt: skip
    costs = workload_costs(w, record)
    assert costs["lm"].prefill_ms_per_token == pytest.approx(0.02)
    assert costs["lm"].step_ms == pytest.approx({1: 0.9, 4: 1.8})
    # their answers spend the recorded times outside the node (20 ms less the rest)
    outside: dict[int, list[float]] = {}
    for r in recorded:
        outside.setdefault(r.made, []).append(max(0.0, 20.0 - 0.5 - r.ms))
    assert {k: pytest.approx(v) for k, v in outside.items()} == costs["lm"].generation_outside_ms
