"""Scenario tests of the node's scheduling core, with a fake clock and explicit times."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.scheduler import LocalScheduler, ModelRules
from edgefleet.clock import FakeClock
from edgefleet.errors import EngineError, Evicted, Rejected, Superseded
from edgefleet.request import Request, RequestState
from policies import BatchParams, FifoOrder, PreemptionParams, PriorityOrder, QueueLimits

S = RequestState


class Harness:
    def __init__(self, *, capacity=8, max_bytes=10_000, order=None, gap=5, preempt=True, **rules):
        self.clock = FakeClock(100.0)
        self.sched = LocalScheduler(
            clock=self.clock,
            limits=QueueLimits(capacity, max_bytes),
            order=order or PriorityOrder(),
            preemption=PreemptionParams(preempt, gap),
            rules={"m": ModelRules(**rules)} if rules else None,
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
@given(ops=OPS, window=st.sampled_from([0.0, 0.01]), follow=st.booleans())
def test_every_request_ends_in_exactly_one_terminal_state(ops, window, follow):
    h = Harness(capacity=4, batching=BatchParams(window, 3), follow_dedup=follow)
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
