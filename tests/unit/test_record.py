"""The call record (``router.record_dir``): a line per request a dispatcher placed, read
back by the simulator's ``read_trace``. Dispatchers over scripted node handles (no Ray)."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import logging
import os
import random
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import cluster.record
from actors.node import NodeRuntime
from cluster.dispatch import Dispatcher, FutureCalls
from cluster.record import call_line
from edgefleet.config import FleetConfig, parse_config
from edgefleet.errors import Rejected
from edgefleet.messages import GenerationResult, Reply, TokenChunk
from edgefleet.request import GenerateRequest, InferRequest
from sim.run import recorded_costs
from sim.workload import Arrival, read_engine_times, read_trace
from tests.fakes import FakeLoader, fake_spec, x

REFUSED = "refused"  # every node refuses this id
SPILLED = "spilled"  # the first node asked refuses this id; the next takes it
# what a scripted node says it measured: queued, engine time, requests and rows in the call
QUEUE_S, SERVICE_S, BATCH, CALL_ROWS, HANDOFF_S, ABORT_S = 0.0015, 0.00425, 2, 5, 0.0002, 0.0007


class ScriptedNode(FutureCalls):
    """A node handle that answers at once: y = 2x for an inference, two chunks of tokens
    for a generation; refuses the ids the fleet's ``refusals`` script says."""

    def __init__(self, name: str, asked: dict[str, int]) -> None:
        self.name = name
        self.asked = asked  # request id -> times any node was asked, shared by the fleet

    def _refuses(self, request_id: str) -> bool:
        self.asked[request_id] = self.asked.get(request_id, 0) + 1
        return request_id == REFUSED or (request_id == SPILLED and self.asked[request_id] == 1)

    def _reply(self, request: InferRequest) -> Reply:
        if self._refuses(request.id):
            return Reply(request.id, self.name, error=Rejected("full", retry_after_s=0.1))
        return Reply(
            request.id,
            self.name,
            outputs={"y": request.inputs["x"] * 2},
            queue_s=QUEUE_S,
            service_s=SERVICE_S,
            batch_size=BATCH,
            call_rows=CALL_ROWS,
            handoff_s=HANDOFF_S,
            abort_s=ABORT_S,
        )

    def infer(self, request: InferRequest, inputs: Any = None) -> cf.Future[Reply]:
        out: cf.Future[Reply] = cf.Future()
        out.set_result(self._reply(request))
        return out

    def generate(self, request: GenerateRequest) -> Iterator[TokenChunk | GenerationResult]:
        if self._refuses(request.id):
            yield GenerationResult(request.id, self.name, error=Rejected("full"))
            return
        yield TokenChunk((1, 2))
        yield TokenChunk((3,))
        yield GenerationResult(
            request.id,
            self.name,
            (1, 2, 3),
            finish_reason="length",
            queue_s=QUEUE_S,
            engine_s=SERVICE_S,
            fed_tokens=len(request.prompt_ids) + 2,
        )


def make_config(base: Path, record_dir: str | None = "calls") -> FleetConfig:
    return parse_config(
        {
            "models": {
                "m": {"path": "m.onnx", "warmup": False},
                "lm": {"path": "lm.onnx", "kind": "decoder", "warmup": False},
            },
            "nodes": [{"name": "a"}, {"name": "b"}],
            "router": {"record_dir": record_dir, "placement": {"shed": {}}},
        },
        base,
    )


def dispatcher(config: FleetConfig) -> Dispatcher:
    asked: dict[str, int] = {}
    return Dispatcher(config, {n: ScriptedNode(n, asked) for n in ("a", "b")})


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def only_file(directory: Path) -> Path:
    (path,) = directory.glob("*.jsonl")
    return path


def send_every_kind(d: Dispatcher) -> dict[str, Any]:
    """One request of each kind through ``d``'s three entry points; their answers by id."""
    answers: dict[str, Any] = {}
    timed = InferRequest(
        "m",
        x(1.0, rows=3),
        priority=7,
        id="timed",
        key="cam-1",
        deadline_unix=time.time() + 0.5,
    )
    answers["timed"] = d.submit(timed).result(10)
    answers["plain"] = d.call(InferRequest("m", x(1.0), priority=0, id="plain"))
    answers[SPILLED] = d.submit(InferRequest("m", x(1.0), id=SPILLED)).result(10)
    answers[REFUSED] = d.call(InferRequest("m", x(1.0), priority=3, id=REFUSED))
    chat = GenerateRequest("lm", (5, 6, 7, 8), 8, priority=7, id="chat", session="s1")
    answers["chat"] = list(d.stream(chat))[-1]
    left = d.stream(GenerateRequest("lm", (5, 6), 8, priority=3, id="left"))
    next(left)  # the caller reads one chunk and walks away
    left.close()
    answers["unknown"] = d.call(InferRequest("nope", x(1.0), id="unknown"))
    return answers


def test_every_request_is_recorded_once_when_answered(tmp_path):
    d = dispatcher(make_config(tmp_path))
    before = time.time()
    answers = send_every_kind(d)
    assert d.counted()["spilled"] == 3  # SPILLED once, REFUSED by both nodes
    d.close()
    path = only_file(tmp_path / "calls")
    assert re.fullmatch(
        rf"calls-{re.escape(socket.gethostname())}-{os.getpid()}-\d+\.jsonl", path.name
    )
    got = {line["id"]: line for line in lines(path)}
    assert sorted(got) == sorted([*answers, "left"])
    assert len(lines(path)) == len(got)  # once each
    assert all(list(line) == list(got["plain"]) for line in got.values())  # one key order
    assert list(got["plain"]) == [
        "at",
        "id",
        "model",
        "priority",
        "rows",
        "deadline_s",
        "key",
        "session",
        "prompt_tokens",
        "max_new_tokens",
        "outcome",
        "latency_s",
        "node",
        "service_ms",
        "queue_ms",
        "batch",
        "call_rows",
        "handoff_ms",
        "abort_ms",
        "new_tokens",
        "fed_tokens",
    ]
    assert all(before <= line["at"] <= time.time() for line in got.values())
    assert all(line["latency_s"] >= 0 for line in got.values())

    timed = got["timed"]
    assert (timed["model"], timed["priority"], timed["rows"], timed["key"]) == ("m", 7, 3, "cam-1")
    assert 0.45 < timed["deadline_s"] <= 0.5
    assert (timed["outcome"], timed["node"]) == ("completed", answers["timed"].node)
    assert timed["session"] is None and timed["prompt_tokens"] == timed["max_new_tokens"] == 0
    plain = got["plain"]
    assert (plain["deadline_s"], plain["key"], plain["rows"], plain["outcome"]) == (
        None,
        None,
        1,
        "completed",
    )
    spilled = got[SPILLED]
    assert spilled["outcome"] == "completed" and spilled["node"] == answers[SPILLED].node != ""
    refused = got[REFUSED]
    assert (refused["outcome"], refused["node"], refused["priority"]) == ("rejected", "", 3)
    chat = got["chat"]
    assert (chat["model"], chat["session"], chat["rows"], chat["key"]) == ("lm", "s1", 1, None)
    assert (chat["prompt_tokens"], chat["max_new_tokens"]) == (4, 8)
    assert (chat["outcome"], chat["node"]) == ("completed", answers["chat"].node)
    assert got["left"]["outcome"] == "cancelled" and got["left"]["node"] in ("a", "b")
    assert (got["unknown"]["outcome"], got["unknown"]["node"]) == ("modelnotfound", "")

    # the figures the answering node measured, in ms; null where none answered
    figures = ("service_ms", "queue_ms", "batch", "call_rows", "handoff_ms", "abort_ms")
    for rid in ("timed", "plain", SPILLED):
        want = (4.25, 1.5, BATCH, CALL_ROWS, 0.2, 0.7)
        assert tuple(got[rid][k] for k in figures) == want, rid
    # a generation: its engine time over all its calls, its queue, the tokens it made
    # and fed (its 4-token prompt, then a step for each token after the first)
    assert tuple(chat[k] for k in figures) == (4.25, 1.5, None, None, None, None)
    assert (chat["new_tokens"], chat["fed_tokens"]) == (3, 6)
    for rid in ("timed", "plain", SPILLED):
        assert got[rid]["new_tokens"] is got[rid]["fed_tokens"] is None, rid
    for rid in (REFUSED, "unknown", "left"):  # no node answered; the caller walked away
        assert tuple(got[rid][k] for k in (*figures, "new_tokens", "fed_tokens")) == (None,) * 8


def test_the_record_reads_back_as_the_arrivals_sent(tmp_path):
    d = dispatcher(make_config(tmp_path))
    send_every_kind(d)
    d.close()
    path = only_file(tmp_path / "calls")
    recorded = {line["id"]: line["at"] for line in lines(path)}
    arrivals = {a.id: a for a in read_trace(path)}
    start = min(recorded.values())
    for rid, at in recorded.items():
        assert arrivals[rid].at == pytest.approx(at - start, abs=1e-6)
    timed = arrivals["timed"]
    assert timed == Arrival(
        timed.at, "m", 7, rows=3, deadline_s=timed.deadline_s, key="cam-1", id="timed"
    )
    assert timed.deadline_s == pytest.approx(0.5, abs=0.05)
    assert arrivals["chat"] == Arrival(
        arrivals["chat"].at, "lm", 7, session="s1", prompt_tokens=4, max_new_tokens=8, id="chat"
    )
    assert arrivals["plain"] == Arrival(arrivals["plain"].at, "m", 0, id="plain")
    assert arrivals[SPILLED] == Arrival(arrivals[SPILLED].at, "m", 10, id=SPILLED)
    assert arrivals[REFUSED] == Arrival(arrivals[REFUSED].at, "m", 3, id=REFUSED)
    assert arrivals["left"].prompt_tokens == 2


def test_a_folder_of_callers_records_replays_merged_in_time_order(tmp_path):
    config = make_config(tmp_path)
    callers = [dispatcher(config), dispatcher(config)]
    sent = []
    for i in range(6):
        rid = f"r{i}"
        callers[i % 2].call(InferRequest("m", x(1.0), id=rid))
        sent.append(rid)
        time.sleep(0.002)
    for d in callers:
        d.close()
    files = sorted((tmp_path / "calls").glob("calls-*.jsonl"))
    assert len(files) == 2  # a file per dispatcher
    got = read_trace(tmp_path / "calls")
    assert [a.id for a in got] == sent
    assert got[0].at == 0 and all(a.at < b.at for a, b in zip(got, got[1:], strict=False))


def test_a_trace_folder_names_the_file_and_line_of_a_bad_line(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"at": 1, "model": "m", "priority": 1}\n')
    (tmp_path / "b.jsonl").write_text('{"at": 2, "model": "m", "priority": 1}\n{"at": 3}\n')
    with pytest.raises(Exception, match=re.escape(f"{tmp_path / 'b.jsonl'}:2: model: missing")):
        read_trace(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(Exception, match="without \\*.jsonl files"):
        read_trace(tmp_path / "empty")


def test_a_record_dir_that_cannot_be_made_is_logged_and_requests_go_on(tmp_path, caplog):
    (tmp_path / "taken").write_text("a file, not a folder")
    with caplog.at_level(logging.WARNING, logger="cluster.record"):
        d = dispatcher(make_config(tmp_path, "taken/calls"))
        answers = send_every_kind(d)
        d.close()
    assert answers["plain"].error is None and answers["chat"].error is None
    assert answers[SPILLED].error is None and isinstance(answers[REFUSED].error, Rejected)
    warnings = [r.getMessage() for r in caplog.records if r.name == "cluster.record"]
    assert len(warnings) == 1 and "call record off" in warnings[0]


def test_a_record_that_stops_being_writable_turns_off_once(tmp_path, caplog, monkeypatch):
    # /dev/full takes writes into the buffer and fails each flush: a full disk.
    monkeypatch.setattr(cluster.record, "record_path", lambda *args: Path("/dev/full"))
    d = dispatcher(make_config(tmp_path))
    with caplog.at_level(logging.WARNING, logger="cluster.record"):
        assert d.call(InferRequest("m", x(1.0))).error is None
        d.flush()
        for _ in range(3):
            assert d.call(InferRequest("m", x(1.0))).error is None
        d.flush()
        d.close()
    warnings = [r for r in caplog.records if r.name == "cluster.record"]
    assert len(warnings) == 1 and "call record off" in warnings[0].getMessage()


def test_record_dir_is_off_by_default_and_relative_to_the_config(tmp_path):
    assert make_config(tmp_path, None).router.record_dir is None
    assert make_config(tmp_path, "calls").router.record_dir == (tmp_path / "calls").resolve()
    d = dispatcher(make_config(tmp_path, None))
    d.call(InferRequest("m", x(1.0)))
    d.close()
    assert not (tmp_path / "calls").exists()
    idle = dispatcher(make_config(tmp_path, "calls"))  # a caller that sends nothing...
    idle.flush()
    idle.close()
    assert not (tmp_path / "calls").exists()  # ...leaves no file


def test_lines_without_the_node_figures_still_replay(tmp_path):
    # a line as callers wrote it without service_ms, queue_ms and batch
    old = {
        "at": 1767268800.5,
        "id": "r-1",
        "model": "m",
        "priority": 10,
        "rows": 1,
        "deadline_s": None,
        "key": None,
        "session": None,
        "prompt_tokens": 0,
        "max_new_tokens": 0,
        "outcome": "completed",
        "latency_s": 0.0123,
        "node": "a",
    }
    new = dict(old, at=1767268801.0, id="r-2", service_ms=4.0, queue_ms=0.5, batch=1)
    newer = dict(new, at=1767268801.5, id="r-3", handoff_ms=0.25)
    newest = dict(newer, at=1767268802.0, id="r-4", abort_ms=1.5)
    path = tmp_path / "calls.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in (old, new, newer, newest)))
    assert read_trace(path) == [
        Arrival(0.0, "m", 10, id="r-1"),
        Arrival(0.5, "m", 10, id="r-2"),
        Arrival(1.0, "m", 10, id="r-3"),
        Arrival(1.5, "m", 10, id="r-4"),
    ]
    # the old line has none; the new call started queue_ms after its arrival, and its
    # request spent latency_s less queue_ms and service_ms outside the node (a's); the
    # newer lines have the call's hand-off too, the newest its abort wait
    outside = pytest.approx(12.3 - 0.5 - 4.0)
    assert read_engine_times(path) == {
        "m": {
            1: [
                (pytest.approx(0.5005), 4.0, outside, "a", None, None),
                (pytest.approx(1.0005), 4.0, outside, "a", 0.25, None),
                (pytest.approx(1.5005), 4.0, outside, "a", 0.25, 1.5),
            ]
        }
    }


def test_a_request_that_cannot_be_recorded_costs_its_own_line_only(tmp_path, caplog):
    d = dispatcher(make_config(tmp_path))
    with caplog.at_level(logging.WARNING, logger="cluster.record"):
        assert d.call(InferRequest("m", x(1.0), id="before")).error is None
        for bad in (7, 8):  # a caller's own id type: no JSON string
            assert d.call(InferRequest("m", x(1.0), id=bad)).error is None  # type: ignore[arg-type]
        assert d.call(InferRequest("m", x(1.0), id="after")).error is None
        d.close()
    assert [line["id"] for line in lines(only_file(tmp_path / "calls"))] == ["before", "after"]
    assert d._record is not None and d._record.skipped == 2
    warnings = [r.getMessage() for r in caplog.records if r.name == "cluster.record"]
    assert len(warnings) == 1 and "cannot be recorded" in warnings[0]


def test_a_call_of_multi_row_requests_is_priced_by_its_rows_not_its_requests(tmp_path):
    # A node that batches two 2-row requests runs a 4-row call; the simulator must draw
    # a 4-row call's engine time from it, and a lone 2-row request's from 2-row calls.
    node = NodeRuntime(
        fake_spec({"m": {"batching": {"window_ms": 1000, "max_batch_size": 8}}}),
        loader=FakeLoader(m={"cost_s": 0.001}),
    )

    async def serve() -> list[Reply]:
        await node.start()
        together = [node.infer(InferRequest(model="m", inputs=x(1.0, rows=2))) for _ in range(2)]
        replies = list(await asyncio.gather(*together))
        replies.append(await node.infer(InferRequest(model="m", inputs=x(2.0, rows=2))))
        return replies

    replies = asyncio.run(asyncio.wait_for(serve(), 30))
    sizes = [(r.batch_size, r.call_rows) for r in replies]
    assert sizes[:2] == [(2, 4), (2, 4)] and sizes[2][1] in (2, 4), sizes
    path = tmp_path / "calls.jsonl"
    path.write_text(
        "".join(
            call_line(
                InferRequest(model="m", inputs=x(1.0, rows=2), id=r.request_id),
                at=1767268800.0 + i,
                rows=2,
                outcome="completed",
                latency_s=0.01,
                node="fake-0",
                answer=r,
            )
            for i, r in enumerate(replies)
        )
    )
    times = read_engine_times(path)["m"]
    assert sorted(times) == sorted({rows for _, rows in sizes})  # by rows: 4 (and 2)
    costs = recorded_costs({"m": times})["m"]
    rng = random.Random(0)
    recorded = [round(r.service_s * 1000, 3) for r in replies if r.call_rows == 4]
    for _ in range(5):
        drawn = costs.draw(4, rng).seconds * 1000
        assert min(abs(drawn - ms) for ms in recorded) < 1e-6, (drawn, recorded)
