"""Generation without Ray: sampling, request checks, KV caches and the KV store, and the
router over in-process nodes running the generated tiny LM (spill, session affinity,
continuation on another node after a node loss)."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from actors.decoder import DecoderEngine, Generation, KVCache, check_generation, sample
from actors.generations import NodeGenerations
from actors.kvstore import KVStore, prefix_key, session_key
from actors.node import NodeRuntime
from cluster.client import TokenStream
from edgefleet.clock import FakeClock
from edgefleet.config import parse_config
from edgefleet.errors import InvalidInput, ModelNotFound, NodeLost, TimedOut
from edgefleet.messages import GenerationResult, NodeState, TokenChunk
from edgefleet.modelgen import TINY_LM_VOCAB, make_tiny_lm
from edgefleet.request import GenerateRequest, Request
from tests.fakes import LocalFleet, fake_spec


def test_sampling_is_greedy_at_zero_and_seeded_otherwise():
    logits = np.array([0.1, 3.0, 2.9, -1.0], dtype=np.float32)
    assert sample(logits, 0.0, 0, None) == 1
    draws = [sample(logits, 1.0, 2, np.random.default_rng(s)) for s in range(200)]
    assert set(draws) == {1, 2}  # top-k 2 never picks the others
    again = [sample(logits, 1.0, 2, np.random.default_rng(s)) for s in range(200)]
    assert draws == again
    assert sample(logits, 5.0, 1, np.random.default_rng(0)) == 1  # top-1 is greedy


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"prompt_ids": ()}, "non-empty"),
        ({"prompt_ids": (1, "a")}, "int token ids"),
        ({"prompt_ids": (1, 64)}, "outside the vocabulary"),
        ({"prompt_ids": tuple(range(10))}, "does not fit the context"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"prefix_len": 5}, "prefix_len"),
        ({"temperature": -1.0}, "temperature"),
    ],
)
def test_check_generation_names_the_problem(changes, message):
    request = GenerateRequest("lm", **{"prompt_ids": (1, 2, 3), **changes})
    with pytest.raises(InvalidInput, match=message):
        check_generation(request, vocab=64, max_context=10, max_new_tokens=100)


def test_end_reasons():
    def gen(tokens, **kw):
        g = Generation(
            GenerateRequest("lm", (1, 2), **kw), limit=kw.get("max_new_tokens", 64), emit=print
        )
        g.tokens += tokens
        return g

    assert gen([]).end_reason() is None
    assert gen([7], stop_ids=(7,)).end_reason() == "stop"
    assert Generation(GenerateRequest("lm", (7,), stop_ids=(7,)), 5, print).end_reason() is None
    assert gen([3, 4], max_new_tokens=2).end_reason() == "length"
    g = gen([3, 4], max_new_tokens=8)
    g.limit = 2
    assert g.end_reason() == "budget"
    g = gen([3], max_new_tokens=8)
    g.max_context = 3
    assert g.end_reason() == "length"


def _cache(length: int) -> KVCache:
    a = np.arange(2 * length * 3, dtype=np.float32).reshape(1, 2, length, 3)
    return KVCache((a, a + 1), length)


def test_kv_cache_prefix_copies_and_accounts():
    cache = _cache(10)
    short = cache.prefix(4)
    assert short is not None and short.length == 4 and short.arrays[0].flags.c_contiguous
    assert short.nbytes == cache.bytes_for(4) == cache.nbytes * 4 // 10
    assert not np.shares_memory(short.arrays[0], cache.arrays[0])
    assert cache.prefix(0) is None and cache.prefix(10) is cache


def test_kv_store_prefers_the_longest_match_and_keeps_one_token_to_feed():
    store = KVStore()
    store.put(session_key("lm", "s"), "lm", [1, 2, 3, 4, 5, 6], _cache(5), now=1.0)
    store.put(prefix_key("lm", [1, 2]), "lm", [1, 2], _cache(2), now=2.0)
    cache, n = store.lookup("lm", [1, 2, 3, 9], session="s", prefix_len=2, now=3.0)
    assert n == 3 and cache is not None and cache.length == 3
    cache, n = store.lookup("lm", [1, 2, 3], session="s", prefix_len=0, now=3.0)
    assert n == 2  # the whole prompt is cached, but its last token must be fed
    assert store.lookup("lm", [1, 2, 3], session="other", prefix_len=0, now=3.0) == (None, 0)
    assert store.lookup("lm", [1, 2, 8], session=None, prefix_len=2, now=4.0)[1] == 2
    assert store.sessions() == ["s"]
    assert [v.id for v in sorted(store.views(), key=lambda v: v.last_used)] == [
        session_key("lm", "s"),
        prefix_key("lm", [1, 2]),
    ]


# ------------------------------------------------------- placement over nodes


@pytest.fixture(scope="module")
def lm_path(tmp_path_factory) -> Path:
    return make_tiny_lm(tmp_path_factory.mktemp("lm") / "lm.onnx")


@pytest.fixture
def lm_fleet(lm_path):
    made = []

    def make(names=("a", "b"), **router):
        config = parse_config(
            {
                "fleet": {"name": "g"},
                "models": {"lm": {"path": str(lm_path), "kind": "decoder"}},
                "nodes": [{"name": n} for n in names],
                "router": {"report_interval_s": 0.02, "lost_after_s": 0.5, **router},
            },
            lm_path.parent,
        )
        f = LocalFleet(config, NodeRuntime)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def collect(fleet, request, on_chunk=None):
    tokens, result = [], None
    for item in fleet.dispatcher.stream(request):
        if isinstance(item, TokenChunk):
            tokens.extend(item.tokens)
            if on_chunk:
                on_chunk(tokens)
        else:
            result = item
    return tokens, result


def node_killer(fleet, after=20):
    """A stream callback that kills the node generating once ``after`` tokens came,
    and the list that then holds its name."""
    victim: list[str] = []

    def kill(sent):
        if len(sent) >= after and not victim:
            handle = next(h for h in fleet.handles.values() if h.node._gens.live)
            handle.dead = True
            victim.append(handle.node.spec.name)

    return victim, kill


def reference(lm_path: Path, prompt, n):
    gen = Generation(GenerateRequest("lm", prompt, max_new_tokens=n), n, emit=lambda t: None)
    DecoderEngine("lm", lm_path).advance(gen)
    return gen.generated


def test_streams_spill_and_continue_after_node_loss(lm_path, lm_fleet):
    f = lm_fleet()
    prompt = tuple(range(5, 25))
    expected = reference(lm_path, prompt, 300)

    tokens, result = collect(f, GenerateRequest("lm", prompt, max_new_tokens=300))
    assert tokens == expected == list(result.tokens) and result.finish_reason == "length"

    for name in ("a", "b"):  # both refuse
        f.run(f.node(name).drain())
    tokens, result = collect(f, GenerateRequest("lm", prompt, max_new_tokens=5))
    assert result.error is not None and "refused" in str(result.error)
    for name in ("a", "b"):  # back in service
        f.node(name)._sched.draining = False
        f.node(name)._state = NodeState.SERVING
    f.refresh()

    victim, kill_after_some = node_killer(f)
    tokens, result = collect(f, GenerateRequest("lm", prompt, max_new_tokens=300), kill_after_some)
    assert victim and result.node != victim[0]
    assert tokens == expected == list(result.tokens)  # each token once, none lost
    assert f.counters()["replaced"] >= 1

    _, missing = collect(f, GenerateRequest("nope", prompt))
    assert isinstance(missing.error, ModelNotFound)


def test_a_stream_whose_node_freezes_goes_on_elsewhere_with_each_token_once(lm_path, lm_fleet):
    f = lm_fleet(probe_timeout_s=0.2, call_grace_s=0.3)
    prompt = tuple(range(5, 25))
    expected = reference(lm_path, prompt, 300)
    frozen: list[str] = []

    def freeze(sent):
        if len(sent) >= 20 and not frozen:
            handle = next(h for h in f.handles.values() if h.node._gens.live)
            handle.frozen = True  # a stopped process: no token, no answer to a probe
            frozen.append(handle.node.spec.name)

    try:
        tokens, result = collect(f, GenerateRequest("lm", prompt, max_new_tokens=300), freeze)
    finally:
        for h in f.handles.values():
            h.frozen = False
    assert frozen and result.node != frozen[0] and result.error is None
    assert tokens == expected == list(result.tokens)  # each token once, none lost
    assert f.dispatcher.counted()["replaced"] == 1


def test_an_at_most_once_generation_ends_node_lost_with_its_tokens_when_its_node_dies(
    lm_path, lm_fleet
):
    f = lm_fleet()
    prompt = tuple(range(5, 25))
    victim, kill_after_some = node_killer(f)
    request = GenerateRequest("lm", prompt, max_new_tokens=300, at_most_once=True)
    tokens, result = collect(f, request, kill_after_some)
    assert victim and isinstance(result.error, NodeLost) and "may have run" in str(result.error)
    assert tokens == list(result.tokens) == reference(lm_path, prompt, 300)[: len(tokens)]
    survivor = next(n for n in ("a", "b") if n != victim[0])
    assert f.node(survivor).status().counters["received"] == 0  # not continued there


def test_a_continuation_after_node_loss_keeps_the_budget_and_the_sampling_stream(lm_path, lm_fleet):
    f = lm_fleet()
    prompt = tuple(range(5, 25))
    for name in ("a", "b"):  # both devices in the background: background gets 1/4
        f.node(name).set_lifecycle("background")
    f.refresh()
    sampled = {"temperature": 1.0, "top_k": 8, "seed": 11}
    alone, _ = collect(f, GenerateRequest("lm", prompt, 200, priority=3, **sampled))
    assert len(alone) == 50  # the budget: a quarter of 200

    victim, kill_after_some = node_killer(f)
    tokens, result = collect(
        f, GenerateRequest("lm", prompt, 200, priority=3, **sampled), kill_after_some
    )
    assert victim and result.node != victim[0]
    assert tokens == alone and result.finish_reason == "budget"


def test_a_session_goes_back_to_the_node_holding_its_kv(lm_fleet):
    f = lm_fleet(("a", "b", "c"))
    prompt = tuple(range(5, 25))
    out, first = collect(f, GenerateRequest("lm", prompt, 8, session="chat"))
    f.refresh()  # a status report names the session
    for turn in range(3):
        prompt = (*prompt, *out, 1, 2, 3)
        out, result = collect(f, GenerateRequest("lm", prompt, 8, session="chat"))
        assert result.node == first.node, turn
        assert result.reused_tokens > 0


def test_a_stream_closed_early_stops_the_generation_and_frees_the_node(lm_fleet):
    f = lm_fleet(("a",))
    stream = f.dispatcher.stream(GenerateRequest("lm", tuple(range(5, 25)), 400))
    assert isinstance(next(stream), TokenChunk)
    stream.close()
    end = time.monotonic() + 30
    while f.node("a")._gens.live and time.monotonic() < end:
        time.sleep(0.01)
    assert not f.node("a")._gens.live
    assert not any(v.work for v in f.dispatcher.views())


def test_a_stream_whose_node_handle_breaks_ends_with_a_typed_error(lm_fleet):
    f = lm_fleet(("a",))
    handle = f.handles["a"]
    streamed = handle.generate

    def broken(request, wait_s=None):  # not a node death: e.g. an item Ray could not fetch
        items = streamed(request, wait_s)
        yield next(items)
        items.close()
        raise RuntimeError("object lost")

    handle.generate = broken  # type: ignore[method-assign]
    request = GenerateRequest("lm", tuple(range(5, 25)), 400)
    stream = TokenStream(request.id, f.dispatcher.stream(request))
    with pytest.raises(NodeLost, match="object lost"):
        stream.collect()
    assert stream.tokens and stream.result is not None
    assert stream.result.tokens == tuple(stream.tokens)  # what was sent, each once
    assert not any(v.work for v in f.dispatcher.views())  # no longer in flight anywhere


def test_a_generation_still_streaming_at_its_timeout_ends_timed_out(lm_fleet):
    # A node that keeps sending tokens, slowly (one that was frozen, say, and runs
    # again): timeout_s bounds the whole generation, not only a silence.
    f = lm_fleet(("a",))
    handle = f.handles["a"]
    streamed = handle.generate

    def slow(request, wait_s=None):
        for item in streamed(request, wait_s):
            time.sleep(0.2)
            yield item

    handle.generate = slow  # type: ignore[method-assign]
    request = GenerateRequest("lm", tuple(range(5, 25)), 60)
    started = time.monotonic()
    stream = TokenStream(request.id, f.dispatcher.stream(request, timeout_s=0.5))
    with pytest.raises(TimedOut):
        stream.collect()
    assert time.monotonic() - started < 1.0
    assert stream.result is not None and stream.result.tokens == tuple(stream.tokens)


def test_a_silent_generation_ends_timed_out_when_its_timeout_passes(lm_fleet):
    f = lm_fleet(("a",))
    f.handles["a"].frozen = True  # nothing comes: the stream waits in slices
    request = GenerateRequest("lm", tuple(range(5, 25)), 8)
    started = time.monotonic()
    stream = TokenStream(request.id, f.dispatcher.stream(request, timeout_s=0.3))
    with pytest.raises(TimedOut):
        stream.collect()
    assert time.monotonic() - started < 0.6  # not at the end of a second's wait
    f.handles["a"].frozen = False


def test_generation_result_unwrap():
    ok = GenerationResult("r", "n", (1, 2), finish_reason="length")
    assert ok.unwrap() == (1, 2)
    with pytest.raises(InvalidInput):
        GenerationResult("r", "n", error=InvalidInput("bad")).unwrap()


def test_chunked_prefill_stops_between_chunks_and_keeps_the_output(lm_path):
    prompt = tuple(range(1, 40))
    expected = reference(lm_path, prompt, 20)  # the whole prompt in one call
    engine = DecoderEngine("lm", lm_path, prefill_chunk=8)
    gen = Generation(GenerateRequest("lm", prompt, max_new_tokens=20), 20, emit=lambda t: None)
    assert engine.step(gen) is None and gen.cache.length == 8  # one chunk, no token yet
    stop = threading.Event()
    stop.set()
    assert engine.advance(gen, stop) is None and gen.cache.length == 8  # paused between
    assert engine.step(gen) is None and gen.cache.length == 16
    assert engine.advance(gen) == "length"
    assert gen.generated == expected
    assert gen.fed == len(prompt) + 19


def test_a_pause_aborts_a_prefill_in_progress_and_loses_nothing(tmp_path):
    path = make_tiny_lm(tmp_path / "wide.onnx", layers=4, heads=8, head_dim=64)
    engine = DecoderEngine("wide", path)
    prompt = tuple(1 + i % 500 for i in range(480))
    gen = Generation(GenerateRequest("wide", prompt, max_new_tokens=3), 3, emit=lambda t: None)
    stop = threading.Event()
    stop.set()
    assert engine.advance(gen, stop) is None and gen.fed == 0  # stopped before starting

    stop.clear()
    result: list[str | None] = []
    worker = threading.Thread(target=lambda: result.append(engine.advance(gen, stop)))
    worker.start()
    while engine._prefilling is None and worker.is_alive():
        pass  # wait until the prefill call is in ONNX Runtime
    stop.set()
    engine.abort()
    worker.join(10)
    assert result == [None] and gen.cache is None and gen.generated == []
    assert engine.advance(gen) == "length"  # resumes with a whole prefill
    fresh = Generation(GenerateRequest("wide", prompt, max_new_tokens=3), 3, emit=lambda t: None)
    engine.advance(fresh)
    assert gen.generated == fresh.generated


def test_status_table_shows_lifecycle_paused_work_and_kv():
    from cluster.cli.tables import status_table
    from edgefleet.messages import FleetStatus, NodeStatus

    kv = {"paused": 3 << 20, "cached": 1 << 20}
    node = NodeStatus(
        "edge-1", "serving", {}, 0, None, (), paused={3: 1}, lifecycle="background", kv_bytes=kv
    )
    quiet = NodeStatus("edge-0", "serving", {}, 0, None, ())
    table = status_table(FleetStatus("f", (quiet, node), {"edge-0": True, "edge-1": True}))
    assert "lifecycle background; paused 3:1; KV cache 4.0 MiB" in table
    assert table.count("lifecycle") == 1  # a node with nothing to say gets no extra line


@pytest.mark.parametrize("where", ["generation_config.json", "config.json"])
def test_generations_stop_at_the_models_eos_token_by_default(tmp_path, where):
    lm = make_tiny_lm(tmp_path / "lm.onnx")
    prompt = tuple(range(5, 25))
    free = reference(lm, prompt, 30)
    eos = free[6]
    first = free.index(eos)
    (tmp_path / where).write_text(json.dumps({"eos_token_id": [TINY_LM_VOCAB + 7, eos]}))

    def fleet(**generation):
        config = parse_config(
            {
                "fleet": {"name": "g"},
                "models": {"lm": {"path": "lm.onnx", "kind": "decoder", "generation": generation}},
                "nodes": [{"name": "a"}],
            },
            tmp_path,
        )
        return LocalFleet(config, NodeRuntime)

    f = fleet()
    try:
        tokens, result = collect(f, GenerateRequest("lm", prompt, 30))
        assert tokens == free[: first + 1] and result.finish_reason == "stop"
        other = free[first + 3]  # a request's own stop ids replace the model's
        tokens, result = collect(f, GenerateRequest("lm", prompt, 30, stop_ids=(other,)))
        assert tokens == free[: free.index(other) + 1] and result.finish_reason == "stop"
    finally:
        f.close()
    f = fleet(stop_ids=[TINY_LM_VOCAB + 1])  # so do the config's
    try:
        tokens, result = collect(f, GenerateRequest("lm", prompt, 30))
        assert tokens == free and result.finish_reason == "length"
    finally:
        f.close()


def test_the_kv_budget_counts_the_running_generations_caches():
    # Budget: 240 bytes a token x 100 tokens. A paused generation holds 60 tokens; a
    # running one holds 30 and may grow to 30 + 20 more: 110 tokens in all, over budget,
    # so the paused cache gives way (it shares no prefix to keep: nothing is left).
    token_bytes = _cache(1).nbytes
    spec = fake_spec().model_copy(update={"kv_budget_mb": 100 * token_bytes / (1024 * 1024)})
    counters: Counter[str] = Counter()
    gens = NodeGenerations(spec, FakeClock(), counters)

    def live(rid: str, first: int, prompt_len: int, cached: int, max_new: int) -> Generation:
        prompt = tuple(range(first, first + prompt_len))
        request = GenerateRequest("m", prompt, max_new_tokens=max_new)
        g = Generation(request, max_new, print)
        g.cache = _cache(cached)
        gens.live[rid] = g
        return g

    paused = live("p", 1, 60, 60, 10)
    running = live("r", 100, 30, 30, 20)  # shares no prefix with the paused one
    parked = Request("p", "m", {}, priority=3, arrival=0.0)
    gens.release([parked])
    assert paused.cache is not None  # alone, 60 + 0 tokens fit
    gens.release([parked], running=[running])
    assert paused.cache is None and counters["kv_trimmed"] + counters["kv_dropped"] == 1
    assert gens.kv_bytes([], running=[running])["running"] == running.cache.nbytes
