"""Generation on a real Ray node actor with a generated decoder: streaming, pause and
resume with the KV cache, trimming to the shared prefix, the token budget governor,
sessions, and clear errors."""

from __future__ import annotations

import io
import threading
import time
from pathlib import Path

import pytest

from actors.decoder import DecoderEngine, Generation
from cluster.text import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from edgefleet.errors import InvalidInput
from edgefleet.modelgen import make_tiny_lm, make_tokenizer
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
