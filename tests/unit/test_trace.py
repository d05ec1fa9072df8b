"""The opt-in node trace: one JSON line per settled request, off by default."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

from actors.node import NodeRuntime
from actors.trace import FIELDS, NodeTrace, read_traces, trace_path
from edgefleet.config import parse_config
from edgefleet.request import InferRequest, Request, RequestState
from tests.fakes import FakeLoader, fake_spec, x


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_each_settled_request_writes_one_line_with_its_fields(tmp_path):
    spec = fake_spec(capacity=1).model_copy(update={"trace_dir": tmp_path / "trace"})

    async def main():
        node = NodeRuntime(spec, loader=FakeLoader(m={"cost_s": 0.3}))
        await node.start()

        async def until(check) -> None:  # polled: a busy machine may be slow to get there
            for _ in range(2000):
                if check(node.status()):
                    return
                await asyncio.sleep(0.005)
            raise AssertionError("the node never got there")

        first = asyncio.ensure_future(node.infer(InferRequest("m", x(1.0), 3, id="ok")))
        await until(lambda s: s.running is not None)  # the queue (capacity 1) is free again
        queued = asyncio.ensure_future(node.infer(InferRequest("m", x(2.0), 3, id="queued")))
        await until(lambda s: s.queue_length == 1)
        refused = await node.infer(InferRequest("m", x(3.0), 3, id="refused"))  # queue full
        await asyncio.gather(first, queued)
        failed = await node.infer(InferRequest("m", x(-1.0), 0, id="failed"))  # engine error
        again = await node.infer(InferRequest("m", x(1.0), 3, id="ok"))  # answered from memory
        assert refused.error is not None and failed.error is not None and again.error is None
        await node.stop()

    run(main())
    (path,) = (tmp_path / "trace").iterdir()
    assert path == trace_path(tmp_path / "trace", "fake-0", os.getpid())
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [tuple(line) for line in lines] == [FIELDS] * 4  # every field, in order
    by_id = {line["id"]: line for line in lines}
    assert sorted(by_id) == ["failed", "ok", "queued", "refused"]  # one line each
    ok = by_id["ok"]
    assert (ok["node"], ok["pid"], ok["kind"], ok["model"], ok["priority"]) == (
        "fake-0",
        os.getpid(),
        "infer",
        "m",
        3,
    )
    assert ok["state"] == "completed" and ok["ran"] is True and ok["rows"] == 1
    assert ok["service_s"] >= 0.04 and ok["tokens"] == 0
    assert by_id["queued"]["ran"] is True and by_id["queued"]["queue_s"] > 0
    assert (by_id["refused"]["state"], by_id["refused"]["ran"]) == ("rejected", False)
    assert (by_id["failed"]["state"], by_id["failed"]["ran"]) == ("failed", False)
    assert all(isinstance(line["t"], float) for line in lines)
    read, bad = read_traces(tmp_path / "trace")
    assert [line["id"] for line in read] == [line["id"] for line in lines] and bad == 0


def test_tracing_is_off_by_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert fake_spec().trace_dir is None
    config = parse_config({"models": {"m": {"path": "m.onnx"}}}, tmp_path)
    assert config.node_defaults.trace_dir is None
    assert all(s.trace_dir is None for s in config.node_specs())

    async def main():
        node = NodeRuntime(fake_spec(), loader=FakeLoader())
        await node.start()
        assert node._trace is None
        assert (await node.infer(InferRequest("m", x(1.0)))).error is None
        await node.stop()

    run(main())
    assert list(tmp_path.iterdir()) == []


def test_a_relative_trace_dir_is_under_the_config_folder(tmp_path):
    data = {"models": {"m": {"path": "m.onnx"}}, "node_defaults": {"trace_dir": "traces"}}
    config = parse_config(data, tmp_path)
    assert {s.trace_dir for s in config.node_specs()} == {(tmp_path / "traces").resolve()}


def test_a_trace_that_cannot_be_written_never_stops_the_node(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    trace = NodeTrace(blocker / "trace", "n")  # a folder inside a file: cannot be made
    assert trace.errors == 1
    request = Request("r", "m", {}, 3, arrival=0.0)
    trace.settled(request, RequestState.COMPLETED, ran=True, service_s=0.0)  # no-op

    class Broken:
        def write(self, text: str) -> int:
            raise OSError("disk full")

        def close(self) -> None:
            pass

    trace = NodeTrace(tmp_path / "ok", "n")
    trace._file = Broken()  # type: ignore[assignment]
    trace.settled(request, RequestState.COMPLETED, ran=True, service_s=0.0)
    trace.settled(request, RequestState.COMPLETED, ran=True, service_s=0.0)
    assert trace.errors == 2


def test_a_line_cut_short_by_a_killed_process_is_skipped(tmp_path):
    path: Path = trace_path(tmp_path, "n", 1)
    path.write_text('{"t": 1.0, "id": "a", "ran": true}\n{"t": 2.0, "id": "b", "ra')
    lines, bad = read_traces(tmp_path)
    assert [line["id"] for line in lines] == ["a"] and bad == 1


def test_a_generation_writes_one_line_when_it_finishes(tmp_path):
    from edgefleet.messages import GenerationResult
    from edgefleet.modelgen import make_tiny_lm
    from edgefleet.request import GenerateRequest

    make_tiny_lm(tmp_path / "lm.onnx")
    config = parse_config(
        {
            "models": {"lm": {"path": "lm.onnx", "kind": "decoder", "warmup": False}},
            "node_defaults": {"trace_dir": "trace"},
        },
        tmp_path,
    )
    (spec,) = config.node_specs()

    async def main():
        node = NodeRuntime(spec)
        await node.start()
        items = [i async for i in node.generate(GenerateRequest("lm", (5, 6, 7), 12, id="g"))]
        assert isinstance(items[-1], GenerationResult) and items[-1].finish_reason == "length"
        stream = node.generate(GenerateRequest("lm", (5, 6, 7), 400, id="gone"))
        await stream.__anext__()  # the first tokens came; then the consumer goes away
        await stream.aclose()
        await node.stop()

    run(main())
    lines, _ = read_traces(tmp_path / "trace")
    by_id = {line["id"]: line for line in lines}
    assert sorted(by_id) == ["g", "gone"]
    done = by_id["g"]
    assert (done["kind"], done["state"], done["ran"], done["rows"], done["tokens"]) == (
        "generate",
        "completed",
        True,
        1,
        12,
    )
    assert done["service_s"] > 0
    gone = by_id["gone"]
    assert (gone["state"], gone["ran"]) == ("cancelled", False) and gone["tokens"] < 400
