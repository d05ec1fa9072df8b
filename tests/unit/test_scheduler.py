"""Scenario tests of the node's scheduling core, with a fake clock and explicit times."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine import Signature
from actors.models import ModelInfo
from actors.scheduler import LocalScheduler, ModelRules, rules_for
from edgefleet.clock import FakeClock
from edgefleet.config import BatchingConfig, ModelConfig
from edgefleet.errors import EngineError, EngineTimeout, Evicted, Rejected, Superseded
from edgefleet.request import Request, RequestState
from policies import (
    BatchParams,
    ClassBound,
    FifoOrder,
    PreemptionParams,
    PriorityOrder,
    QueueLimits,
    StarvationParams,
)
from tests.fakes import fake_spec

S = RequestState


class Harness:
    def __init__(
        self,
        *,
        capacity=8,
        max_bytes=10_000,
        order=None,
        gap=5,
        preempt=True,
        starvation=None,
        **rules,
    ):
        self.clock = FakeClock(100.0)
        self.sched = LocalScheduler(
            clock=self.clock,
            limits=QueueLimits(capacity, max_bytes),
            order=order or PriorityOrder(),
            preemption=PreemptionParams(preempt, gap),
            rules={"m": ModelRules(**rules)} if rules else None,
            starvation=starvation,
        )
        self.settled: dict[str, list] = {}

    def req(
        self, rid, priority=3, *, model="m", group="g", nbytes=1, key=None, timeout=None, gen=False
    ):
        now = self.clock.now()
        return Request(
            pausable=gen,
            isolate=gen,
            id=rid,
            model=model,
            inputs={},
            priority=priority,
            arrival=now,
            deadline=None if timeout is None else now + timeout,
            key=key,
            nbytes=nbytes,
            group=group,
        )

    def record(self, outcomes):
        for o in outcomes:
            self.settled.setdefault(o.request.id, []).append(o)
        return outcomes

    def admit(self, *args, **kwargs):
        adm = self.sched.admit(self.req(*args, **kwargs))
        self.record(adm.settled)
        return adm

    def step(self):
        step = self.sched.next_work()
        self.record(step.settled)
        return step

    def run_next(self, *, error=None, aborted=False, paused=False, cost=0.001):
        step = self.step()
        assert step.plan is not None, "expected work to run"
        self.clock.advance(cost)
        self.record(self.sched.finish(step.plan, error=error, aborted=aborted, paused=paused))
        return [r.id for r in step.plan.requests]

    def state(self, rid):
        return self.settled[rid][-1].state


def test_highest_priority_first_fifo_within():
    h = Harness()
    for rid, p in [("bg1", 3), ("fg1", 10), ("off", 0), ("bg2", 3), ("fg2", 10), ("in", 7)]:
        assert h.admit(rid, p).accepted
    order = [h.run_next()[0] for _ in range(6)]
    assert order == ["fg1", "fg2", "in", "bg1", "bg2", "off"]
    assert all(h.state(r) is S.COMPLETED for r in order)
    assert h.sched.idle


def test_fifo_order_ignores_priority():
    h = Harness(order=FifoOrder())
    for rid, p in [("bg", 3), ("fg", 10), ("off", 0)]:
        h.admit(rid, p)
    assert [h.run_next()[0] for _ in range(3)] == ["bg", "fg", "off"]


@pytest.mark.parametrize(("order", "served"), [("priority", ["fg", "bg"]), ("fifo", ["bg", "fg"])])
def test_the_scheduler_of_a_node_spec_has_its_capacity_and_order(order, served):
    h = Harness()
    h.sched = LocalScheduler.for_node(fake_spec(capacity=2, order=order), h.clock)
    assert h.admit("bg", 3).accepted and h.admit("fg", 10).accepted
    assert not h.admit("off", 0).accepted  # full, and the newest is the lowest
    assert [h.run_next()[0] for _ in range(2)] == served


def test_expired_requests_fail_without_engine():
    h = Harness()
    h.admit("late", 10, timeout=0.005)
    h.admit("ok", 3)
    h.clock.advance(0.010)
    step = h.step()
    assert [r.id for r in step.plan.requests] == ["ok"]
    assert h.state("late") is S.EXPIRED
    assert "engine was not used" in str(h.settled["late"][0].error)


def test_deadline_in_past_on_arrival_and_timer_expiry():
    h = Harness()
    adm = h.admit("dead", 10, timeout=0.0)
    assert not adm.accepted and h.state("dead") is S.EXPIRED
    h.admit("a", 3, timeout=0.5)
    assert h.sched.expire("a") is None  # not yet due
    h.clock.advance(0.5)
    assert h.record([h.sched.expire("a")])[0].state is S.EXPIRED
    assert h.sched.queued == 0


def test_wake_at_is_the_earliest_deadline_or_window():
    h = Harness(batching=BatchParams(window_s=0.050, max_rows=4))
    h.admit("a", 3, timeout=0.020)
    step = h.step()
    assert step.plan is None and step.wake_at == pytest.approx(100.020)


def test_full_queue_evicts_lowest_newest_or_rejects():
    h = Harness(capacity=3)
    h.admit("bg-old", 3)
    h.admit("off", 0)
    h.admit("bg-new", 3)
    adm = h.admit("fg", 10)
    assert adm.accepted and h.state("off") is S.EVICTED
    assert isinstance(h.settled["off"][0].error, Evicted)
    adm = h.admit("in", 7)  # evicts the newest of the lowest remaining lane
    assert adm.accepted and h.state("bg-new") is S.EVICTED
    adm = h.admit("bg-late", 3)  # outranks nobody: rejected with a retry estimate
    assert not adm.accepted and h.state("bg-late") is S.REJECTED
    err = h.settled["bg-late"][0].error
    assert isinstance(err, Rejected) and err.retry_after_s > 0
    assert h.sched.queued == 3


def test_byte_limit_counts_queued_inputs():
    h = Harness(capacity=10, max_bytes=100)
    h.admit("a", 3, nbytes=60)
    assert not h.admit("b", 3, nbytes=50).accepted
    assert h.admit("c", 10, nbytes=50).accepted and h.state("a") is S.EVICTED
    assert h.sched.queued_bytes == 50


def test_retry_after_grows_with_work_ahead():
    h = Harness(capacity=2)
    h.admit("a", 10)
    h.run_next(cost=0.020)  # teaches the scheduler a 20 ms row cost
    h.admit("b", 10)
    h.admit("c", 10)
    h.admit("d", 10)
    err = h.settled["d"][0].error
    assert err.retry_after_s == pytest.approx(0.040)


@pytest.mark.parametrize("follow", [False, True])
def test_dedup_newer_replaces_queued_older(follow):
    h = Harness(follow_dedup=follow)
    h.admit("v1", 3, key="frame")
    adm = h.admit("v2", 3, key="frame")
    assert adm.accepted
    o = h.settled["v1"][0]
    assert o.state is S.SUPERSEDED and isinstance(o.error, Superseded)
    assert o.follow == ("v2" if follow else None)
    assert h.run_next() == ["v2"]
    assert h.sched.idle


def test_dedup_keeps_running_request_and_is_per_model():
    h = Harness()
    h.admit("run", 3, key="k")
    step = h.step()
    h.admit("next", 3, key="k")  # the old one is running: both stay
    h.admit("other", 3, key="k", model="n")
    assert "run" not in h.settled and "next" not in h.settled
    h.record(h.sched.finish(step.plan))
    assert h.state("run") is S.COMPLETED
    assert h.sched.queued == 2


def test_dedup_refused_newer_leaves_older_queued():
    h = Harness(capacity=10, max_bytes=100)
    h.admit("old", 3, key="k", nbytes=60)
    h.admit("other", 3, nbytes=40)
    assert not h.admit("new", 3, key="k", nbytes=70).accepted
    assert "old" not in h.settled and h.sched.queued == 2


def test_window_opens_at_first_arrival_and_flushes_at_window():
    h = Harness(batching=BatchParams(window_s=0.010, max_rows=8))
    h.admit("a", 3)
    assert h.step().wake_at == pytest.approx(100.010)
    h.clock.advance(0.006)
    h.admit("b", 3)
    assert h.step().wake_at == pytest.approx(100.010)  # not reset by later arrivals
    h.clock.advance(0.004)
    assert h.run_next() == ["a", "b"]


def test_window_flushes_early_at_max_batch_size():
    h = Harness(batching=BatchParams(window_s=10.0, max_rows=3))
    for rid in "abcd":
        h.admit(rid, 3)
    assert h.run_next() == ["a", "b", "c"]


def test_window_zero_never_waits_but_takes_backlog():
    h = Harness(batching=BatchParams(window_s=0.0, max_rows=4))
    h.admit("a", 3)
    assert h.run_next() == ["a"]
    for rid in "bcdef":
        h.admit(rid, 3)
    assert h.run_next() == ["b", "c", "d", "e"]


def test_only_same_shapes_share_a_batch():
    h = Harness(batching=BatchParams(window_s=0.0, max_rows=8))
    h.admit("a", 3, group="32x32")
    h.admit("b", 3, group="64x64")
    h.admit("c", 3, group="32x32")
    h.admit("x", 3, model="n", group="32x32")
    assert h.run_next() == ["a", "c"]
    assert h.run_next() == ["b"]
    assert h.run_next() == ["x"]


def test_highest_priority_leads_and_lower_fill_free_slots():
    h = Harness(batching=BatchParams(window_s=0.0, max_rows=3))
    h.admit("bg1", 3)
    h.admit("bg2", 3)
    h.admit("off", 0)
    h.admit("fg", 10)
    assert h.run_next() == ["fg", "bg1", "bg2"]


def test_failing_batch_is_split_so_only_the_bad_request_fails():
    h = Harness(batching=BatchParams(window_s=0.0, max_rows=4))
    for rid in "abc":
        h.admit(rid, 3)
    assert h.run_next(error=EngineError("boom")) == ["a", "b", "c"]
    assert not h.settled  # nobody failed yet: the batch is split
    assert h.run_next() == ["a"]
    assert h.run_next(error=EngineError("bad b")) == ["b"]
    assert h.run_next() == ["c"]
    assert [h.state(r) for r in "abc"] == [S.COMPLETED, S.FAILED, S.COMPLETED]
    assert str(h.settled["b"][0].error) == "bad b"


def test_a_batch_that_ran_past_its_time_limit_fails_whole_and_evict_all_empties_the_queue():
    h = Harness(batching=BatchParams(window_s=0.0, max_rows=2))
    for rid in "abc":
        h.admit(rid, 3)
    assert h.run_next(error=EngineTimeout("too long")) == ["a", "b"]  # not split: rerun
    assert [h.state(r) for r in "ab"] == [S.FAILED, S.FAILED]  # would take as long again
    h.record(h.sched.evict_all("stuck"))
    assert h.state("c") is S.EVICTED and isinstance(h.settled["c"][0].error, Evicted)
    assert h.sched.idle


@pytest.mark.parametrize(
    ("running", "arrival", "gap", "enabled", "preempt"),
    [
        (3, 10, 5, True, True),
        (3, 7, 5, True, False),
        (0, 7, 5, True, True),
        (3, 10, 5, False, False),
    ],
)
def test_preemption_gap_rule(running, arrival, gap, enabled, preempt):
    h = Harness(gap=gap, preempt=enabled)
    h.admit("low", running)
    h.step()
    assert h.admit("high", arrival).preempt is preempt


def test_preempted_run_is_requeued_at_head_of_its_priority():
    h = Harness()
    h.admit("bg1", 3)
    h.admit("bg2", 3)
    step = h.step()
    assert h.admit("fg", 10).preempt
    assert not h.admit("fg2", 10).preempt  # one abort per running call
    h.record(h.sched.finish(step.plan, aborted=True))
    assert "bg1" not in h.settled
    assert [h.run_next()[0] for _ in range(4)] == ["fg", "fg2", "bg1", "bg2"]
    assert h.settled["bg1"][0].request.preemptions == 1


def test_paused_generations_resume_in_priority_order_before_queued_peers():
    h = Harness()
    h.admit("off", 0, gen=True)
    step = h.step()
    assert h.admit("bg", 5, gen=True).preempt  # gap 5: pause the offline generation
    h.record(h.sched.finish(step.plan, paused=True))
    assert h.sched.paused_by_priority() == {0: 1}
    step = h.step()
    assert [r.id for r in step.plan.requests] == ["bg"]
    assert h.admit("fg", 10).preempt
    h.record(h.sched.finish(step.plan, paused=True))
    h.admit("bg2", 5, gen=True)  # queued behind the paused one of its own priority
    assert not h.sched.idle and h.sched.paused_by_priority() == {0: 1, 5: 1}
    order = [h.run_next()[0] for _ in range(4)]
    assert order == ["fg", "bg", "bg2", "off"]
    assert all(h.state(r) is S.COMPLETED for r in order)
    assert h.settled["off"][0].request.preemptions == 1
    assert h.sched.idle


def test_paused_generation_is_never_evicted_and_cancel_or_stop_settles_it():
    h = Harness(capacity=1)
    h.admit("gen", 0, gen=True)
    step = h.step()
    h.admit("fg", 10)
    h.record(h.sched.finish(step.plan, paused=True))
    assert not h.admit("fg2", 10).accepted  # the queue holds one; the paused one is not a victim
    assert h.sched.paused_by_priority() == {0: 1}
    o, abort = h.sched.cancel("gen")
    assert o.state is S.CANCELLED and not abort
    h.admit("gen2", 0, gen=True)  # fg is still queued: gen2 is refused, nothing paused now
    assert h.sched.paused == ()
    step = h.step()
    h.admit("gen3", 0, gen=True)
    h.record(h.sched.finish(step.plan))
    step = h.step()
    h.record(h.sched.finish(step.plan, paused=True))
    assert [o.request.id for o in h.sched.cancel_all("stopping")] == ["gen3"]
    assert h.sched.idle


def test_cancel_of_a_running_generation_ends_it_cancelled_not_paused():
    h = Harness()
    h.admit("gen", 3, gen=True)
    step = h.step()
    assert h.sched.cancel("gen") == (None, True)
    h.record(h.sched.finish(step.plan, paused=True))
    assert h.state("gen") is S.CANCELLED and h.sched.idle


def test_drain_refuses_new_and_finishes_queued():
    h = Harness()
    h.admit("a", 3)
    h.sched.draining = True
    adm = h.admit("b", 10)
    assert not adm.accepted and "draining" in str(h.settled["b"][0].error)
    assert h.run_next() == ["a"]
    assert h.sched.idle


def test_cancel_queued_and_running():
    h = Harness(batching=BatchParams(window_s=0.0, max_rows=2))
    h.admit("a", 3)
    h.admit("b", 3)
    h.admit("c", 3)
    o, abort = h.sched.cancel("c")
    assert o.state is S.CANCELLED and not abort
    step = h.step()
    assert h.sched.cancel("a") == (None, False)  # b still wants its result
    assert h.sched.cancel("b") == (None, True)  # now nobody does: abort the call
    h.record(h.sched.finish(step.plan, aborted=True))
    assert h.state("a") is S.CANCELLED and h.state("b") is S.CANCELLED
    assert h.sched.cancel("nope") == (None, False)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("admit"), st.integers(0, 10), st.sampled_from([None, "k1", "k2"])),
        st.tuples(st.just("run"), st.sampled_from(["ok", "error", "abort", "pause"]), st.none()),
        st.tuples(st.just("cancel"), st.integers(0, 40), st.none()),
        st.tuples(st.just("advance"), st.integers(1, 30), st.none()),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=OPS,
    window=st.sampled_from([0.0, 0.01]),
    follow=st.booleans(),
    adaptive=st.booleans(),
    starve=st.booleans(),
)
def test_every_request_ends_in_exactly_one_terminal_state(ops, window, follow, adaptive, starve):
    h = Harness(
        capacity=4,
        batching=BatchParams(
            window, 3, lower_cost_bound=0.1 if adaptive else None, adaptive=adaptive
        ),
        follow_dedup=follow,
        starvation=starving(min_share=0.2, max_wait_s=0.02) if starve else None,
    )
    ids: list[str] = []
    running = None
    for op, a, b in ops:
        if op == "admit":
            rid = f"r{len(ids)}"
            ids.append(rid)
            h.admit(rid, a, key=b, timeout=0.02 if a % 3 == 0 else None, gen=a % 2 == 1)
        elif op == "run":
            if running is None:
                running = h.step().plan
            if running is not None:
                h.record(
                    h.sched.finish(
                        running,
                        error=EngineError("x") if a == "error" else None,
                        aborted=a == "abort" and not running.requests[0].pausable,
                        paused=a in ("abort", "pause") and running.requests[0].pausable,
                    )
                )
                running = None
        elif op == "cancel" and ids:
            o, _ = h.sched.cancel(ids[a % len(ids)])
            h.record([o] if o else [])
        else:
            h.clock.advance(a / 1000)
    if running is not None:
        h.record(h.sched.finish(running))
    for _ in range(500):  # drain: everything left must finish
        h.clock.advance(0.05)
        step = h.step()
        if step.plan is None and h.sched.idle:
            break
        if step.plan is not None:
            h.record(h.sched.finish(step.plan))
    assert h.sched.idle
    for rid in ids:
        outcomes = h.settled.get(rid, [])
        assert len(outcomes) == 1, (rid, outcomes)
        assert outcomes[0].state.terminal
        assert outcomes[0].request.state is outcomes[0].state


# ------------------------------------------------------- batch composition by priority

LINEAR_COSTS = ((1, 0.010), (2, 0.0195), (4, 0.038))  # batch 4 costs 3.8x batch 1


def test_model_rules_carry_the_cost_table_the_bound_and_the_adaptive_window(tmp_path):
    config = ModelConfig(
        path=tmp_path / "m.onnx",
        batching=BatchingConfig(window_ms=5, max_batch_size=8),
        dedup="follow",
    )
    info = ModelInfo("m", config, Signature((), ()), 1.0, {4: 0.03, 1: 0.01}, batch_limit=4)
    assert rules_for(info.config, info.batch_limit, info.costs_s) == ModelRules(
        BatchParams(0.005, 4, ((1, 0.01), (4, 0.03)), lower_cost_bound=0.1, adaptive=True),
        follow_dedup=True,
    )


def test_foreground_call_takes_no_background_rows_that_would_lengthen_it():
    params = BatchParams(0.0, 4, LINEAR_COSTS, lower_cost_bound=0.1)
    h = Harness(batching=params)
    for rid in ("bg1", "bg2", "bg3"):
        h.admit(rid, 3)
    h.admit("fg", 10)
    assert h.run_next() == ["fg"]
    assert h.run_next() == ["bg1", "bg2", "bg3"]


def test_background_rows_join_a_foreground_call_where_rows_are_cheap():
    params = BatchParams(0.0, 4, ((1, 0.010), (2, 0.0105), (4, 0.012)), lower_cost_bound=0.1)
    h = Harness(batching=params)
    for rid in ("bg1", "bg2", "bg3"):
        h.admit(rid, 3)
    h.admit("fg", 10)
    assert h.run_next() == ["fg", "bg1"]  # a second row would add 12.5 %


def test_fifo_order_has_no_lower_rows_to_bound():
    params = BatchParams(0.0, 4, LINEAR_COSTS, lower_cost_bound=0.1)
    h = Harness(order=FifoOrder(), batching=params)
    h.admit("fg", 10)
    h.admit("bg", 3)
    assert h.run_next() == ["fg", "bg"]


# --------------------------------------------------------------------- adaptive window

ADAPTIVE = BatchParams(window_s=0.010, max_rows=4, adaptive=True)


def test_lone_request_does_not_wait_for_companions_that_will_not_come():
    h = Harness(batching=ADAPTIVE)
    h.admit("a", 3)  # nothing known of arrivals yet
    assert h.run_next() == ["a"]
    h.clock.advance(0.100)
    h.admit("b", 3)  # 100 ms since the last: the next is not due within the window
    step = h.step()
    assert [r.id for r in step.plan.requests] == ["b"] and step.plan.started == 100.101


def test_window_waits_while_arrivals_are_frequent_and_fills_the_batch():
    h = Harness(batching=ADAPTIVE)
    h.admit("a", 3)
    assert h.run_next(cost=0.001) == ["a"]
    h.clock.set(100.002)
    h.admit("b", 3)  # one arrival per 2 ms: the next is due well within the window
    assert h.step().wake_at == pytest.approx(100.006)  # when it would be a gap late
    for t, rid in ((100.004, "c"), (100.006, "d")):
        h.clock.set(t)
        h.admit(rid, 3)
        assert h.step().wake_at == pytest.approx(100.012)  # with companions: the window
    h.clock.set(100.008)
    h.admit("e", 3)
    assert h.run_next() == ["b", "c", "d", "e"]


def test_window_closes_early_when_arrivals_stop():
    h = Harness(batching=ADAPTIVE)
    h.admit("a", 3)
    assert h.run_next(cost=0.001) == ["a"]
    h.clock.set(100.002)
    h.admit("b", 3)
    step = h.step()
    assert step.plan is None and step.wake_at == pytest.approx(100.006)
    h.clock.set(100.005)  # the next is late, by less than a gap: keep waiting
    assert h.step().plan is None
    h.clock.set(100.006)  # a whole gap late: the stream has stopped
    step = h.step()
    assert [r.id for r in step.plan.requests] == ["b"]  # the window would close at 100.012


def test_foreground_does_not_wait_for_a_background_flood_it_cannot_batch_with():
    params = BatchParams(0.010, 4, LINEAR_COSTS, lower_cost_bound=0.1, adaptive=True)
    h = Harness(capacity=16, batching=params)
    for i in range(8):  # background arriving every ms, queued behind a running call
        h.admit(f"bg{i}", 3)
        h.clock.advance(0.001)
    assert h.run_next(cost=0.004) == ["bg0", "bg1", "bg2", "bg3"]
    h.admit("fg", 10)
    assert h.run_next() == ["fg"]  # at once, alone
    assert h.run_next() == ["bg4", "bg5", "bg6", "bg7"]


def test_background_batches_shrink_while_urgent_arrivals_would_abort_them():
    # Forced batching of a near-linear model: a batch of 4 takes 3.8x one row. With a
    # foreground request every 20 ms (each aborts the running background call, losing
    # its time), a 38 ms batch of 4 would rarely end: background runs one row a call.
    params = BatchParams(0.0, 4, LINEAR_COSTS, lower_cost_bound=0.1)
    h = Harness(capacity=32, batching=params)
    for i in range(8):
        h.admit(f"bg{i}", 3)
    assert h.run_next() == ["bg0", "bg1", "bg2", "bg3"]  # no urgent stream known
    for i in range(3):
        h.admit(f"fg{i}", 10)
        assert h.run_next(cost=0.010) == [f"fg{i}"]
        h.clock.advance(0.010)
    assert h.run_next() == ["bg4"]
    h.clock.advance(0.100)  # the foreground stream stopped: full batches again
    assert h.run_next() == ["bg5", "bg6", "bg7"]


# ---------------------------------------------------------------- starvation bounds


def starving(**bounds):
    return StarvationParams(
        {0: ClassBound(**bounds)}, protected=frozenset({10}), classes=(0, 3, 7, 10)
    )


def test_offline_below_its_share_gets_the_next_call():
    h = Harness(capacity=16, starvation=starving(min_share=0.25))
    for i in range(6):
        h.admit(f"bg{i}", 3)
    h.admit("off0", 0)
    h.admit("off1", 0)
    order = [h.run_next(cost=0.010)[0] for _ in range(8)]
    # shares of offline before each call: 0, 1, 1/2, 1/3, 1/4 (not below), 1/5, ...
    assert order == ["off0", "bg0", "bg1", "bg2", "bg3", "off1", "bg4", "bg5"]


def test_shares_are_of_the_last_two_seconds():
    h = Harness(capacity=16, starvation=starving(min_share=0.25))
    h.admit("off0", 0)
    assert h.run_next(cost=1.0) == ["off0"]
    h.admit("bg0", 3)
    h.admit("bg1", 3)
    h.admit("off1", 0)
    assert h.run_next(cost=1.0) == ["bg0"]  # offline had all of the engine
    h.clock.advance(1.01)  # the offline call ended over 2 s ago: out of the window
    assert h.run_next() == ["off1"]
    assert h.run_next() == ["bg1"]


def test_overdue_request_is_promoted_but_never_ahead_of_protected_work():
    h = Harness(capacity=16, starvation=starving(max_wait_s=0.100))
    h.admit("off", 0)
    for i in range(7):
        h.admit(f"bg{i}", 3)
    assert [h.run_next(cost=0.010)[0] for _ in range(5)] == [f"bg{i}" for i in range(5)]
    h.clock.advance(0.040)
    h.admit("fg", 10)  # off's 100 ms are two calls away, but fg is protected
    assert [h.run_next(cost=0.010)[0] for _ in range(3)] == ["fg", "off", "bg5"]
    assert h.settled["off"][0].request.started == pytest.approx(100.100)


def test_max_wait_bounds_the_wait_with_calls_of_the_observed_cost():
    h = Harness(capacity=16, starvation=starving(max_wait_s=0.090))
    h.admit("off", 0)
    for i in range(7):
        h.admit(f"bg{i}", 3)
    order = [h.run_next(cost=0.020)[0] for _ in range(4)]
    # after two 20 ms calls, three more (the promotion may come a call late, then a
    # protected call may preempt it) would pass 90 ms: offline goes now
    assert order == ["bg0", "bg1", "off", "bg2"]
    assert h.settled["off"][0].request.started - 100.0 == pytest.approx(0.040)


def test_promoted_leader_does_not_wait_for_a_window_and_takes_higher_rows():
    params = BatchParams(1.0, 4, LINEAR_COSTS, lower_cost_bound=0.1)
    h = Harness(capacity=16, starvation=starving(max_wait_s=0.050), batching=params)
    h.admit("off", 0)
    h.clock.advance(0.060)
    h.admit("bg0", 3)
    h.admit("bg1", 3)
    assert h.run_next() == ["off", "bg0", "bg1"]


def test_promoted_work_is_preempted_by_foreground_as_before():
    h = Harness(capacity=16, starvation=starving(min_share=0.5))
    h.admit("bg", 3)
    h.admit("off", 0)
    step = h.step()
    assert [r.id for r in step.plan.requests] == ["off"]
    assert not h.admit("bg2", 3).preempt
    assert h.admit("fg", 10).preempt


def test_promoted_work_goes_ahead_of_a_paused_unprotected_generation():
    h = Harness(capacity=16, starvation=starving(max_wait_s=0.050))
    h.admit("gen", 3, gen=True)
    step = h.step()
    h.admit("off", 0)
    assert h.admit("fg", 10).preempt
    h.clock.advance(0.060)
    h.record(h.sched.finish(step.plan, paused=True))
    h.admit("bg", 3)
    assert [h.run_next()[0] for _ in range(4)] == ["fg", "off", "gen", "bg"]


def test_row_cost_averages_the_first_calls_then_weighs_each_call_lightly():
    # A slow first call (a cold session, a busy machine) counts as one call of ten, not
    # as the seed that later calls only wear down by 5 % each (28.9 ms after these ten).
    h = Harness(capacity=32)
    for i in range(30):
        h.admit(f"r{i}", 3)
    h.run_next(cost=0.040)
    for _ in range(9):
        h.run_next(cost=0.010)
    assert h.sched.row_cost("m") == pytest.approx(0.013)
    for _ in range(10):  # 20 calls: the mean of all, 11.5 ms
        h.run_next(cost=0.010)
    assert h.sched.row_cost("m") == pytest.approx(0.0115)
    h.run_next(cost=0.030)  # from here on one call weighs ROW_COST_WEIGHT
    assert h.sched.row_cost("m") == pytest.approx(0.95 * 0.0115 + 0.05 * 0.030)
