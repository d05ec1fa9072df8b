"""After Ctrl-C the demo prints its report, then stopping the fleet is bounded."""

from __future__ import annotations

import threading

import cluster.demo as demo


def test_a_stuck_stop_after_ctrl_c_ends_the_command_with_status_130(monkeypatch):
    ended = threading.Event()
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(demo, "INTERRUPTED_STOP_S", 0.01)
    monkeypatch.setattr(demo, "stop_children", lambda grace_s: calls.append(("stop", grace_s)))

    def exit_now(code: int) -> None:
        calls.append(("exit", code))
        ended.set()

    monkeypatch.setattr(demo.os, "_exit", exit_now)
    said: list[str] = []
    demo._bound_the_stop(said.append)
    assert ended.wait(10)
    assert calls == [("stop", 0), ("exit", 130)]
    assert "stopping its processes" in said[0]
