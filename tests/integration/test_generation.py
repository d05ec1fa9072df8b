"""Generation on a real Ray node actor with a generated decoder: streaming, pause and
resume with the KV cache, trimming to the shared prefix, the token budget governor,
sessions, and clear errors. Then the same on a GenAI folder (float32 and int4), each
generation token for token what ONNX Runtime GenAI's Generator makes alone."""

from __future__ import annotations

import functools
import io
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from actors.decoder import DecoderEngine, Generation
from cluster.text import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from edgefleet.errors import InvalidInput
from edgefleet.modelgen import make_genai_int4, make_genai_lm, make_tiny_lm, make_tokenizer
from edgefleet.request import GenerateRequest

pytestmark = pytest.mark.integration

PROMPT = tuple(range(3, 43))  # 40 tokens; the first 16 are the "system prompt"
SYSTEM = 16


@pytest.fixture(scope="module")
def slow_lm(models_dir: Path) -> Path:
    """A wider decoder (about 1.5 ms a token) so pauses land mid-generation."""
    return make_tiny_lm(models_dir / "slow_lm.onnx", layers=4, heads=8, head_dim=64)


def reference(path: Path, prompt: tuple[int, ...], n: int) -> list[int]:
    """Greedy output of an uninterrupted generation, straight on the engine."""
    engine = DecoderEngine("ref", path)
    gen = Generation(GenerateRequest("ref", prompt, max_new_tokens=n), limit=n, emit=lambda t: None)
    engine.advance(gen)
    return gen.generated


def lm_fleet(make_fleet, **node_defaults):
    return make_fleet(
        {
            "local": {"nodes": 1},
            "models": {"lm": {"path": "slow_lm.onnx", "kind": "decoder"}},
            "node_defaults": node_defaults,
        }
    )


@pytest.fixture(scope="module")
def _module_lm_fleet(_shared_ray, models_dir, slow_lm):
    """One fleet for the tests that take the default settings (a fleet deployed is a
    few seconds on a busy machine), on the session's Ray."""
    import ray

    from cluster.client import FleetClient
    from cluster.deploy import init_loopback_ray
    from edgefleet.config import parse_config

    if not ray.is_initialized():
        init_loopback_ray(num_cpus=4)  # as the session's ``ray_session`` starts it
    config = parse_config(
        {
            "fleet": {"name": "generation"},
            "local": {"nodes": 1},
            "models": {"lm": {"path": "slow_lm.onnx", "kind": "decoder"}},
        },
        models_dir,
    )
    with FleetClient.local(config) as fleet:
        yield fleet


@pytest.fixture
def lm(_module_lm_fleet):
    """The module's fleet of one node with default settings, as a fresh one starts: in
    the foreground, nothing running or paused (a test that passed left it so)."""
    fleet = _module_lm_fleet
    node = node_status(fleet)
    if node.lifecycle != "foreground":
        fleet.set_lifecycle(node.name, "foreground")
    wait_for(lambda: (lambda n: n.running is None and not n.paused)(node_status(fleet)), 60)
    return fleet


def start_stream(fleet, results, name, **kw):
    """Consume a generation on a thread; record its tokens and result."""

    def run():
        stream = fleet.generate("lm", kw.pop("prompt", PROMPT), **kw)
        results[name] = (stream.collect(), stream.result)

    t = threading.Thread(target=run)
    t.start()
    return t


def wait_for(predicate, timeout=20.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.005)
    raise AssertionError("condition not reached in time")


def node_status(fleet):
    (node,) = fleet.status().nodes
    return node


def test_paused_and_resumed_generation_is_identical_and_urgent_work_streams_first(lm, slow_lm):
    fleet = lm
    expected = reference(slow_lm, PROMPT, 300)
    bg = fleet.generate("lm", PROMPT, max_new_tokens=300, priority="background")
    first = next(bg)  # the background generation is running
    fg = fleet.generate("lm", PROMPT[:20], max_new_tokens=20, priority="foreground")
    fg_tokens = fg.collect()
    bg_tokens = bg.collect()
    assert [first, *bg_tokens[1:]] == bg_tokens == expected
    assert fg_tokens == reference(slow_lm, PROMPT[:20], 20)
    assert bg.result.pauses >= 1 and bg.finish_reason == "length"
    # The foreground streamed all its tokens while the background waited, paused (times
    # on the node's clock; how soon the pause lands depends on the machine's load).
    fg_times = [fg.result.arrival + t for t in fg.result.token_times]
    bg_times = [bg.result.arrival + t for t in bg.result.token_times]
    assert [t for t in bg_times if fg_times[0] < t < fg_times[-1]] == []
    assert bg_times[-1] > fg_times[-1]
    counters = node_status(fleet).counters
    assert counters["paused"] >= 1 and counters["resumed"] >= 1


def test_trimmed_then_reprefilled_generation_is_identical(make_fleet, slow_lm):
    # 16 KiB of KV a token: the budget holds the 16-token system prompt, not the context.
    fleet = lm_fleet(make_fleet, kv_budget_mb=0.625)
    expected = reference(slow_lm, PROMPT, 200)
    bg = fleet.generate("lm", PROMPT, max_new_tokens=200, priority="background", prefix_len=SYSTEM)
    next(bg)
    fg = fleet.generate("lm", PROMPT[:8], max_new_tokens=60, priority="foreground")
    fg.collect()
    assert bg.collect() == expected
    assert bg.result.pauses >= 1
    status = node_status(fleet)
    assert status.counters["kv_trimmed"] >= 1
    # Re-prefill fed the tokens beyond the kept prefix again.
    assert bg.result.fed_tokens > len(PROMPT) + 200 - 1


def test_cancel_of_a_paused_generation_frees_its_kv(lm, slow_lm):
    fleet = lm
    results: dict = {}
    bg = fleet.generate("lm", PROMPT, max_new_tokens=400, priority="background")
    next(bg)
    fg = start_stream(fleet, results, "fg", max_new_tokens=400, priority="foreground")
    wait_for(lambda: node_status(fleet).paused)
    status = node_status(fleet)
    assert status.paused == {3: 1} and status.kv_bytes["paused"] > 0
    assert fleet.cancel(bg.request_id)
    bg.collect()
    assert bg.finish_reason == "cancelled"
    status = node_status(fleet)
    assert status.paused == {} and status.kv_bytes["paused"] == 0
    fg.join(30)
    assert results["fg"][1].finish_reason == "length"


def test_governor_cuts_background_budget_on_event_and_restores_it(lm, slow_lm):
    fleet = lm
    node = node_status(fleet).name
    assert node_status(fleet).lifecycle == "foreground"
    fleet.set_lifecycle(node, "background")
    cut = fleet.generate("lm", PROMPT, max_new_tokens=40, priority="background")
    assert len(cut.collect()) == 10 and cut.finish_reason == "budget"
    urgent = fleet.generate("lm", PROMPT, max_new_tokens=40, priority="foreground")
    assert len(urgent.collect()) == 40 and urgent.finish_reason == "length"
    fleet.set_lifecycle(node, "foreground")
    full = fleet.generate("lm", PROMPT, max_new_tokens=40, priority="background")
    assert len(full.collect()) == 40 and full.finish_reason == "length"
    # A change reaches a running generation at its next token.
    running = fleet.generate("lm", PROMPT, max_new_tokens=400, priority="background")
    seen = [next(running)]
    fleet.set_lifecycle(node, "background")
    seen += running.collect()[1:]
    assert running.finish_reason == "budget"
    assert len(seen) < 400
    with pytest.raises(InvalidInput, match="lifecycle state"):
        fleet.set_lifecycle(node, "asleep")


def test_session_turns_reuse_kv_and_match_a_fresh_prefill(lm, slow_lm):
    fleet = lm
    turn1 = fleet.generate("lm", PROMPT, max_new_tokens=12, session="chat-1")
    out1 = turn1.collect()
    prompt2 = (*PROMPT, *out1, 5, 6, 7)
    turn2 = fleet.generate("lm", prompt2, max_new_tokens=12, session="chat-1")
    out2 = turn2.collect()
    assert turn2.result.reused_tokens == len(PROMPT) + len(out1) - 1
    assert out2 == reference(slow_lm, prompt2, 12)
    assert "chat-1" in node_status(fleet).sessions
    # Requests sharing a declared system prompt reuse its KV too.
    a = fleet.generate("lm", PROMPT, max_new_tokens=4, prefix_len=SYSTEM)
    a.collect()
    b = fleet.generate("lm", (*PROMPT[:SYSTEM], 9, 9, 9), max_new_tokens=4, prefix_len=SYSTEM)
    assert b.collect() == reference(slow_lm, (*PROMPT[:SYSTEM], 9, 9, 9), 4)
    assert b.result.reused_tokens == SYSTEM


def test_bad_generation_requests_get_typed_errors_and_harm_nothing(lm, slow_lm):
    fleet = lm
    with pytest.raises(InvalidInput, match="does not fit the context"):
        fleet.generate("lm", [1] * 600, max_new_tokens=4).collect()
    with pytest.raises(InvalidInput, match="outside the vocabulary"):
        fleet.generate("lm", [1, 2, 100_000], max_new_tokens=4).collect()
    with pytest.raises(InvalidInput, match="max_new_tokens"):
        fleet.generate("lm", [1, 2], max_new_tokens=0).collect()
    with pytest.raises(InvalidInput, match="prompt_ids"):
        fleet.generate("lm", [], max_new_tokens=4).collect()
    stream = fleet.generate(
        "lm", PROMPT, max_new_tokens=8, stop_ids=[reference(slow_lm, PROMPT, 3)[2]]
    )
    assert len(stream.collect()) == 3 and stream.finish_reason == "stop"
    assert node_status(fleet).state == "serving"


def test_text_in_and_out_through_the_client(lm, slow_lm):
    # A tokenizer.json beside the model: the caller tokenizes the prompt and decodes the
    # stream; the node still generates token ids, exactly as for those ids.
    make_tokenizer(slow_lm.parent / TOKENIZER_FILE)
    tokenizer = lm.tokenizer("lm")
    stream = lm.generate("lm", "the heron saw déjà vu", max_new_tokens=16)
    text = "".join(stream.texts())
    assert stream.tokens == reference(slow_lm, tokenizer.encode("the heron saw déjà vu"), 16)
    assert text == tokenizer.decode(stream.tokens)


def test_a_caller_without_the_model_folder_reads_the_tokenizer_from_the_store(
    make_fleet, slow_lm, tmp_path
):
    # The deploy published the tokenizer with the model: a caller on another machine
    # (here: a view of the fleet whose model path does not exist) fetches it.
    from cluster.client import FleetClient

    make_tokenizer(slow_lm.parent / TOKENIZER_FILE)
    fleet = lm_fleet(make_fleet)
    here = fleet.config.models["lm"]
    away = here.model_copy(update={"path": tmp_path / "not-here" / "slow_lm.onnx"})
    # Closed at the end: its view feed would poll the fleet's router after the fleet is
    # gone, and call Ray after the module's cluster shut down (Ray ends such a process).
    with FleetClient(
        fleet.config.model_copy(update={"models": {"lm": away}}), fleet._router, fleet._nodes
    ) as remote:
        tokenizer = remote.tokenizer("lm")
        assert tokenizer.path.is_relative_to(os.environ["XDG_CACHE_HOME"])
        assert tokenizer.encode("déjà vu") == fleet.tokenizer("lm").encode("déjà vu")
        stream = remote.generate("lm", "the heron saw déjà vu", max_new_tokens=8)
        assert "".join(stream.texts()) == fleet.tokenizer("lm").decode(stream.tokens)


@pytest.fixture
def chat_lm(lm, slow_lm):
    """The module's fleet, its decoder's folder with a chat model's tokenizer and
    template (ChatML, as Qwen's); the template is gone afterwards."""
    make_tokenizer(slow_lm.parent / TOKENIZER_FILE, chat=True)
    yield lm
    (slow_lm.parent / TOKENIZER_CONFIG_FILE).unlink(missing_ok=True)


SYSTEM_MESSAGE = {"role": "system", "content": "Answer briefly."}


def chat_ids(fleet, messages):
    """The prompt ids of a conversation, rendered and tokenized as the client does."""
    text = fleet.chat_template("lm").render(messages)
    return fleet.tokenizer("lm").encode(text, add_special_tokens=False)


def test_a_chat_answers_its_second_turn_from_the_first_turns_kv(chat_lm, slow_lm):
    fleet = chat_lm
    chat = fleet.chat("lm", system=SYSTEM_MESSAGE["content"], max_new_tokens=12)
    first = chat.send("a heron by the dock?")
    asked = [SYSTEM_MESSAGE, {"role": "user", "content": "a heron by the dock?"}]
    ids = chat_ids(fleet, asked)  # greedy: the answer to exactly the rendered conversation
    assert chat.last.tokens == reference(slow_lm, ids, 12)
    assert first == fleet.tokenizer("lm").decode(chat.last.tokens)

    second = chat.send("and the boats?")
    assert chat.messages == [
        *asked,
        {"role": "assistant", "content": first},
        {"role": "user", "content": "and the boats?"},
        {"role": "assistant", "content": second},
    ]
    more = chat_ids(fleet, chat.messages[:4])
    assert more[: len(ids)] == ids  # the second turn's prompt starts with the first's
    assert chat.last.tokens == reference(slow_lm, more, 12)
    assert chat.last.result.reused_tokens >= len(ids)  # the session's KV: only what is new
    assert second == fleet.tokenizer("lm").decode(chat.last.tokens)
    kept = list(chat.messages)
    with pytest.raises(InvalidInput, match="does not fit the context"):
        chat.send("x" * 2000)
    assert chat.messages == kept  # a turn that failed is not part of the conversation
    # The same conversation as messages to generate: the same answer.
    assert "".join(fleet.generate("lm", chat.messages[:4], max_new_tokens=12).texts()) == second
    # Another chat with the same system message starts from its shared KV.
    other = fleet.chat("lm", system=SYSTEM_MESSAGE["content"], max_new_tokens=2)
    other.send("hello")
    system_ids = fleet.tokenizer("lm").encode(
        fleet.chat_template("lm").render([SYSTEM_MESSAGE], add_generation_prompt=False),
        add_special_tokens=False,
    )
    assert other.last.result.reused_tokens == len(system_ids) > 0

    with pytest.raises(InvalidInput, match="chat takes no bogus"):
        fleet.chat("lm", bogus=1)
    with pytest.raises(InvalidInput, match="refuses this conversation: unknown role tool"):
        fleet.generate("lm", [{"role": "tool", "content": "42"}])
    (slow_lm.parent / TOKENIZER_CONFIG_FILE).unlink()
    with pytest.raises(InvalidInput, match="model 'lm' has no chat template"):
        fleet.generate("lm", asked)
    with pytest.raises(InvalidInput, match="model 'lm' has no chat template"):
        fleet.chat("lm")


def test_generate_chat_on_the_command_line(chat_lm, cli_on_ray, monkeypatch):
    fleet = chat_lm
    options = ("--fleet", "generation", "--system", SYSTEM_MESSAGE["content"])
    one = cli_on_ray(
        "generate", "lm", "--chat", "--prompt", "a heron by the dock?", "--max-new-tokens", "12",
        *options,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    chat = fleet.chat("lm", system=SYSTEM_MESSAGE["content"], max_new_tokens=12)
    first = chat.send("a heron by the dock?")
    assert one.stdout == first + "\n" and "finish: " in one.stderr
    # No --prompt: a conversation from standard input, a turn a line (blank ones skipped).
    monkeypatch.setattr("sys.stdin", io.StringIO("a heron by the dock?\n\nand the boats?\n"))
    talk = cli_on_ray("generate", "lm", "--chat", "--max-new-tokens", "12", *options)
    assert talk.returncode == 0, talk.stderr[-3000:]
    assert talk.stdout == f"{first}\n{chat.send('and the boats?')}\n"
    assert talk.stderr.count("finish: ") == 2


# ------------------------------------------------- against ONNX Runtime GenAI's Generator
#
# A GenAI folder (GroupQueryAttention with rotary, no position_ids) served by a fleet
# gives exactly the tokens ONNX Runtime GenAI's own Generator makes alone, greedy: in
# float32, and quantized to int4 as the builder does for the CPU (MatMulNBits,
# accuracy_level 4: int8 activations quantized per call, so edgefleet replays the
# Generator's grouping of tokens into calls when it rebuilds a cache).

GENAI_NEW = 950  # background generations: long, so the foreground finds them running
GENAI_KV_TOKENS = 300  # the node's KV budget, in tokens of either model (4 KiB a token)
GENAI_TOKEN_BYTES = 4 * 2 * 4 * 32 * 4  # layers x (key, value) x kv heads x head size x fp32
# What a trim keeps of a paused generation: its declared prefix. An int4 cache can only
# be cut back to the end of a call (the prompt was one), so it keeps the whole prompt.
GENAI_PREFIX = {"fp32": SYSTEM, "int4": len(PROMPT)}
GENAI_MODELS = ("fp32", "int4")


@pytest.fixture(scope="module")
def og():
    return pytest.importorskip(
        "onnxruntime_genai",
        reason="onnxruntime-genai is not installed (pip install -e '.[dev]'): its Generator "
        "gives the reference outputs",
    )


@pytest.fixture(scope="module")
def genai_models(tmp_path_factory) -> dict[str, Path]:
    """A float32 GenAI folder and its int4 build. Hidden 256, 4 layers and 4000 tokens:
    large enough that int4's per-call activation scales change the output of a cache
    rebuilt in one call (a hidden-64 build never did); about 1.5 s to make."""
    root = tmp_path_factory.mktemp("genai")
    fp32 = make_genai_lm(
        root / "fp32", heads=8, kv_heads=4, head_dim=32, layers=4, vocab=4000, max_context=1024
    )
    return {"fp32": fp32, "int4": make_genai_int4(fp32.parent, root / "int4")}


@pytest.fixture(scope="module")
def genai_reference(og, genai_models):
    """``reference(model, prompt, n)``: the greedy tokens of ONNX Runtime GenAI's
    Generator alone on the model's folder (one thread), at most ``n`` new ones (its
    end-of-sequence id ends it earlier, as it ends edgefleet's)."""
    loaded = {}
    for name, path in genai_models.items():
        config = og.Config(str(path.parent))
        one_thread = {"session_options": {"intra_op_num_threads": 1, "inter_op_num_threads": 1}}
        config.overlay(json.dumps({"model": {"decoder": one_thread}}))
        loaded[name] = og.Model(config)

    @functools.cache
    def reference(model: str, prompt: tuple[int, ...], n: int) -> list[int]:
        params = og.GeneratorParams(loaded[model])
        params.set_search_options(do_sample=False, max_length=len(prompt) + n)
        generator = og.Generator(loaded[model], params)
        generator.append_tokens(np.array([prompt], dtype=np.int32))
        tokens = []
        while not generator.is_done():
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
        return tokens

    return reference


@pytest.fixture(scope="module")
def _module_genai_fleet(_shared_ray, genai_models):
    """One node serving both builds, for every test of this section. Its KV budget is
    GENAI_KV_TOKENS tokens: a session's cache and a paused generation's early in its
    run fit, a paused generation hundreds of tokens in does not (it is trimmed to its
    prefix). The default budget never trims a model this small, so the module's other
    fleet cannot serve here."""
    import ray

    from cluster.client import FleetClient
    from cluster.deploy import init_loopback_ray
    from edgefleet.config import MiB, parse_config

    if not ray.is_initialized():
        init_loopback_ray(num_cpus=4)
    models = {m: {"path": str(p), "kind": "decoder"} for m, p in genai_models.items()}
    config = parse_config(
        {
            "fleet": {"name": "genai"},
            "local": {"nodes": 1},
            "models": models,
            "node_defaults": {"kv_budget_mb": GENAI_KV_TOKENS * GENAI_TOKEN_BYTES / MiB},
        },
        genai_models["fp32"].parent.parent,
    )
    with FleetClient.local(config) as fleet:
        yield fleet


@pytest.fixture
def genai(_module_genai_fleet):
    """The section's fleet, idle (a test that passed left it so)."""
    fleet = _module_genai_fleet
    wait_for(lambda: (lambda n: n.running is None and not n.paused)(node_status(fleet)), 60)
    return fleet


@pytest.mark.parametrize("model", GENAI_MODELS)
def test_greedy_generation_equals_onnxruntime_genai(genai, genai_reference, model):
    stream = genai.generate(model, PROMPT, max_new_tokens=120)
    expected = genai_reference(model, PROMPT, 120)
    assert len(expected) == 120  # no end-of-sequence: the whole run is compared
    assert stream.collect() == expected and stream.finish_reason == "length"


@pytest.mark.parametrize("model", GENAI_MODELS)
def test_a_paused_and_resumed_generation_equals_onnxruntime_genai(genai, genai_reference, model):
    bg = genai.generate(model, PROMPT, max_new_tokens=GENAI_NEW, priority="background")
    next(bg)  # running
    fg = genai.generate(model, PROMPT[:20], max_new_tokens=20, priority="foreground")
    assert fg.collect() == genai_reference(model, PROMPT[:20], 20)
    assert bg.collect() == genai_reference(model, PROMPT, GENAI_NEW)
    assert bg.result.pauses >= 1


@pytest.mark.parametrize("model", GENAI_MODELS)
def test_a_trimmed_and_reprefilled_generation_equals_onnxruntime_genai(
    genai, genai_reference, genai_models, model
):
    expected = genai_reference(model, PROMPT, GENAI_NEW)
    trimmed = node_status(genai).counters["kv_trimmed"]
    prefix = GENAI_PREFIX[model]
    bg = genai.generate(
        model, PROMPT, max_new_tokens=GENAI_NEW, priority="background", prefix_len=prefix
    )
    for made, _ in enumerate(bg, 1):
        if made == GENAI_KV_TOKENS:  # its cache no longer fits the budget once it pauses
            break
    genai.generate(model, PROMPT[:8], max_new_tokens=200, priority="foreground").collect()
    assert bg.collect() == expected
    assert bg.result.pauses >= 1 and node_status(genai).counters["kv_trimmed"] > trimmed
    assert bg.result.fed_tokens > len(PROMPT) + GENAI_NEW - 1  # fed again after the prefix
    if model == "int4":
        # The grouping matters here: a rebuild in one call (a float model's) diverges.
        engine = DecoderEngine("naive", genai_models[model])
        engine.exact_grouping = False
        stop = threading.Event()
        gen = Generation(
            GenerateRequest("naive", PROMPT, max_new_tokens=200),
            limit=200,
            emit=lambda t: stop.set() if len(gen.generated) >= 60 else None,
        )
        assert engine.advance(gen, stop) is None and gen.cache is not None
        gen.cache = gen.cache.prefix(prefix)
        assert engine.advance(gen) == "length" and gen.generated != expected[:200]


@pytest.mark.parametrize("model", GENAI_MODELS)
def test_a_sessions_second_turn_equals_onnxruntime_genai(genai, genai_reference, model):
    session = f"genai-{model}"
    first = genai.generate(model, PROMPT, max_new_tokens=12, session=session).collect()
    assert first == genai_reference(model, PROMPT, 12)
    prompt = (*PROMPT, *first, 5, 6, 7)
    turn = genai.generate(model, prompt, max_new_tokens=12, session=session)
    assert turn.collect() == genai_reference(model, prompt, 12)
    # The float model starts from the first turn's KV; int4 prefills all of it, as the
    # Generator does (a cache built by other calls would change its numbers).
    assert turn.result.reused_tokens == (len(PROMPT) + len(first) - 1 if model == "fp32" else 0)


@pytest.mark.parametrize("model", GENAI_MODELS)
def test_four_generations_decoded_together_equal_onnxruntime_genai(genai, genai_reference, model):
    prompts = [tuple(range(5 + i, 25 + 3 * i)) for i in range(4)]
    lengths = [360, 270, 450, 180]  # rows leave at different tokens
    streams = [
        genai.generate(model, p, max_new_tokens=n) for p, n in zip(prompts, lengths, strict=True)
    ]
    threads = [threading.Thread(target=s.collect) for s in streams]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for stream, prompt, n in zip(streams, prompts, lengths, strict=True):
        assert stream.tokens == genai_reference(model, prompt, n)
    # Together: every generation made tokens while each other one did.
    spans = [
        (s.result.arrival + s.result.token_times[0], s.result.arrival + s.result.token_times[-1])
        for s in streams
    ]
    assert max(first for first, _ in spans) < min(last for _, last in spans)
