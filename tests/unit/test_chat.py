"""Conversations rendered into a prompt with a model folder's chat template, in the
caller, as Hugging Face's apply_chat_template renders them."""

from __future__ import annotations

import json

import pytest

from cluster.text import (
    TEMPLATE_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    chat_template_for,
    is_conversation,
    tokenizer_for,
)
from edgefleet.errors import InvalidInput
from edgefleet.modelgen import CHAT_TOKENS, make_tokenizer

SYSTEM = {"role": "system", "content": "Answer in one line."}
USER = {"role": "user", "content": "Où est le héron ?"}


@pytest.fixture
def folder(tmp_path):
    make_tokenizer(tmp_path / TOKENIZER_FILE, chat=True)
    return tmp_path


def template_in(folder, source, **config):
    (folder / TOKENIZER_CONFIG_FILE).write_text(json.dumps({"chat_template": source, **config}))
    return chat_template_for("lm", folder / "lm.onnx")


def test_system_and_user_render_as_chatml_ready_for_the_answer(folder):
    template = chat_template_for("lm", folder / "lm.onnx")
    assert template.render([SYSTEM, USER]) == (
        "<|im_start|>system\nAnswer in one line.<|im_end|>\n"
        "<|im_start|>user\nOù est le héron ?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert template.eos_token == "<|im_end|>" and template.bos_token is None
    # The markers are the tokenizer's special tokens: one id each, not text.
    tokenizer = tokenizer_for("lm", folder / "lm.onnx")
    ids = tokenizer.encode(template.render([USER]), add_special_tokens=False)
    start, end = (tokenizer._tok.token_to_id(t) for t in CHAT_TOKENS)
    assert ids.count(start) == 2 and ids.count(end) == 1
    assert tokenizer.decode(ids) == "user\nOù est le héron ?\nassistant\n"


def test_a_later_turn_starts_with_the_earlier_turns_text(folder):
    template = chat_template_for("lm", folder / "lm.onnx")
    first = template.render([SYSTEM, USER])
    answer = {"role": "assistant", "content": "Au bord de la rivière."}
    second = template.render([SYSTEM, USER, answer, {"role": "user", "content": "Et le bateau ?"}])
    assert second.startswith(first + "Au bord de la rivière.<|im_end|>\n")
    assert second.endswith("<|im_start|>user\nEt le bateau ?<|im_end|>\n<|im_start|>assistant\n")


def test_without_add_generation_prompt_the_answer_is_not_started(folder):
    template = chat_template_for("lm", folder / "lm.onnx")
    assert template.render([SYSTEM], add_generation_prompt=False) == (
        "<|im_start|>system\nAnswer in one line.<|im_end|>\n"
    )


def test_bos_and_eos_tokens_come_from_the_config_as_text_or_added_tokens(tmp_path):
    source = "{{ bos_token }}{% for m in messages %}[{{ m.content }}]{{ eos_token }}{% endfor %}"
    eos = {"__type": "AddedToken", "content": "</s>", "special": True}
    template = template_in(tmp_path, source, bos_token="<s>", eos_token=eos)
    assert template.render([USER, USER]) == "<s>[Où est le héron ?]</s>[Où est le héron ?]</s>"


def test_a_conversation_the_template_refuses_is_invalid_input_with_its_words(folder):
    template = chat_template_for("lm", folder / "lm.onnx")
    with pytest.raises(InvalidInput, match="refuses this conversation: unknown role tool"):
        template.render([{"role": "tool", "content": "42"}])
    with pytest.raises(InvalidInput, match="the system message must come first"):
        template.render([USER, SYSTEM])


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__.__mro__[1].__subclasses__() }}",  # Python's internals
        "{{ ''.__class__ }}",
        "{% set x = messages.append({'role': 'user', 'content': 'injected'}) %}",  # mutation
        "{{ messages[0].update({'role': 'system'}) }}",
    ],
)
def test_a_template_trying_something_unsafe_is_stopped_by_the_sandbox(tmp_path, source):
    template = template_in(tmp_path, source)
    messages = [dict(USER)]
    with pytest.raises(InvalidInput, match="the sandbox does not allow"):
        template.render(messages)
    assert messages == [USER]


def test_hugging_face_helpers_and_jinja_errors(tmp_path):
    source = "{{ messages | tojson }}{% for m in messages %}{% break %}{% endfor %}"
    assert template_in(tmp_path, source).render([USER]) == json.dumps([USER], ensure_ascii=False)
    assert template_in(tmp_path, "{{ strftime_now('%Y') }}").render([USER]).isdigit()
    with pytest.raises(InvalidInput, match="failed: UndefinedError"):
        template_in(tmp_path, "{{ messages[3].content }}").render([USER])
    with pytest.raises(InvalidInput, match=r"chat template in .*tokenizer_config.json is not"):
        template_in(tmp_path, "{% for m in messages %}")


def test_a_chat_template_file_or_a_named_default_is_read_too(tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert template_in(tmp_path, named).render([USER]) == "D"
    (tmp_path / TEMPLATE_FILE).write_text("J{{ messages | length }}")
    assert chat_template_for("lm", tmp_path / "lm.onnx").render([USER]) == "J1"


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([{"role": "user"}], r"messages\[0\] must be a dict with a string role and content"),
        ([USER, "hello"], r"messages\[1\] must be a dict"),
        ([{"role": "user", "content": 7}], r"messages\[0\]"),
        ([], "messages must be a non-empty list"),
        ("hello", "messages must be a non-empty list"),
    ],
)
def test_messages_that_are_not_a_conversation_are_invalid_input(folder, messages, says):
    with pytest.raises(InvalidInput, match=says):
        chat_template_for("lm", folder / "lm.onnx").render(messages)


def test_a_model_without_a_chat_template_says_so(tmp_path):
    make_tokenizer(tmp_path / TOKENIZER_FILE)  # a tokenizer, but no tokenizer_config.json
    with pytest.raises(InvalidInput, match="model 'lm' has no chat template"):
        chat_template_for("lm", tmp_path / "lm.onnx")
    (tmp_path / TOKENIZER_CONFIG_FILE).write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(InvalidInput, match="has no chat template .*send the prompt as text"):
        chat_template_for("lm", tmp_path / "lm.onnx")
    (tmp_path / TOKENIZER_CONFIG_FILE).write_text("{not json")
    with pytest.raises(InvalidInput, match="cannot read .*tokenizer_config.json"):
        chat_template_for("lm", tmp_path / "lm.onnx")


def test_what_counts_as_a_conversation():
    assert is_conversation([USER]) and is_conversation((USER, SYSTEM))
    assert not any(is_conversation(p) for p in ("hi", [1, 2], [], ["a", "b"], b"x", None))
