"""Dynamically quantized decoders on real ONNX Runtime: their logits depend on how tokens
are grouped into engine calls, so a rebuilt cache, a continuation or a reused cache must
replay the calls of the uninterrupted run to give its tokens.

The model is the generated tiny LM quantized with ONNX Runtime's ``quantize_dynamic``
(``DynamicQuantizeLinear`` before each ``MatMulInteger``). The prompts and length are
fixed ones for which the grouping-agnostic path (``exact_grouping`` off) changes the
output in the scenarios below (in some where it depends on the CPU's integer kernels,
for one of several prompts at least); each test checks that too, so it fails unless
the grouping is replayed."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
from onnxruntime.quantization import quantize_dynamic

from actors.decoder import DecoderEngine, Generation, KVCache, dynamically_quantized
from actors.node import NodeRuntime
from edgefleet.config import parse_config
from edgefleet.messages import GenerationResult
from edgefleet.modelgen import make_tiny_lm
from edgefleet.request import GenerateRequest
from tests.fakes import LocalFleet

PROMPT = tuple(range(1, 21))
# More prompts of the same length: whether the grouping-agnostic path changes a
# scenario's tokens depends on the CPU's integer kernels; each test that checks it asks
# for one prompt at least where it does (and the exact path right for every prompt).
PROMPTS = (
    PROMPT,
    tuple(range(30, 50)),
    tuple(range(7, 67, 3)),
    tuple(range(60, 20, -2)),
    tuple(range(200, 220)),
    tuple(i * 37 % 500 for i in range(1, 21)),
)
NEW = 40  # tokens generated
PAUSE_AFTER = 6  # tokens generated before the pause


@pytest.fixture(scope="module")
def lm_path(tmp_path_factory) -> Path:
    return make_tiny_lm(tmp_path_factory.mktemp("lm") / "lm.onnx")


@pytest.fixture(scope="module")
def qlm_path(lm_path) -> Path:
    path = lm_path.with_name("lm.int8.onnx")
    quantize_dynamic(str(lm_path), str(path))
    return path


def int4(lm: Path, accuracy_level: int) -> Path:
    """``lm`` with its MatMuls quantized to int4 by ONNX Runtime's MatMulNBits quantizer,
    as ONNX Runtime GenAI's builder makes its CPU int4 models (accuracy_level 4)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quiet = logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer")
    quiet.setLevel(logging.WARNING)  # a line per MatMul otherwise
    quantizer = MatMulNBitsQuantizer(
        onnx.load(str(lm)), block_size=32, is_symmetric=True, accuracy_level=accuracy_level
    )
    quantizer.process()
    path = lm.with_name(f"{lm.stem}.int4-acc{accuracy_level}.onnx")
    quantizer.model.save_model_to_file(str(path))
    return path


@pytest.fixture(scope="module")
def int4_lm(tmp_path_factory) -> Path:
    # Hidden 256 and 4 layers: in a smaller one (hidden 64, 128) the int8 activations
    # did not change a token; here logits of one 12-token call and of twelve 1-token
    # calls differ by up to 0.04.
    lm = make_tiny_lm(
        tmp_path_factory.mktemp("int4") / "lm.onnx", heads=8, head_dim=32, layers=4, vocab=2000
    )
    return lm


def engines(path: Path, chunk: int = 0) -> tuple[DecoderEngine, DecoderEngine]:
    """The engine, and one with exact_grouping off: it groups tokens into calls as it
    does for a float model (a rebuild or a continuation prefills in one call)."""
    exact = DecoderEngine("q", path, prefill_chunk=chunk)
    naive = DecoderEngine("q", path, prefill_chunk=chunk)
    naive.exact_grouping = False
    return exact, naive


def generation(prompt: tuple[int, ...], **kw) -> Generation:
    return Generation(GenerateRequest("q", prompt, max_new_tokens=NEW, **kw), NEW, lambda t: None)


def alone(engine: DecoderEngine, prompt: tuple[int, ...] = PROMPT, **kw) -> list[int]:
    gen = generation(prompt, **kw)
    assert engine.advance(gen) == "length"
    return gen.generated


def paused_trimmed_resumed(
    engine: DecoderEngine, trim: int, prompt: tuple[int, ...] = PROMPT
) -> list[int]:
    """Pause after PAUSE_AFTER tokens, trim the cache to ``trim`` tokens, resume."""
    stop = threading.Event()
    gen = generation(prompt)
    gen.emit = lambda t: stop.set() if len(gen.generated) >= PAUSE_AFTER else None
    assert engine.advance(gen, stop) is None and gen.cache is not None
    gen.cache = gen.cache.prefix(trim)
    assert engine.advance(gen) == "length"
    return gen.generated


def test_dynamic_quantization_is_detected_on_the_model_file(lm_path, qlm_path):
    assert dynamically_quantized(qlm_path) and not dynamically_quantized(lm_path)
    assert DecoderEngine("q", qlm_path).exact_grouping
    assert not DecoderEngine("lm", lm_path).exact_grouping


def test_a_one_call_rebuild_changes_the_output_of_a_quantized_model_only(lm_path, qlm_path):
    for path, changes in ((qlm_path, True), (lm_path, False)):
        engine = DecoderEngine("q", path)
        assert engine.exact_grouping is changes
        expected = alone(engine)
        gen = generation(PROMPT)
        while len(gen.generated) < PAUSE_AFTER:
            engine.step(gen)
        # The cache dropped, then rebuilt as any decoder would: one prefill call.
        _, arrays = engine.forward(gen.tokens[:-1], 0, None)
        gen.cache = KVCache(arrays, len(gen.tokens) - 1)
        engine.advance(gen)
        assert (gen.generated != expected) is changes


@pytest.mark.parametrize("chunk", [0, 8])
@pytest.mark.parametrize("trim", [0, 8, 13, 22])  # 13: inside a chunk; 22: a generated token
def test_a_trimmed_cache_is_rebuilt_with_the_calls_of_the_uninterrupted_run(qlm_path, chunk, trim):
    naive_changed = []
    for prompt in PROMPTS:
        exact, naive = engines(qlm_path, chunk)
        expected = alone(exact, prompt)
        assert paused_trimmed_resumed(exact, trim, prompt) == expected, prompt
        naive_changed.append(paused_trimmed_resumed(naive, trim, prompt) != expected)
    assert any(naive_changed), "no prompt shows the grouping mattering here"


@pytest.mark.parametrize("chunk", [0, 8])
@pytest.mark.parametrize("k", [3, 8])
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_k": 20, "seed": 1}])
def test_a_continuation_gives_the_tail_of_the_uninterrupted_run(qlm_path, chunk, k, sampling):
    exact, naive = engines(qlm_path, chunk)
    expected = alone(exact, **sampling)
    prompt = PROMPT + tuple(expected[:k])  # an earlier attempt made k tokens
    outputs = []
    for engine in (naive, exact):
        gen = generation(prompt, continued=k, **sampling)
        assert engine.advance(gen) == "length"
        outputs.append(gen.generated)
    assert outputs[0] != expected[k:]
    assert outputs[1] == expected[k:]


def test_a_cache_built_by_another_request_is_not_reused(qlm_path):
    naive_changed = []
    for prompt in PROMPTS:
        exact, naive = engines(qlm_path)
        first = generation(prompt)
        exact.advance(first)
        follow_up = prompt + tuple(first.generated) + (5, 6, 7)  # a session's next turn
        expected = alone(exact, follow_up)
        outputs = []
        for engine in (naive, exact):
            gen = generation(follow_up)
            assert first.cache is not None
            gen.cache, gen.reused = first.cache, first.cache.length  # as a KV store hands it
            engine.advance(gen)
            outputs.append(gen)
        assert outputs[1].generated == expected and outputs[1].reused == 0, prompt
        naive_changed.append(outputs[0].generated != expected)
    assert any(naive_changed), "no prompt shows the grouping mattering here"


@pytest.mark.parametrize(
    ("chunk", "continued", "n", "aligned"),
    [
        (None, 0, 13, 13),  # any grouping gives the same output
        (0, 0, 13, 0),  # the prompt was one call
        (0, 0, 20, 20),
        (0, 0, 27, 27),  # generated tokens: one call each
        (8, 0, 13, 8),
        (8, 0, 16, 16),
        (8, 0, 19, 16),
        (8, 5, 19, 16),  # the original prompt is 20 tokens, not 25
        (8, 5, 21, 21),
        (0, 5, 19, 0),
    ],
)
def test_aligned_gives_the_last_call_boundary(chunk, continued, n, aligned):
    gen = generation(PROMPT + (1,) * continued, continued=continued)
    gen.exact_chunk = chunk
    assert gen.aligned(n) == aligned


def test_a_non_quantized_model_keeps_any_trim(lm_path):
    engine = DecoderEngine("lm", lm_path, prefill_chunk=8)
    gen = generation(PROMPT)
    engine.step(gen)
    assert gen.exact_chunk is None and gen.aligned(13) == 13


def test_a_node_serving_a_quantized_decoder_reuses_no_session_and_says_so(qlm_path):
    # The same session twice on one node: a float model would start the second turn
    # from the first turn's cache; a quantized one prefills it whole, as alone.
    config = parse_config(
        {
            "fleet": {"name": "q"},
            "models": {"q": {"path": str(qlm_path), "kind": "decoder"}},
            "nodes": [{"name": "a"}],
        },
        qlm_path.parent,
    )
    fleet = LocalFleet(config, NodeRuntime)
    try:
        first = fleet.run(_generate(fleet, GenerateRequest("q", PROMPT, NEW, session="s")))
        follow_up = PROMPT + first.tokens + (5, 6, 7)
        second = fleet.run(_generate(fleet, GenerateRequest("q", follow_up, NEW, session="s")))
        assert second.reused_tokens == 0
        assert list(second.tokens) == alone(DecoderEngine("q", qlm_path), follow_up)
        status = fleet.node("a").status()
        assert status.sessions == () and status.kv_bytes["cached"] == 0
        assert [m.exact_grouping for m in status.models] == [True]
    finally:
        fleet.close()


async def _generate(fleet: LocalFleet, request: GenerateRequest) -> GenerationResult:
    async for item in fleet.node("a").generate(request):
        if isinstance(item, GenerationResult):
            return item
    raise AssertionError("no result")


def test_int4_with_run_time_activation_quantization_is_detected(int4_lm):
    level4, level1 = int4(int4_lm, 4), int4(int4_lm, 1)
    assert dynamically_quantized(level4) and DecoderEngine("q", level4).exact_grouping
    assert not dynamically_quantized(level1)  # fp32 activations: grouping-independent
    assert not DecoderEngine("q", level1).exact_grouping


def test_an_int4_level_4_cache_trimmed_and_rebuilt_gives_the_uninterrupted_tokens(int4_lm):
    path = int4(int4_lm, 4)
    naive_changed = []
    for trim in (8, 22):  # measured: 22 changes the first prompt's tokens without replay
        for prompt in PROMPTS:
            exact, naive = engines(path)
            expected = alone(exact, prompt)
            assert paused_trimmed_resumed(exact, trim, prompt) == expected, (trim, prompt)
            naive_changed.append(paused_trimmed_resumed(naive, trim, prompt) != expected)
    assert any(naive_changed), "no prompt shows the grouping mattering here"
