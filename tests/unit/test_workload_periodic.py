"""The periodic arrival process: streams at a fixed interval (one per class, or one per
dedup key), seeded phases and jitter, its validation, and its place in a seeded run."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

import pytest

from edgefleet.errors import ConfigError
from sim.workload import Arrival, Workload, load_workload, parse_workload


def periodic(periodic: dict[str, object] | None = None, **overrides: object) -> Workload:
    arrivals: dict[str, object] = {"process": "periodic", "rate": 10}
    if periodic is not None:
        arrivals["periodic"] = periodic
    data: dict[str, object] = {
        "duration_s": 10,
        "arrivals": arrivals,
        "mix": [{"model": "cam", "priority": "inline"}],
    }
    data.update(overrides)
    return parse_workload(data)


def arrivals(w: Workload, seed: int = 1, nodes: int = 1, **kw: object) -> list[Arrival]:
    return list(w.arrivals(random.Random(seed), nodes=nodes, **kw))  # type: ignore[arg-type]


def by_key(got: list[Arrival]) -> dict[str | None, list[float]]:
    out: dict[str | None, list[float]] = defaultdict(list)
    for a in got:
        out[a.key].append(a.at)
    return dict(out)


def gaps(times: list[float]) -> list[float]:
    return [y - x for x, y in zip(times, times[1:], strict=False)]


def test_one_stream_arrives_at_a_fixed_interval_from_a_seeded_phase():
    got = arrivals(periodic())
    assert len(got) in (99, 100)  # 10/s for 10 s, from a phase in the first 0.1 s
    assert 0 <= got[0].at < 0.1
    assert all(g == pytest.approx(0.1, abs=1e-9) for g in gaps([a.at for a in got]))
    assert all(a.at < 10 and a.model == "cam" and a.priority == 7 for a in got)
    assert all(a.key is None and a.session is None for a in got)
    # another seed, another phase; the same seed, the same arrivals
    assert arrivals(periodic(), seed=2)[0].at != got[0].at
    assert arrivals(periodic()) == got


def test_each_dedup_key_is_a_stream_with_its_share_of_the_class_rate():
    w = periodic(
        mix=[{"model": "cam", "priority": "inline", "keys": 4, "deadline_ms": 250, "rows": 2}],
        arrivals={"process": "periodic", "rate_per_node": 20},
    )
    got = arrivals(w, nodes=2)  # 40/s for the fleet: 4 cameras at 10/s each
    streams = by_key(got)
    assert sorted(streams) == ["k0", "k1", "k2", "k3"]
    for times in streams.values():
        assert 0 <= times[0] < 0.1
        assert all(g == pytest.approx(0.1, abs=1e-9) for g in gaps(times))
    assert len({times[0] for times in streams.values()}) == 4  # each its own phase
    assert all(x.at <= y.at for x, y in zip(got, got[1:], strict=False))
    assert all(a.deadline_s == 0.25 and a.rows == 2 for a in got)
    assert len(got) / 10 == pytest.approx(w.mean_rate(2), rel=0.02)


def test_aligned_streams_all_start_at_zero():
    w = periodic({"phase": "aligned"}, mix=[{"model": "cam", "priority": 1, "keys": 3}])
    got = arrivals(w)
    assert [(a.at, a.key) for a in got[:3]] == [(0.0, "k0"), (0.0, "k1"), (0.0, "k2")]
    for times in by_key(got).values():
        assert times == pytest.approx([n * 0.3 for n in range(len(times))])


def test_jitter_delays_each_arrival_within_its_share_of_the_interval():
    got = arrivals(periodic({"jitter": 0.2, "phase": "aligned"}, duration_s=100))
    late = [a.at - n * 0.1 for n, a in enumerate(got)]  # each arrival's slot: n x 0.1 s
    assert all(0 <= x < 0.02 for x in late)
    assert max(late) > 0.018 and min(late) < 0.002  # drawn uniformly, not a constant
    assert sum(late) / len(late) == pytest.approx(0.01, rel=0.1)
    assert all(0.08 < g < 0.12 for g in gaps([a.at for a in got]))


def test_the_rate_is_split_between_classes_by_weight():
    w = periodic(
        arrivals={"process": "periodic", "rate": 40},
        mix=[
            {"model": "a", "priority": 10, "weight": 1},
            {"model": "b", "priority": 0, "weight": 3},
            {"model": "c", "priority": 0, "weight": 0},  # no stream
        ],
    )
    got = arrivals(w)
    a = [x.at for x in got if x.model == "a"]
    b = [x.at for x in got if x.model == "b"]
    assert len(a) + len(b) == len(got)
    assert all(g == pytest.approx(0.1) for g in gaps(a))
    assert all(g == pytest.approx(1 / 30) for g in gaps(b))
    assert w.mean_rate(1) == 40


def test_generations_draw_their_sessions():
    w = periodic(
        mix=[
            {
                "model": "lm",
                "priority": "background",
                "sessions": 5,
                "generate": {"prompt_tokens": 32, "max_new_tokens": 16},
            }
        ]
    )
    got = arrivals(w)
    assert {a.session for a in got} == {f"s{i}" for i in range(5)}
    assert all(a.prompt_tokens == 32 and a.max_new_tokens == 16 for a in got)


def test_a_shorter_run_gets_a_prefix_of_a_longer_one():
    w = periodic(
        {"jitter": 0.3},
        arrivals={"process": "periodic", "rate": 100},
        mix=[
            {"model": "cam", "priority": 7, "keys": 7},
            {"model": "clf", "priority": 10, "weight": 0.5},
        ],
    )
    full = arrivals(w, seed=5)
    assert arrivals(w, seed=5, requests=77) == full[:77]
    assert arrivals(w, seed=5, requests=0) == []
    shorter = parse_workload({**w.model_dump(by_alias=True), "duration_s": 2.5})
    assert arrivals(shorter, seed=5) == [a for a in full if a.at < 2.5]
    assert arrivals(w, seed=6) != full


def test_arrivals_use_the_rng_once_when_called():
    w = periodic({"jitter": 0.1})
    rng = random.Random(3)
    lazy = w.arrivals(rng, nodes=1)
    rng.random()  # later use of the same rng does not change the arrivals
    assert list(lazy) == arrivals(w, seed=3)


def test_requests_alone_end_a_periodic_run():
    w = periodic(duration_s=None, requests=1000)
    got = arrivals(w)
    assert len(got) == 1000
    assert got[-1].at == pytest.approx(got[0].at + 99.9)


BROKEN = [
    (  # jitter of a whole interval or more
        "duration_s: 5\narrivals:\n  process: periodic\n  rate: 5\n  periodic:\n"
        "    jitter: 1\nmix: [{model: m, priority: 1}]\n",
        r"arrivals\.periodic\.jitter \(line 6\): Input should be less than 1",
    ),
    (
        "duration_s: 5\narrivals:\n  process: periodic\n  rate: 5\n  periodic: {jitter: -0.1}\n"
        "mix: [{model: m, priority: 1}]\n",
        r"arrivals\.periodic\.jitter \(line 5\): Input should be greater than or equal to 0",
    ),
    (
        "duration_s: 5\narrivals:\n  process: periodic\n  rate: 5\n  periodic: {phase: zero}\n"
        "mix: [{model: m, priority: 1}]\n",
        r"arrivals\.periodic\.phase \(line 5\): Input should be 'random' or 'aligned'",
    ),
    (
        "duration_s: 5\narrivals:\n  process: periodic\n  rate: 5\n  periodic: {every_ms: 5}\n"
        "mix: [{model: m, priority: 1}]\n",
        r"arrivals\.periodic\.every_ms \(line 5\): unknown key",
    ),
    (  # periodic settings on another process
        "duration_s: 5\narrivals:\n  rate: 5\n  periodic: {jitter: 0.1}\n"
        "mix: [{model: m, priority: 1}]\n",
        r"arrivals\.periodic \(line 4\): only used with process: periodic",
    ),
    (  # no rate
        "duration_s: 5\narrivals: {process: periodic}\nmix: [{model: m, priority: 1}]\n",
        r"arrivals \(line 2\): set rate",
    ),
]


@pytest.mark.parametrize(("text", "message"), BROKEN)
def test_broken_settings_name_the_path_and_line(tmp_path: Path, text: str, message: str):
    path = tmp_path / "workload.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load_workload(path)
    assert str(info.value).startswith(f"invalid workload {path}:")


def test_periodic_without_its_settings_is_exact_with_random_phases():
    w = periodic()
    assert w.arrival_process is not None and w.arrival_process.periodic is None
    got = arrivals(periodic({"jitter": 0, "phase": "random"}))
    assert arrivals(w) == got
