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
import pytest

from actors.decoder import DecoderEngine, Generation, KVCache
from edgefleet.modelgen import make_genai_int4, make_genai_lm, make_tiny_lm
from edgefleet.request import GenerateRequest

PROMPT = tuple(range(3, 35))


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


def test_decode_steps_write_in_place_and_match_the_copying_path(genai):
    in_place, copying = engines(genai)
    assert in_place._share_buffer
    gen, expected = generation(150), generation(150)
    in_place.step(gen)  # the prompt, in one call that makes the cache
    buffers = set()
    while gen.end_reason() is None:
        in_place.step(gen)
        assert gen.cache is not None and gen.cache.buffer is not None
        buffers.add(id(gen.cache.buffer))
    assert copying.advance(expected) == "length"
    assert gen.generated == expected.generated
    assert_same(gen.cache, expected.cache)
    # Buffers grow geometrically: the cache was copied twice in 150 tokens, not 150 times.
    assert len(buffers) == 2


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


def test_a_graph_that_refuses_shared_buffers_decodes_by_copying(genai, caplog):
    in_place, copying = engines(genai)

    def refuse(token: int, cache: KVCache) -> tuple[np.ndarray, KVCache]:
        raise RuntimeError("shape mismatch")

    in_place._decode_shared = refuse  # type: ignore[method-assign]
    gen, expected = generation(30), generation(30)
    with caplog.at_level(logging.WARNING, logger="actors.decoder"):
        in_place.advance(gen)
    copying.advance(expected)
    assert gen.generated == expected.generated and not in_place._share_buffer
    assert "decoding in a shared KV buffer failed (shape mismatch)" in caplog.text


def test_graphs_without_group_query_attention_copy(tmp_path):
    assert not DecoderEngine("lm", make_tiny_lm(tmp_path / "lm.onnx"))._share_buffer
