"""The engine thread's back-to-back calls (``EngineThread.chain``) and the loop's waker,
with fake engines and no Ray."""

from __future__ import annotations

import asyncio
import threading

import pytest

import actors.executor as executor
from actors.engine import RunAborted
from actors.executor import Call, EngineThread, Outputs, Waker
from actors.models import ModelManager
from actors.scheduler import Plan
from edgefleet.clock import MonotonicClock
from edgefleet.errors import EngineError
from edgefleet.request import Request
from tests.fakes import FakeLoader, fake_spec, x


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def engine_thread(**engines) -> tuple[EngineThread, FakeLoader]:
    """Models ``a`` (resident) and ``b`` (not: the budget holds one of them)."""
    spec = fake_spec({"a": {"memory_mb": 60}, "b": {"memory_mb": 60}}, budget_mb=100)
    loader = FakeLoader(**engines)
    models = ModelManager(spec.models, spec.memory_budget_mb, loader)
    models.probe_all()
    assert [m for m in ("a", "b") if models.resident(m)] == ["a"]
    return EngineThread("t", models, MonotonicClock(), lambda model, s: None), loader


def call(model: str, value: float) -> Call:
    r = Request(id=f"{model}{value}", model=model, inputs=x(value), priority=3, arrival=0.0)
    return Call(Plan(model, (r,), 3, 0.0))


def test_a_chain_runs_each_call_follow_hands_it_on_the_engine_thread():
    async def main() -> None:
        engines, _ = engine_thread()
        calls = [call("a", v) for v in (1.0, 2.0, 3.0)]
        seen: list[tuple[Call, float, str]] = []

        def follow(done: Call, result: Outputs | Exception, seconds: float) -> Call | None:
            assert not isinstance(result, Exception)
            seen.append((done, float(result[0]["y"][0, 0]), threading.current_thread().name))
            i = calls.index(done)
            return calls[i + 1] if i + 1 < len(calls) else None

        assert await engines.chain(calls[0], follow) is None
        assert [(c, y) for c, y, _ in seen] == [(c, 2.0 * (i + 1)) for i, c in enumerate(calls)]
        assert len({t for *_, t in seen}) == 1 and seen[0][2] != threading.current_thread().name
        await engines.close(10.0)

    run(main())


def test_a_chain_returns_a_call_whose_model_is_not_resident_without_running_it():
    async def main() -> None:
        engines, loader = engine_thread()
        first, other = call("a", 1.0), call("b", 1.0)
        returned = await engines.chain(first, lambda done, result, s: other)
        assert returned is other
        assert loader.loads == ["a", "b"]  # the probe only: the chain loads nothing
        await engines.close(10.0)

    run(main())


def test_a_chain_hands_failures_and_aborts_to_follow_and_a_stopped_call_never_runs():
    async def main() -> None:
        engines, loader = engine_thread()
        bad, stopped, good = call("a", -1.0), call("a", 5.0), call("a", 2.0)
        stopped.stop.set()  # aborted before it started
        results: list[object] = []
        order = {bad: stopped, stopped: good, good: None}

        def follow(done: Call, result: Outputs | Exception, seconds: float) -> Call | None:
            results.append(result)
            return order[done]

        calls_before = len(loader.engines["a"].calls)
        assert await engines.chain(bad, follow) is None
        assert isinstance(results[0], EngineError) and isinstance(results[1], RunAborted)
        assert not isinstance(results[2], Exception)
        assert len(loader.engines["a"].calls) - calls_before == 2  # bad ran, stopped did not
        await engines.close(10.0)

    run(main())


@pytest.mark.parametrize("gil_holding", [True, False], ids=["libc write", "call_soon_threadsafe"])
def test_the_waker_runs_its_callback_on_the_loop_from_another_thread(monkeypatch, gil_holding):
    if not gil_holding:
        monkeypatch.setattr(executor, "_WRITE", None)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ran: list[str] = []
        woken = asyncio.Event()

        def callback() -> None:
            ran.append(threading.current_thread().name)
            woken.set()

        waker = Waker(loop, callback)
        threading.Thread(target=waker.wake, name="engine").start()
        await asyncio.wait_for(woken.wait(), 5)
        assert ran == [threading.current_thread().name]
        waker.close()
        await asyncio.sleep(0)  # a pipe's close runs the callback once more (a byte in it)
        assert len(ran) == (2 if gil_holding else 1)
        woken.clear()
        threading.Thread(target=waker.wake).start()  # closed: call_soon_threadsafe
        await asyncio.wait_for(woken.wait(), 5)
        assert len(ran) == (3 if gil_holding else 2)

    run(main())


@pytest.mark.parametrize("written", [-1, 0], ids=["EAGAIN", "nothing written"])
def test_a_wake_up_byte_that_is_not_written_still_wakes_the_loop(monkeypatch, written):
    if executor._WRITE is None:
        pytest.skip("no libc write here: wake-ups go through call_soon_threadsafe")
    tried: list[int] = []

    def failing_write(fd: int, data: bytes, n: int) -> int:
        tried.append(fd)
        return written

    async def main() -> None:
        woken = asyncio.Event()
        waker = Waker(asyncio.get_running_loop(), woken.set)
        monkeypatch.setattr(executor, "_WRITE", failing_write)
        threading.Thread(target=waker.wake, name="engine").start()
        await asyncio.wait_for(woken.wait(), 10)
        assert tried  # the pipe was tried first
        waker.close()

    run(main())
