"""Batched decode in the engine: several generations share each model call, and each
one's tokens, cache and accounting stay those of decoding it alone. Real ONNX Runtime
on tiny LMs generated into a temporary directory: the Optimum layout (multi-head and
grouped-query, with position_ids, caches left-padded) and ONNX Runtime GenAI's
(GroupQueryAttention, no position_ids, caches right-padded)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from actors.decoder import DecoderEngine, Generation, KVCache, _Batch
from edgefleet.modelgen import make_genai_lm, make_tiny_lm
from edgefleet.request import GenerateRequest

# Prompt lengths and token counts differ so rows are padded and leave at different times.
SHAPES = ((5, 40), (17, 24), (33, 48), (9, 31))


def make_model(kind: str, directory: Path) -> Path:
    if kind == "genai":
        return make_genai_lm(directory / "genai")
    if kind == "gqa":
        return make_tiny_lm(directory / "gqa.onnx", heads=4, kv_heads=2)
    return make_tiny_lm(directory / "lm.onnx")


@pytest.fixture(scope="module", params=["mha", "gqa", "genai"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(request.param, tmp_path_factory.mktemp("lm"))


@pytest.fixture(scope="module", params=["mha", "gqa"])
def optimum_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(request.param, tmp_path_factory.mktemp("lm"))


@pytest.fixture(scope="module")
def genai_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model("genai", tmp_path_factory.mktemp("lm"))


class CallLog:
    """Wraps an engine's session to record the batch size of every model call."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.rows: list[int] = []

    def run(self, outputs: Any, feed: dict[str, np.ndarray], *args: Any) -> Any:
        self.rows.append(int(feed["input_ids"].shape[0]))
        return self.session.run(outputs, feed, *args)


def logged(engine: DecoderEngine) -> CallLog:
    log = CallLog(engine._session)
    engine._session = log  # type: ignore[assignment]
    return log


def requests(**kw: Any) -> list[GenerateRequest]:
    rng = np.random.default_rng(3)
    return [
        GenerateRequest("lm", tuple(int(t) for t in rng.integers(1, 500, n)), m, **kw)
        for n, m in SHAPES
    ]


def gen(request: GenerateRequest, emit: Callable[[int], None] | None = None) -> Generation:
    return Generation(request, request.max_new_tokens, emit or (lambda t: None))


def alone(engine: DecoderEngine, reqs: Sequence[GenerateRequest]) -> list[Generation]:
    gens = [gen(r) for r in reqs]
    for g in gens:
        assert engine.advance(g) is not None
    return gens


def test_batched_greedy_decode_is_token_identical_to_each_alone(model: Path) -> None:
    engine = DecoderEngine("lm", model)
    reqs = requests()
    expected = alone(engine, reqs)
    # One generation ends on a stop token and one on its token budget, mid-batch.
    stop_at = expected[2].generated[11]
    reqs[2] = GenerateRequest("lm", reqs[2].prompt_ids, reqs[2].max_new_tokens, stop_ids=(stop_at,))
    gens = [gen(r) for r in reqs]
    gens[3].limit = 13
    emitted: list[list[int]] = [[] for _ in gens]
    for g, sink in zip(gens, emitted, strict=True):
        g.emit = sink.append
    log = logged(engine)

    t0 = time.perf_counter()
    reasons = engine.advance_batch(gens)
    wall = time.perf_counter() - t0

    cut = expected[2].generated.index(stop_at) + 1
    assert reasons == {
        reqs[0].id: "length",
        reqs[1].id: "length",
        reqs[2].id: "stop",
        reqs[3].id: "budget",
    }
    assert gens[0].generated == expected[0].generated
    assert gens[1].generated == expected[1].generated
    assert gens[2].generated == expected[2].generated[:cut]
    assert gens[3].generated == expected[3].generated[:13]
    assert [g.generated for g in gens] == emitted
    assert max(log.rows) == 4  # the four shared calls: batching did happen
    assert len(log.rows) < sum(len(g.generated) for g in gens) / 2
    for g, ref in zip(gens[:2], expected[:2], strict=True):
        # Each ends with its own unpadded cache, as decoding alone leaves it.
        assert g.cache is not None and ref.cache is not None
        assert g.cache.length == len(g.tokens) - 1 == ref.cache.length
        for a, b in zip(g.cache.arrays, ref.cache.arrays, strict=True):
            assert a.shape == b.shape and a.flags.c_contiguous
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
        assert g.fed == ref.fed == len(g.tokens) - 1
        assert g.engine_s > 0 and g.engine_cpu_s > 0
    # Shared calls are split among their rows: no second is counted twice.
    assert sum(g.engine_s for g in gens) <= wall


def test_a_stop_pauses_every_row_and_any_regrouping_resumes_identically(model: Path) -> None:
    engine = DecoderEngine("lm", model)
    reqs = requests()
    expected = alone(engine, reqs)
    stop = threading.Event()

    def stop_after(n: int) -> Callable[[int], None]:
        seen: list[int] = []

        def emit(token: int) -> None:
            seen.append(token)
            if len(seen) == n:
                stop.set()

        return emit

    gens = [gen(r) for r in reqs]
    gens[1].emit = stop_after(9)
    log = logged(engine)
    reasons = engine.advance_batch(gens, stop)
    assert set(reasons.values()) == {None}  # all paused at the same token boundary
    assert [len(g.generated) for g in gens] == [9] * 4
    assert max(log.rows) == 4
    for g in gens:
        assert g.cache is not None and g.cache.length == len(g.tokens) - 1

    stop.clear()
    gens[0].emit = stop_after(5)
    assert engine.advance_batch([gens[0], gens[2]], stop) == {reqs[0].id: None, reqs[2].id: None}
    assert len(gens[0].generated) == len(gens[2].generated) == 14
    stop.clear()
    assert engine.advance_batch([gens[2], gens[3], gens[0]]) == {
        r.id: "length" for r in (reqs[2], reqs[3], reqs[0])
    }
    assert engine.advance_batch([gens[1]]) == {reqs[1].id: "length"}  # one alone
    assert [g.generated for g in gens] == [g.generated for g in expected]


def test_sampled_generations_keep_their_own_seeded_streams(model: Path) -> None:
    engine = DecoderEngine("lm", model)
    reqs = [
        GenerateRequest("lm", r.prompt_ids, r.max_new_tokens, temperature=1.0, top_k=20, seed=i)
        for i, r in enumerate(requests())
    ]
    expected = alone(engine, reqs)
    gens = [gen(r) for r in reqs]
    log = logged(engine)
    engine.advance_batch(gens)
    assert max(log.rows) == 4
    assert [g.generated for g in gens] == [g.generated for g in expected]
    assert len({tuple(g.generated) for g in gens}) == 4


def test_a_generation_joining_later_decodes_identically(model: Path) -> None:
    engine = DecoderEngine("lm", model)
    reqs = requests()
    expected = alone(engine, reqs)
    gens = [gen(r) for r in reqs]
    stop = threading.Event()
    gens[0].emit = lambda t: stop.set() if len(gens[0].generated) == 7 else None
    engine.advance_batch(gens[:3], stop)
    assert [len(g.generated) for g in gens] == [7, 7, 7, 0]

    log = logged(engine)
    reasons = engine.advance_batch(gens)  # the fourth joins; it is prefilled first
    assert set(reasons.values()) == {"length"}
    assert log.rows[0] == 1 and max(log.rows) == 4
    assert [g.generated for g in gens] == [g.generated for g in expected]


def test_trimmed_and_dropped_caches_are_rebuilt_in_chunks_before_joining(model: Path) -> None:
    engine = DecoderEngine("lm", model, prefill_chunk=8)
    reqs = requests()
    expected = alone(engine, reqs)
    gens = [gen(r) for r in reqs]
    stop = threading.Event()
    gens[0].emit = lambda t: stop.set() if len(gens[0].generated) == 6 else None
    assert set(engine.advance_batch(gens, stop).values()) == {None}
    # A prompt fed in chunks leaves its last token to the first shared call.
    assert [len(g.generated) for g in gens] == [6, 5, 5, 5]
    stop.clear()
    # What a node does past its KV budget: trim a paused cache to a prefix, or drop it.
    assert gens[1].cache is not None and gens[2].cache is not None
    gens[1].cache = gens[1].cache.prefix(10)
    gens[2].cache = None
    log = logged(engine)
    assert set(engine.advance_batch(gens).values()) == {"length"}
    # The rebuilds alone, in chunks of 8 (12 tokens in 2 calls, 38 in 5), then together.
    assert log.rows[:8] == [1] * 7 + [4]
    assert [g.generated for g in gens] == [g.generated for g in expected]


def test_a_model_that_cannot_batch_takes_turns_with_the_same_output(model: Path) -> None:
    engine = DecoderEngine("lm", model)
    assert engine.batchable_decode
    reqs = requests()
    expected = alone(engine, reqs)
    engine.exact_grouping = True  # as for a dynamically quantized model
    assert not engine.batchable_decode
    gens = [gen(r) for r in reqs]
    log = logged(engine)
    assert set(engine.advance_batch(gens).values()) == {"length"}
    assert set(log.rows) == {1}
    assert [g.generated for g in gens] == [g.generated for g in expected]
    assert [g.fed for g in gens] == [g.fed for g in expected]


def without_position_ids(path: Path, out: Path) -> Path:
    """The tiny LM made to derive positions from its past length, as some exports do:
    no position_ids input, so left padding would shift every padded row's positions."""
    model = onnx.load(str(path))
    graph = model.graph
    nodes = list(graph.node)
    embed = [n for n in nodes if n.output[0] in ("embed.positions", "embed.out")]
    for node in embed:
        nodes.remove(node)
    embed[0].input[1] = "mask.query_pos"  # positions past .. total - 1
    at = next(i for i, n in enumerate(nodes) if n.output[0] == "mask.query_pos") + 1
    nodes[at:at] = embed
    del graph.node[:]
    graph.node.extend(nodes)
    inputs = [i for i in graph.input if i.name != "position_ids"]
    del graph.input[:]
    graph.input.extend(inputs)
    onnx.checker.check_model(model)
    onnx.save(model, str(out))
    return out


def test_a_model_without_position_ids_takes_turns_with_the_same_output(
    optimum_model: Path, tmp_path: Path
) -> None:
    engine = DecoderEngine("lm", without_position_ids(optimum_model, tmp_path / "nopos.onnx"))
    assert not engine.batchable_decode and engine.batch_layout is None
    reqs = requests()
    expected = alone(DecoderEngine("lm", optimum_model), reqs)
    gens = [gen(r) for r in reqs]
    log = logged(engine)
    assert set(engine.advance_batch(gens).values()) == {"length"}
    assert set(log.rows) == {1}
    assert [g.generated for g in gens] == [g.generated for g in expected]


def test_advance_batch_refuses_two_generations_of_one_request(model: Path) -> None:
    engine = DecoderEngine("lm", model)
    request = requests()[0]
    with pytest.raises(ValueError, match="distinct request ids"):
        engine.advance_batch([gen(request), gen(request)])


# ------------------------------------------- GroupQueryAttention: caches padded on the right


def test_a_genai_model_decodes_together_right_padded(genai_model: Path) -> None:
    engine = DecoderEngine("lm", genai_model)
    assert "position_ids" not in engine.signature.input_names
    assert engine.batch_layout == "right" and engine.batchable_decode
    reqs = requests()
    expected = alone(engine, reqs)
    gens = [gen(r) for r in reqs]
    masks: list[np.ndarray] = []
    log = logged(engine)
    run = log.run

    def record(outputs: Any, feed: dict[str, np.ndarray], *args: Any) -> Any:
        masks.append(feed["attention_mask"])
        return run(outputs, feed, *args)

    log.run = record  # type: ignore[method-assign]
    assert set(engine.advance_batch(gens).values()) == {"length"}
    assert [g.generated for g in gens] == [g.generated for g in expected]
    # The first shared call: each row's mask covers its own cache (its prompt) and its
    # new token from column 0; the shortest rows are padded on the right.
    first = masks[log.rows.index(4)]
    assert first.shape == (4, 34) and first.sum(axis=1).tolist() == [6, 18, 34, 10]
    assert (first == (np.arange(34) < first.sum(axis=1)[:, None])).all()
    for g, ref in zip(gens, expected, strict=True):
        assert g.cache is not None and ref.cache is not None
        assert g.cache.length == ref.cache.length == len(g.tokens) - 1
        for a, b in zip(g.cache.arrays, ref.cache.arrays, strict=True):
            assert a.shape == b.shape and a.flags.c_contiguous
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_left_padding_gives_a_genai_model_other_tokens(genai_model: Path) -> None:
    """Why its caches go on the right: GroupQueryAttention reads a row's past from
    column 0, so padding on the left feeds it padding and drops its last keys."""
    engine = DecoderEngine("lm", genai_model)
    reqs = requests()
    expected = alone(engine, reqs)
    engine.batch_layout = "left"
    gens = [gen(r) for r in reqs]
    engine.advance_batch(gens)
    longest = max(range(4), key=lambda r: len(reqs[r].prompt_ids))
    # The longest row is never padded; every other one decodes wrong tokens.
    assert gens[longest].generated == expected[longest].generated
    assert all(gens[r].generated != expected[r].generated for r in range(4) if r != longest)


def test_a_genai_generation_joins_and_another_leaves_mid_batch(genai_model: Path) -> None:
    engine = DecoderEngine("lm", genai_model, prefill_chunk=8)
    reqs = requests()
    expected = alone(engine, reqs)
    gens = [gen(r) for r in reqs]
    gens[1].limit = 9  # leaves the batch at its 9th token, on its budget
    stop = threading.Event()
    gens[0].emit = lambda t: stop.set() if len(gens[0].generated) == 12 else None
    log = logged(engine)
    assert engine.advance_batch(gens[:3], stop) == {
        reqs[0].id: None,
        reqs[1].id: "budget",
        reqs[2].id: None,
    }
    assert max(log.rows) == 3 and log.rows[-1] == 2  # two rows on after one left
    stop.clear()
    gens[1].limit = reqs[1].max_new_tokens
    log.rows.clear()
    # The fourth joins (its prompt prefilled alone, in chunks), the second comes back.
    assert set(engine.advance_batch(gens).values()) == {"length"}
    assert log.rows[:2] == [1, 4]  # a prompt in chunks leaves its last token to the batch
    assert [g.generated for g in gens] == [g.generated for g in expected]


def test_right_padded_rows_leave_with_their_own_caches_and_the_rest_repack() -> None:
    def cache(length: int, fill: float) -> KVCache:
        arrays = tuple(
            np.full((1, 2, length, 16), fill + i, np.float32) + np.arange(length)[:, None]
            for i in range(2)
        )
        return KVCache(arrays, length)

    gens = []
    for n, fill in ((3, 10.0), (5, 20.0), (2, 30.0)):
        request = GenerateRequest("lm", tuple(range(1, n + 2)), 8)
        gens.append(Generation(request, 8, lambda t: None, cache=cache(n, fill)))
    caches = [g.cache for g in gens]
    batch = _Batch(gens, right=True)
    assert batch.width == 5 and batch.positions()[:, 0].tolist() == [3, 5, 2]
    assert batch.mask(np.dtype(np.int64)).tolist() == [
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0, 0],
    ]
    assert (batch.arrays[0][0, :, :3] == caches[0].arrays[0][0]).all()
    assert not batch.arrays[0][0, :, 3:].any() and not batch.arrays[1][2, :, 2:].any()
    # A call as GroupQueryAttention makes it: each row's new key right after its cache.
    grown = []
    for a in batch.arrays:
        out = np.zeros((3, 2, 6, 16), np.float32)
        out[:, :, :5] = a
        for row, n in enumerate((3, 5, 2)):
            out[row, :, n] = -1.0 - row
        grown.append(out)
    batch.grown(tuple(grown))
    for g in gens:
        g.tokens.append(0)
    (longest,) = batch.release([1])
    assert longest is gens[1] and gens[1].cache is not None and gens[1].cache.length == 6
    np.testing.assert_array_equal(gens[1].cache.arrays[1][0, :, :5], caches[1].arrays[1][0])
    assert (gens[1].cache.arrays[1][0, :, 5] == -2.0).all()
    # The longest row gone, the others keep 4 and 3 columns: the batch is 4 wide.
    assert batch.width == 4 and batch.arrays[0].shape == (2, 2, 4, 16)
    assert batch.lengths.tolist() == [4, 3]
    assert batch.mask(np.dtype(np.int64)).tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    left = batch.release(range(2))
    assert left == [gens[0], gens[2]]
    for g, before, row in ((gens[0], caches[0], 0), (gens[2], caches[2], 2)):
        assert g.cache is not None and g.cache.length == before.length + 1
        np.testing.assert_array_equal(g.cache.arrays[0][0, :, :-1], before.arrays[0][0])
        assert (g.cache.arrays[0][0, :, -1] == -1.0 - row).all()
