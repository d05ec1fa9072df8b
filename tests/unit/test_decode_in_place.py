"""Decode steps of a GroupQueryAttention graph (ONNX Runtime GenAI's layout) write the
new token's keys and values into a preallocated buffer in place, through ONNX Runtime's
IO binding, instead of copying the whole cache every token. Tokens and caches are
those of the copying path, bit for bit; caches that share a buffer never see each
other's writes; what the engine hands back holds no spare columns. Real ONNX Runtime
on generated GenAI folders (float32, and int4 with accuracy_level 4)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from actors import decoder
from actors.decoder import DecoderEngine, Generation, KVCache, mask_only_counts
from edgefleet.modelgen import make_genai_int4, make_genai_lm, make_tiny_lm
from edgefleet.request import GenerateRequest

PROMPT = tuple(range(3, 35))
native_calls = decoder._native_calls


@pytest.fixture(scope="module", params=["fp32", "int4"])
def genai(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("genai")
    path = make_genai_lm(root / "fp32")
    return path if request.param == "fp32" else make_genai_int4(path.parent, root / "int4")


def engines(path: Path) -> tuple[DecoderEngine, DecoderEngine]:
    """The engine, and one that copies the cache every step (the path before)."""
    copying = DecoderEngine("lm", path)
    copying._share_buffer = False
    return DecoderEngine("lm", path), copying


def generation(n: int, prompt: tuple[int, ...] = PROMPT) -> Generation:
    return Generation(GenerateRequest("lm", prompt, max_new_tokens=n), n, emit=lambda t: None)


def assert_same(a: KVCache | None, b: KVCache | None) -> None:
    assert a is not None and b is not None and a.length == b.length
    for x, y in zip(a.arrays, b.arrays, strict=True):
        np.testing.assert_array_equal(x, y)


def step_to_the_end(engine: DecoderEngine, gen: Generation) -> set[int]:
    """Step ``gen`` until it ends, each step in a decode buffer; the buffers' ids."""
    buffers = set()
    while gen.end_reason() is None:
        engine.step(gen)
        assert gen.cache is not None and gen.cache.buffer is not None
        buffers.add(id(gen.cache.buffer))
    return buffers


def assert_copied(copying: DecoderEngine, gen: Generation, expected: Generation) -> None:
    """``gen`` made the tokens and cache the copying path makes of ``expected``."""
    assert copying.advance(expected) == "length"
    assert gen.generated == expected.generated
    assert_same(gen.cache, expected.cache)


def test_decode_steps_write_in_place_and_match_the_copying_path(genai):
    in_place, copying = engines(genai)
    assert in_place._share_buffer
    gen, expected = generation(150), generation(150)
    in_place.step(gen)  # the prompt, in one call that makes the cache
    buffers = step_to_the_end(in_place, gen)
    assert_copied(copying, gen, expected)
    # One buffer holds the whole budget: the cache was copied once in 150 tokens.
    assert len(buffers) == 1


def test_a_budget_that_keeps_growing_copies_the_cache_a_few_times(genai):
    in_place, copying = engines(genai)
    gen, expected = generation(200), generation(200)
    gen.limit = 1
    in_place.advance(gen)  # the prompt, and one token
    buffers: set[int] = set()
    while gen.limit < 200:  # the budget grows by 2 tokens at a time
        gen.limit += 2
        buffers |= step_to_the_end(in_place, gen)
    assert_copied(copying, gen, expected)
    # Geometric growth: 2 or 3 buffers for 200 tokens after a 32-token prompt, not 150.
    assert len(buffers) <= 3


def test_caches_sharing_a_buffer_never_see_each_others_writes(genai):
    runs = {}
    for engine in engines(genai):  # in place, then copying: the same calls
        gen = generation(40)
        while len(gen.generated) < 10:
            engine.step(gen)
        fork = gen.cache
        assert fork is not None
        before = [a.copy() for a in fork.arrays]
        for _ in range(10):  # in place: writes the columns after the fork's, in its buffer
            engine.step(gen)
        # A second run from the fork, fed another token than the first: it must not
        # write its keys over the columns the first run's cache still views.
        other = generation(40)
        other.tokens, other.cache = [*gen.tokens[: fork.length], 7], fork
        assert engine.advance(other) == "length"
        assert engine.advance(gen) == "length"
        for a, b in zip(fork.arrays, before, strict=True):
            np.testing.assert_array_equal(a, b)
        runs[engine._share_buffer] = (gen, other, fork.buffer is not None)
    (gen, other, shared), (gen_copying, other_copying, _) = runs[True], runs[False]
    assert shared and gen.generated != other.generated
    for got, expected in ((gen, gen_copying), (other, other_copying)):
        assert got.generated == expected.generated
        assert_same(got.cache, expected.cache)


def test_the_engine_hands_back_caches_without_spare_columns(genai):
    in_place, copying = engines(genai)
    stop = threading.Event()
    paused = generation(40)
    paused.emit = lambda t: stop.set() if len(paused.generated) >= 5 else None
    assert in_place.advance(paused, stop) is None
    ended = [generation(20, PROMPT[:n]) for n in (9, 20)]
    in_place.advance_batch(ended)
    for gen in (paused, *ended):
        cache = gen.cache
        assert cache is not None and cache.buffer is None
        assert all(a.flags.c_contiguous and a.shape[2] == cache.length for a in cache.arrays)
    stop.clear()
    resumed = in_place.advance(paused)
    expected = generation(40)
    copying.advance(expected)
    assert resumed == "length" and paused.generated == expected.generated


def test_a_graph_that_refuses_shared_buffers_decodes_by_copying(genai, caplog, monkeypatch):
    in_place, copying = engines(genai)

    def refusing(session: object, binding: object) -> tuple[object, object]:
        bind, _ = native_calls(session, binding)

        def run() -> None:
            raise RuntimeError("shape mismatch")

        return bind, run

    monkeypatch.setattr(decoder, "_native_calls", refusing)
    gen, expected = generation(30), generation(30)
    with caplog.at_level(logging.WARNING, logger="actors.decoder"):
        in_place.advance(gen)
    copying.advance(expected)
    assert gen.generated == expected.generated and not in_place._share_buffer
    assert "decoding in a shared KV buffer failed (shape mismatch)" in caplog.text


def test_graphs_without_group_query_attention_copy(tmp_path):
    assert not DecoderEngine("lm", make_tiny_lm(tmp_path / "lm.onnx"))._share_buffer


def test_a_mask_read_only_as_counts_is_bound_once_at_the_buffer_width(genai, tmp_path):
    assert mask_only_counts(genai) and DecoderEngine("lm", genai)._wide_mask
    # A graph that also makes something else of the mask's width (as LongRoPE builds
    # choose their rotary tables with it) gets a mask of the row's width each step.
    model = onnx.load(str(genai))
    width = next(
        n.output[0]
        for n in model.graph.node
        if n.input[:1] == ["attention_mask"] and n.op_type == "Shape"
    )
    model.graph.node.append(helper.make_node("Cast", [width], ["width_as_float"], to=1))
    model.graph.output.append(helper.make_tensor_value_info("width_as_float", 1, None))
    other = tmp_path / "other.onnx"
    onnx.save(model, str(other))
    assert not mask_only_counts(other)


def test_a_large_model_file_is_not_parsed_for_its_mask(genai, monkeypatch):
    monkeypatch.setattr(decoder, "MASK_CHECK_MAX_BYTES", genai.stat().st_size - 1)
    assert not mask_only_counts(genai)
    engine, copying = engines(genai)
    gen, expected = generation(40), generation(40)
    assert not engine._wide_mask and engine.advance(gen) == copying.advance(expected)
    assert gen.generated == expected.generated


@pytest.mark.parametrize("wide", [True, False])
def test_both_masks_decode_what_the_copying_path_does(genai, wide):
    in_place, copying = engines(genai)
    in_place._wide_mask = wide
    gen, expected = generation(60), generation(60)
    stop = threading.Event()
    gen.emit = lambda t: stop.set() if len(gen.generated) == 20 else None
    assert in_place.advance(gen, stop) is None  # paused, then resumed on a new buffer
    assert in_place.advance(gen) == copying.advance(expected) == "length"
    assert gen.generated == expected.generated
    assert_same(gen.cache, expected.cache)


@pytest.mark.parametrize("room_bytes", [decoder.BUFFER_ROOM_BYTES, 1])
def test_a_buffer_holds_the_budget_only_where_that_is_small(genai, monkeypatch, room_bytes):
    monkeypatch.setattr(decoder, "BUFFER_ROOM_BYTES", room_bytes)
    engine, _ = engines(genai)
    gen = generation(200)
    engine.step(gen)  # the prompt
    engine.step(gen)  # the first decode step makes the buffer
    assert gen.cache is not None and gen.cache.buffer is not None
    need = len(PROMPT) + 1
    # All but the last of the prompt and 200 new tokens: the last is never fed.
    expected = len(PROMPT) + 199 if room_bytes > 1 else max(2 * need, need + decoder.BUFFER_SLACK)
    assert gen.cache.buffer.capacity == expected
