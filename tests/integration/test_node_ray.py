"""Node actors on a real Ray cluster serving generated ONNX models."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort
import pytest
import ray

from cluster.client import FleetClient
from edgefleet.errors import (
    ConfigError,
    DeadlineExceeded,
    EdgeFleetError,
    InvalidInput,
    ModelNotFound,
    Rejected,
)
from edgefleet.modelgen import calibrate_slow, random_inputs
from sim.workload import read_trace

pytestmark = pytest.mark.integration


def ort_run(models_dir, name, inputs):
    session = ort.InferenceSession(str(models_dir / f"{name}.onnx"))
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, inputs), strict=True))


def test_batched_results_equal_direct_onnx_runtime(make_fleet, models_dir):
    # Requests of every priority share batches here: lower rows may lengthen a call
    # freely, and the window is held whatever the arrival rate on a busy machine.
    batching = {
        "window_ms": 30,
        "max_batch_size": 8,
        "only_if_faster": False,
        "lower_priority_cost_bound": 100,
        "adaptive_window": False,
    }
    fleet = make_fleet(
        {
            "models": {
                "classifier": {"path": "classifier.onnx", "batching": batching},
                "detector": {"path": "detector.onnx", "batching": batching},
            }
        }
    )
    cases = [("classifier", random_inputs("classifier", seed=i)) for i in range(12)]
    cases += [
        ("detector", random_inputs("detector", seed=i, height=16 + 8 * (i % 3), width=24))
        for i in range(9)
    ]
    refs = [fleet.submit(m, inp, priority=i % 11) for i, (m, inp) in enumerate(cases)]
    replies = FleetClient.gather(refs, 60)
    assert max(r.batch_size for r in replies) > 1, "requests should have been batched"
    for (model, inputs), reply in zip(cases, replies, strict=True):
        expected = ort_run(models_dir, model, inputs)
        for name, value in reply.unwrap().items():
            np.testing.assert_allclose(value, expected[name], rtol=1e-4, atol=1e-5)


def test_map_unordered_answers_each_input_once_with_its_own_outputs(make_fleet, models_dir):
    fleet = make_fleet({"models": {"classifier": {"path": "classifier.onnx"}}})
    cases = [random_inputs("classifier", seed=i) for i in range(40)]
    cases[7] = {"pixels": cases[7]["images"]}  # a bad input fails alone (on its node)
    cases[3] = [cases[3]["images"]]  # so does one that is not a mapping (in the caller)
    answers = dict(fleet.map_unordered("classifier", iter(cases), in_flight=6))
    assert sorted(answers) == list(range(40))
    assert isinstance(answers.pop(7).error, InvalidInput)
    assert isinstance(answers.pop(3).error, InvalidInput)
    for i, reply in answers.items():
        expected = ort_run(models_dir, "classifier", cases[i])
        np.testing.assert_allclose(reply.unwrap()["logits"], expected["logits"], rtol=1e-5)
    with pytest.raises(ModelNotFound):  # at the call, before anything is sent
        fleet.map_unordered("nope", iter(cases))
    with pytest.raises(ValueError, match="in_flight"):
        fleet.map_unordered("classifier", iter(cases), in_flight=0)
    with pytest.raises(InvalidInput, match="priority"):
        fleet.map_unordered("classifier", iter(cases), priority="urgent")
    with pytest.raises(InvalidInput, match="deadline_s"):
        fleet.map_unordered("classifier", iter(cases), deadline_s="soon")


def test_unbatchable_model_under_concurrent_requests(make_fleet, models_dir):
    fleet = make_fleet({"models": {"stateful": {"path": "stateful.onnx"}}})
    rng = np.random.default_rng(7)
    cases = [
        {
            "x": np.asarray(rng.standard_normal(), dtype=np.float32),
            "state": rng.standard_normal((2, 1, 16)).astype(np.float32),
        }
        for _ in range(40)
    ]
    replies = FleetClient.gather([fleet.submit("stateful", c) for c in cases], 60)
    assert all(r.batch_size == 1 for r in replies)
    for case, reply in zip(cases, replies, strict=True):
        expected = ort_run(models_dir, "stateful", case)
        out = reply.unwrap()
        np.testing.assert_allclose(out["new_state"], expected["new_state"], rtol=1e-5)
        np.testing.assert_allclose(out["y"], expected["y"], rtol=1e-5)


def test_bad_inputs_fail_alone_while_good_requests_succeed(make_fleet):
    fleet = make_fleet(
        {
            "models": {
                "classifier": {
                    "path": "classifier.onnx",
                    "max_input_bytes": 100_000,
                    "batching": {"window_ms": 20, "max_batch_size": 8, "only_if_faster": False},
                }
            }
        }
    )
    good = random_inputs("classifier")
    bad = {
        "wrong dtype": ({"images": good["images"].astype(np.float64)}, "float32 [N,3,32,32]"),
        "wrong rank": ({"images": good["images"][0]}, "got float32 [3,32,32]"),
        "unknown input": ({**good, "extra": good["images"]}, "unknown input 'extra'"),
        "missing input": ({}, "missing input 'images'"),
        "oversize": (
            {"images": np.zeros((16, 3, 32, 32), np.float32)},
            "the limit is 100000 bytes",
        ),
    }
    refs = []
    for i in range(20):
        refs.append(("good", fleet.submit("classifier", good)))
        name, (inputs, _) = list(bad.items())[i % len(bad)]
        refs.append((name, fleet.submit("classifier", inputs)))
    for name, ref in refs:
        reply = ref.result(60)
        if name == "good":
            assert reply.error is None
        else:
            assert isinstance(reply.error, InvalidInput), name
            assert bad[name][1] in str(reply.error)
    with pytest.raises(InvalidInput, match="unknown input"):
        fleet.infer("classifier", {"pixels": good["images"]})
    with pytest.raises(ModelNotFound):
        fleet.infer("nope", good)
    with pytest.raises(InvalidInput, match="priority"):
        fleet.infer("classifier", good, priority="urgent")
    assert fleet.status().totals["completed"] >= 20


def test_flood_of_10000_requests_all_answered_memory_bounded(make_fleet):
    fleet = make_fleet(
        {
            "models": {"slow": {"path": "slow.onnx"}},
            "node_defaults": {"queue": {"capacity": 64}},
        }
    )
    inputs = random_inputs("slow")
    kinds: dict[str, int] = {}
    ids: set[str] = set()
    peaks = [fleet.status().nodes[0].rss_mb]
    for _ in range(2):  # two waves of 5,000: the second must not grow the node further
        refs = [fleet.submit("slow", inputs, priority=i % 11) for i in range(5_000)]
        for reply in FleetClient.gather(refs, 300):
            assert (reply.outputs is None) != (reply.error is None)
            assert reply.error is None or isinstance(reply.error, EdgeFleetError)
            kind = "ok" if reply.error is None else type(reply.error).__name__
            kinds[kind] = kinds.get(kind, 0) + 1
            ids.add(reply.request_id)
        peaks.append(fleet.status().nodes[0].peak_rss_mb)
    after = fleet.status().nodes[0]
    assert len(ids) == 10_000 and sum(kinds.values()) == 10_000
    assert set(kinds) <= {"ok", "Rejected", "Evicted"}
    assert kinds["ok"] >= 128
    idle, first, second = peaks
    print(f"\nflood: {kinds}; node RSS idle {idle:.0f} MB, peak {first:.0f} / {second:.0f} MB")
    assert peaks[2] - peaks[1] < 50, f"node memory kept growing: {peaks}"
    assert after.queue_length == 0 and after.running is None


def test_foreground_overtakes_background_backlog(make_fleet, models_dir):
    calibrate_slow(models_dir / "heavy.onnx", 5.0)
    fleet = make_fleet({"models": {"heavy": {"path": "heavy.onnx"}}})
    inputs = random_inputs("slow")
    backlog = [fleet.submit("heavy", inputs, priority="background") for _ in range(30)]
    time.sleep(0.02)
    fg = fleet.infer_reply("heavy", inputs, priority="foreground")
    bg = FleetClient.gather(backlog, 60)
    assert fg.error is None and all(r.error is None for r in bg)
    last_bg_wait = max(r.queue_s for r in bg)
    # The foreground request waits for at most the call in progress, not the backlog.
    assert fg.queue_s < 0.25 * last_bg_wait, (fg.queue_s, last_bg_wait)


def test_deadline_and_rejection_reach_the_caller(make_fleet, tmp_path):
    fleet = make_fleet(
        {
            "models": {"slow": {"path": "slow.onnx"}},
            "node_defaults": {"queue": {"capacity": 2}},
            "router": {"record_dir": str(tmp_path)},
        }
    )
    inputs = random_inputs("slow")
    with pytest.raises(DeadlineExceeded) as expired:
        fleet.infer("slow", inputs, deadline_s=-1.0)
    refs = [fleet.submit("slow", inputs, priority="foreground") for _ in range(50)]
    replies = FleetClient.gather(refs, 60)
    errors = [r.error for r in replies if r.error is not None]
    assert errors and all(isinstance(e, Rejected) for e in errors)
    assert all(e.retry_after_s > 0 and "queue full" in str(e) for e in errors)
    # The call record holds each request once, as it was sent and answered; the
    # client's view feed flushes it every report interval.
    answered = {r.request_id: ("rejected" if r.error else "completed", r.node) for r in replies}
    answered[expired.value.request_id] = ("deadlineexceeded", "edge-0")
    end = time.monotonic() + 10
    while len(recorded := _recorded(tmp_path)) < len(answered):
        assert time.monotonic() < end, f"{len(recorded)} of {len(answered)} recorded"
        time.sleep(0.1)
    by_id = {line["id"]: line for line in recorded}
    assert len(by_id) == len(recorded) == len(answered)
    assert {rid: (line["outcome"], line["node"]) for rid, line in by_id.items()} == answered
    sent = {(line["model"], line["priority"], line["rows"], line["key"]) for line in recorded}
    assert sent == {("slow", 10, 1, None)}
    assert by_id[expired.value.request_id]["deadline_s"] == 1e-6  # already past on arrival
    assert sorted(a.id for a in read_trace(tmp_path)) == sorted(answered)


def _recorded(record_dir):
    """The whole lines written so far to the call records in ``record_dir``."""
    return [
        json.loads(line)
        for path in record_dir.glob("calls-*.jsonl")
        for line in path.read_text().split("\n")[:-1]  # after the last newline: a part line
    ]


def test_async_client_and_drain(make_fleet):
    fleet = make_fleet({"models": {"classifier": {"path": "classifier.onnx"}}})
    inputs = random_inputs("classifier")

    async def many():
        return await asyncio.gather(*(fleet.infer_async("classifier", inputs) for _ in range(10)))

    with ThreadPoolExecutor(1) as pool:  # a fresh event loop, as a service would have
        outs = pool.submit(asyncio.run, many()).result(timeout=60)
    assert all(o["logits"].shape == (1, 10) for o in outs)
    status = fleet.drain("edge-0")
    assert status.state == "drained"
    with pytest.raises(Rejected, match="draining"):
        fleet.infer("classifier", inputs)


def test_switch_model_on_a_real_node(make_fleet):
    fleet = make_fleet(
        {
            "models": {
                "classifier": {"path": "classifier.onnx", "memory_mb": 60},
                "detector": {"path": "detector.onnx", "memory_mb": 60},
            },
            "node_defaults": {"memory_budget_mb": 100},
        }
    )
    loaded = [m.name for m in fleet.status().nodes[0].models if m.loaded]
    assert loaded == ["classifier"]
    status = fleet.switch_model("edge-0", "detector")
    assert [m.name for m in status.models if m.loaded] == ["detector"]
    out = fleet.infer("classifier", random_inputs("classifier"))  # switches back on demand
    assert out["logits"].shape == (1, 10)
    assert fleet.status().nodes[0].counters["model_loads"] == 2


def test_embedded_ray_listens_on_loopback_only(make_fleet):
    import psutil

    make_fleet({"models": {"classifier": {"path": "classifier.onnx"}}})
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    listening = []
    for proc in psutil.Process().children(recursive=True):
        try:
            conns = proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        listening += [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]
    assert listening, "found no Ray process listening at all"
    assert set(listening) <= {"127.0.0.1", "::1", "::ffff:127.0.0.1"}, set(listening)


def test_router_restart_loses_no_request(make_fleet):
    from concurrent.futures import ThreadPoolExecutor

    from cluster.deploy import NAMESPACE, router_name

    fleet = make_fleet({"models": {"heavy": {"path": "heavy.onnx"}}})
    router = ray.get_actor(router_name(fleet.config.fleet.name), namespace=NAMESPACE)
    inputs = random_inputs("heavy")
    with ThreadPoolExecutor(8) as pool:
        futures = [
            pool.submit(fleet.infer_reply, "heavy", inputs, request_id=f"rr-{i}") for i in range(40)
        ]
        time.sleep(0.1)
        ray.kill(router, no_restart=False)  # Ray restarts the detached router
        replies = [f.result(timeout=120) for f in futures]
    assert sorted(r.request_id for r in replies) == sorted(f"rr-{i}" for i in range(40))
    assert all(r.error is None for r in replies), [r.error for r in replies if r.error][:3]
    status = fleet.status()
    completed = status.totals["completed"]
    assert completed == 40, f"{completed} engine completions for 40 requests: some ran twice"
    # The restarted router serves the view again, and counts this client's work.
    assert fleet.infer_reply("heavy", inputs).error is None
    end = time.monotonic() + 60
    while fleet.status().callers < 1:
        assert time.monotonic() < end, "the client's view feed did not reach the new router"
        time.sleep(0.2)


def test_another_caller_with_other_placement_on_the_same_fleet(make_fleet):
    fleet = make_fleet(
        {"local": {"nodes": 2}, "models": {"classifier": {"path": "classifier.onnx"}}}
    )
    inputs = random_inputs("classifier")
    rr = fleet.with_placement(policy="round_robin")
    try:
        nodes = [rr.infer_reply("classifier", inputs).node for _ in range(4)]
        assert nodes[0] != nodes[1] and nodes[:2] == nodes[2:], nodes
        assert fleet.infer_reply("classifier", inputs).error is None  # the first caller too
        end = time.monotonic() + 60
        while fleet.status().callers < 2:
            assert time.monotonic() < end, "the second caller never fetched the fleet view"
            time.sleep(0.2)
    finally:
        rr.close()
    with pytest.raises(ConfigError, match="router.placement.*unknown picker 'first'"):
        fleet.with_placement(picker="first")
    status = fleet.status()
    assert "picker: near_best" in status.placement
    assert status.router.get("completed", 0) >= 5  # both callers' answers are counted


def test_large_inputs_travel_by_object_reference_and_are_answered(make_fleet, tmp_path):
    fleet = make_fleet(
        {
            "models": {"detector": {"path": "detector.onnx"}},
            "router": {"record_dir": str(tmp_path)},
        }
    )
    big = {"images": np.random.default_rng(0).random((3, 3, 400, 400), dtype=np.float32)}
    assert big["images"].nbytes > 1024 * 1024  # over the client's by-reference size
    small = {"images": big["images"][:, :, :64, :64].copy()}
    for inputs in (big, small):
        sync = fleet.infer("detector", inputs)
        (piped,) = FleetClient.gather([fleet.submit("detector", inputs)], 60)
        assert piped.error is None
        assert sync["scores"].shape == (3, 5)
        np.testing.assert_allclose(sync["scores"], piped.outputs["scores"], rtol=1e-5)
    fleet.close()  # writes out the call record
    (record,) = tmp_path.glob("*.jsonl")
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [line["rows"] for line in lines] == [3, 3, 3, 3]  # by reference too


@ray.remote
class _Echo:
    """A stand-in node actor: answers, raises, or dies when asked."""

    def infer(self, request, inputs=None):
        if request == "raise":
            raise ValueError("bad request")
        if request == "die":
            import os

            os._exit(1)
        return f"reply to {request}"


def test_node_handle_futures_carry_replies_errors_and_node_loss(ray_session):
    from cluster.dispatch import NodeGone
    from cluster.names import NAMESPACE
    from cluster.nodes import RayNode

    name = f"echo-{time.monotonic_ns()}"
    actor = _Echo.options(name=name, namespace=NAMESPACE).remote()
    node = RayNode(name, NAMESPACE, actor)
    assert node.infer("a").result(timeout=60) == "reply to a"
    with pytest.raises(ValueError, match="bad request"):  # the actor's own error
        node.infer("raise").result(timeout=60)
    with pytest.raises(NodeGone):
        node.infer("die").result(timeout=60)
    with pytest.raises(NodeGone):  # asked again: gone at the lookup or at the call
        node.infer("b").result(timeout=60)


def test_node_handle_waits_for_many_calls_on_the_callers_thread(ray_session):
    """send/wait, as Dispatcher.pipeline uses them: replies read together, the actor's
    own error and the node's loss each told for its own call."""
    from cluster.dispatch import NodeGone
    from cluster.names import NAMESPACE
    from cluster.nodes import RayNode

    name = f"echo-{time.monotonic_ns()}"
    actor = _Echo.options(name=name, namespace=NAMESPACE).remote()
    node = RayNode(name, NAMESPACE, actor)
    calls = {node.send(r): r for r in ("a", "b", "raise", "c")}
    answers: dict[str, object] = {}
    left = list(calls)
    while left:
        for call, answer in node.wait(left, 60):
            answers[calls[call]] = answer
            left.remove(call)
    assert answers["a"] == "reply to a" and answers["c"] == "reply to c"
    assert isinstance(answers["raise"], ValueError)
    died = node.send("die")
    ((call, answer),) = node.wait([died], 60)
    assert call is died and isinstance(answer, NodeGone)
    with pytest.raises(NodeGone):  # looked up again by name: no such actor any more
        for _, answer in node.wait([node.send("d")], 60):
            raise answer  # type: ignore[misc]
