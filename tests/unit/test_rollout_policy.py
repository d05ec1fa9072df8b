"""The rollout's pure decisions: gates, verdicts and steps."""

from __future__ import annotations

import pytest

from edgefleet.messages import SERVICE_BUCKETS
from policies.rollout import Gate, Served, judge, parse_gates, parse_share, plan_steps


def served(latencies_s: list[float], failed: int = 0) -> Served:
    counts = [0] * (len(SERVICE_BUCKETS) + 1)
    for t in latencies_s:
        counts[
            next((i for i, b in enumerate(SERVICE_BUCKETS) if t <= b), len(SERVICE_BUCKETS))
        ] += 1
    cumulative, total = [], 0
    for c in counts:
        total += c
        cumulative.append(total)
    return Served(failed, tuple(cumulative))


def test_gates_parse_relative_absolute_and_error_rates():
    gates = parse_gates("error_rate<=0.01, p99<=1.5x,p50<=200ms,p90<=2s")
    assert gates == (
        Gate("error_rate", 0.01),
        Gate("p99", 1.5, relative=True),
        Gate("p50", 0.2),
        Gate("p90", 2.0),
    )
    assert [str(g) for g in gates] == ["error_rate<=0.01", "p99<=1.5x", "p50<=200ms", "p90<=2000ms"]


@pytest.mark.parametrize(
    "text, says",
    [
        ("latency<=2x", "METRIC<=LIMIT"),
        ("error_rate<=5", "fraction"),
        ("p99<=3", "x, ms or s"),
        ("p99>=3x", "METRIC<=LIMIT"),
    ],
)
def test_a_gate_that_is_not_one_is_a_clear_error(text, says):
    with pytest.raises(ValueError, match=says):
        parse_gates(text)


def test_a_slow_new_version_fails_its_relative_p99_gate():
    old = served([0.004] * 200)
    slow = served([0.012] * 100)
    assert judge(served([0.012] * 99), old, parse_gates("p99<=1.5x"), final=False).passed is None
    verdict = judge(slow, old, parse_gates("p99<=1.5x"), final=False)
    assert verdict.passed is False and "p99<=1.5x failed" in verdict.why
    same = served([0.0045] * 100)
    assert judge(same, old, parse_gates("p99<=1.5x"), final=False).passed is None
    assert judge(same, old, parse_gates("p99<=1.5x"), final=True).passed is True


def test_errors_fail_the_error_rate_gate_once_enough_requests_were_served():
    old = served([0.004] * 100)
    few = served([0.004] * 5, failed=3)
    assert judge(few, old, parse_gates("error_rate<=0.01"), final=False).passed is None
    verdict = judge(few, old, parse_gates("error_rate<=0.01"), final=True)
    assert verdict.passed is True and "too few requests" in verdict.why
    many = served([0.004] * 95, failed=5)
    verdict = judge(many, old, parse_gates("error_rate<=0.01"), final=False)
    assert verdict.passed is False and "0.050 > 0.010" in verdict.why


def test_a_relative_gate_with_nothing_to_compare_to_passes_on_absolute_ones():
    new = served([0.5] * 100)
    assert judge(new, Served(), parse_gates("p99<=1.5x"), final=True).passed is True
    assert judge(new, Served(), parse_gates("p99<=1.5x,p99<=100ms"), final=True).passed is False


def test_served_differences_restart_from_zero_when_counters_went_back():
    before, after = served([0.004] * 10, failed=2), served([0.004] * 30, failed=3)
    assert (after - before).requests == 21 and (after - before).failed == 1
    assert (before - after) == before  # the node restarted: its counters began again
    assert (before + after).requests == 45
    assert (Served() + after) == after and (after - Served()) == after


def test_steps_take_the_canary_first_then_a_share_at_a_time():
    nodes = [f"n{i}" for i in range(10)]
    assert plan_steps(nodes, 1, 0.25) == (
        ("n0",),
        ("n1", "n2", "n3"),
        ("n4", "n5", "n6"),
        ("n7", "n8", "n9"),
    )
    assert plan_steps(nodes, 0.1, 5) == (("n0",), tuple(nodes[1:6]), tuple(nodes[6:]))
    assert plan_steps(nodes[:2], 5, 1) == (("n0", "n1"),)
    assert plan_steps([], 1, 1) == ()


@pytest.mark.parametrize("text, got", [("2", 2), ("25%", 0.25), ("100%", 1.0)])
def test_shares_are_counts_or_percentages(text, got):
    assert parse_share(text, "--step") == got


@pytest.mark.parametrize("text", ["0", "0%", "150%", "x", "-1"])
def test_a_share_that_is_not_one_is_a_clear_error(text):
    with pytest.raises(ValueError, match="--canary"):
        parse_share(text, "--canary")


def test_a_quantile_needs_requests_above_it_and_sub_millisecond_noise_passes():
    old = served([0.0007] * 200)
    verdict = judge(served([0.0013] * 51), old, parse_gates("p99<=1.5x"), final=True)
    assert verdict.passed is True and "not judged: p99 (on 51 requests)" in verdict.why
    # 1.3 ms against 0.7 ms is 1.9x, but within the 2 ms a busy machine's scheduling moves
    assert judge(served([0.0013] * 200), old, parse_gates("p99<=1.5x"), final=True).passed
    verdict = judge(served([0.004] * 200), old, parse_gates("p99<=1.5x"), final=True)
    assert verdict.passed is False and "> 2.8 ms" in verdict.why  # bucket interpolation
