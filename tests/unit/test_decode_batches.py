"""Generations of one decoder decode together: the scheduler forms decode batches of one
priority, lets arrivals join at token boundaries and never lets lower priorities in; the
node runs them on a real ONNX Runtime decoder (the Optimum layout, and ONNX Runtime
GenAI's), token-identical to each alone."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from actors.decoder import DecoderEngine, Generation
from actors.node import BULK_STREAM_INTERVAL_S, NodeRuntime
from actors.scheduler import LocalScheduler, ModelRules
from edgefleet.clock import FakeClock
from edgefleet.config import parse_config
from edgefleet.messages import GenerationResult
from edgefleet.modelgen import make_genai_lm, make_tiny_lm
from edgefleet.request import GenerateRequest, Request, RequestState
from policies import PreemptionParams, PriorityOrder, QueueLimits
from tests.fakes import LocalFleet

S = RequestState


def scheduler(decode_rows: int = 4) -> LocalScheduler:
    return LocalScheduler(
        clock=FakeClock(100.0),
        limits=QueueLimits(16, 10_000),
        order=PriorityOrder(),
        preemption=PreemptionParams(True, 5),
        rules={"lm": ModelRules(decode_rows=decode_rows)},
    )


def gen(rid: str, priority: int = 3, model: str = "lm") -> Request:
    return Request(
        id=rid, model=model, inputs={}, priority=priority, arrival=0.0, group=rid, pausable=True
    )


def ids(plan) -> list[str]:
    return [r.id for r in plan.requests]


def test_generations_of_one_model_and_priority_decode_together_up_to_the_limit():
    s = scheduler(decode_rows=3)
    for rid, priority, model in [
        ("a", 3, "lm"),
        ("low", 0, "lm"),  # lower priority: would slow every token of the others
        ("b", 3, "lm"),
        ("other", 3, "lm2"),  # another model
        ("c", 3, "lm"),
        ("d", 3, "lm"),  # over the limit
    ]:
        assert s.admit(gen(rid, priority, model)).accepted
    plan = s.next_work().plan
    assert ids(plan) == ["a", "b", "c"] and all(r.state is S.RUNNING for r in plan.requests)


def test_one_at_a_time_when_the_model_decodes_alone():
    s = scheduler(decode_rows=1)
    s.admit(gen("a"))
    s.admit(gen("b"))
    assert ids(s.next_work().plan) == ["a"]


def test_an_arrival_joins_at_a_token_boundary_and_a_regroup_is_no_preemption():
    s = scheduler()
    s.admit(gen("a"))
    s.admit(gen("b"))
    plan = s.next_work().plan
    joining = s.admit(gen("c"))
    assert joining.accepted and joining.join and not joining.preempt
    assert not s.admit(gen("low", 0)).join  # another priority never joins
    # The call stops at a token boundary; "b" finished meanwhile, "a" is paused.
    outcomes = s.finish(plan, paused=["a"], preempted=False)
    assert [(o.request.id, o.state) for o in outcomes] == [("b", S.COMPLETED)]
    regrouped = s.next_work().plan
    assert ids(regrouped) == ["a", "c"]
    assert regrouped.requests[0].preemptions == 0


def test_a_full_decode_takes_no_joiner_and_an_urgent_arrival_preempts_all():
    s = scheduler(decode_rows=2)
    s.admit(gen("a"))
    s.admit(gen("b"))
    plan = s.next_work().plan
    assert not s.admit(gen("c")).join  # no room: it waits its turn
    urgent = s.admit(gen("fg", 10))
    assert urgent.preempt and not urgent.join
    s.finish(plan, paused=True)
    assert ids(s.next_work().plan) == ["fg"]  # alone: lower generations do not join it
    assert {r.id: r.preemptions for r in plan.requests} == {"a": 1, "b": 1}


# ------------------------------------------------------------- on a real decoder


@pytest.fixture(scope="module")
def lm_path(tmp_path_factory) -> Path:
    return make_tiny_lm(tmp_path_factory.mktemp("lm") / "lm.onnx")


def alone(path: Path, prompt: tuple[int, ...], n: int) -> list[int]:
    g = Generation(GenerateRequest("lm", prompt, max_new_tokens=n), n, emit=lambda t: None)
    DecoderEngine("lm", path).advance(g)
    return g.generated


async def generate(node: NodeRuntime, request: GenerateRequest) -> GenerationResult:
    async for item in node.generate(request):
        if isinstance(item, GenerationResult):
            return item
    raise AssertionError("no result")


@pytest.fixture(scope="module")
def genai_path(tmp_path_factory) -> Path:
    """A GenAI folder: GroupQueryAttention, no position_ids, caches padded on the right."""
    return make_genai_lm(tmp_path_factory.mktemp("genai") / "llama-tiny")


def serving(path: Path):
    """One node serving the decoder at ``path`` (no Ray), and the fleet around it."""
    config = parse_config(
        {
            "fleet": {"name": "d"},
            "models": {"lm": {"path": str(path), "kind": "decoder"}},
            "nodes": [{"name": "a"}],
        },
        path.parent,
    )
    fleet = LocalFleet(config, NodeRuntime)
    yield fleet, fleet.node("a")
    fleet.close()


@pytest.fixture
def lm_node(lm_path):
    yield from serving(lm_path)


@pytest.fixture
def genai_node(genai_path):
    yield from serving(genai_path)


@pytest.mark.parametrize("model", ["lm", "genai"])
def test_concurrent_generations_decode_together_token_identical_to_each_alone(request, model):
    lm_path = request.getfixturevalue(f"{model}_path")
    fleet, node = request.getfixturevalue(f"{model}_node")
    prompts = [tuple(range(5 + i, 25 + 3 * i)) for i in range(4)]
    lengths = [120, 90, 150, 60]  # rows leave at different tokens

    async def together() -> list[GenerationResult]:
        requests = [
            GenerateRequest("lm", p, max_new_tokens=n, priority=3)
            for p, n in zip(prompts, lengths, strict=True)
        ]
        return await asyncio.gather(*(generate(node, r) for r in requests))

    results = fleet.run(together())
    for result, prompt, n in zip(results, prompts, lengths, strict=True):
        assert result.error is None and list(result.tokens) == alone(lm_path, prompt, n)
    # Decoded together: every generation made tokens while each other one did.
    spans = [(r.arrival + r.token_times[0], r.arrival + r.token_times[-1]) for r in results]
    assert max(first for first, _ in spans) < min(last for _, last in spans)
    counters = node.status().counters
    assert counters["preemptions"] == 0 and counters["tokens"] == sum(lengths)


def test_bulk_generations_stream_in_fewer_larger_chunks(lm_node):
    # Background work (one the foreground may preempt) is not waiting on each token:
    # its tokens travel in chunks at least BULK_STREAM_INTERVAL_S apart.
    fleet, node = lm_node

    async def chunks(priority: int) -> tuple[int, float, GenerationResult]:
        n, t0, result = 0, loop_time(), None
        request = GenerateRequest("lm", tuple(range(5, 25)), max_new_tokens=400, priority=priority)
        async for item in node.generate(request):
            if isinstance(item, GenerationResult):
                result = item
            else:
                n += 1
        assert result is not None and result.error is None
        return n, loop_time() - t0, result

    n, seconds, result = fleet.run(chunks(3))
    assert len(result.tokens) == 400
    assert n <= 2 + seconds / BULK_STREAM_INTERVAL_S, (n, seconds)


def loop_time() -> float:
    return asyncio.get_running_loop().time()
