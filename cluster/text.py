"""Text in and out of a decoder: the ``tokenizer.json`` beside a model's file (every
ONNX Runtime GenAI build and Hugging Face export ships one), read with the Hugging Face
``tokenizers`` package; and conversations rendered into a prompt with the chat template
of the ``tokenizer_config.json`` beside it, as Hugging Face's ``apply_chat_template``
renders them.

The caller tokenizes, not the node: nodes keep speaking token ids, which is what their
caches, sessions, shared prefixes and the continuation of a generation whose node was
lost are keyed by, and a small device spends no CPU on text. The caller reads the
tokenizer files from the model's folder, or, on a machine without it, fetches them
from the fleet's store (``FleetClient`` does: the deploy published them).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeGuard

from edgefleet.errors import InvalidInput

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # its ``chat_template``, bos and eos tokens
TEMPLATE_FILE = "chat_template.jinja"  # where newer exports keep the template instead
_REPLACEMENT = "\ufffd"  # what a decode gives for the first bytes of a character cut short


class Tokenizer:
    """A model's tokenizer: text to token ids and back."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HfTokenizer

        self.path = path
        self._tok = HfTokenizer.from_file(str(path))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> tuple[int, ...]:
        """``text``'s ids; ``add_special_tokens=False`` leaves out what the tokenizer
        adds around a text (a BOS id): a rendered chat template writes its own."""
        return tuple(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._tok.decode(list(ids)))

    def decoder(self) -> TextDecoder:
        return TextDecoder(self)


class TextDecoder:
    """Decodes a stream of token ids into text as it comes: each :meth:`push` returns
    the new text that is complete, holding back the bytes of a character whose token
    has not come yet (a multi-byte character split over tokens), and words a later
    token may still change. Only the last few ids are decoded each time."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # ids[prefix:read] decode to the text already given...
        self._read = 0  # ...so new text is what ids[prefix:] decode to past it

    def push(self, ids: Iterable[int]) -> str:
        self._ids.extend(ids)
        before = self._tok.decode(self._ids[self._prefix : self._read])
        now = self._tok.decode(self._ids[self._prefix :])
        if len(now) <= len(before) or now.endswith(_REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return now[len(before) :]

    def finish(self) -> str:
        """What is left: the text of the last ids, whole or not."""
        before = self._tok.decode(self._ids[self._prefix : self._read])
        now = self._tok.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return now[len(before) :]


@lru_cache(maxsize=16)
def _load(path: Path, mtime: float) -> Tokenizer:
    return Tokenizer(path)


def tokenizer_for(model: str, model_path: Path) -> Tokenizer:
    """The tokenizer beside ``model``'s file; InvalidInput saying the model takes token
    ids when there is none (or it cannot be read here)."""
    path = model_path.parent / TOKENIZER_FILE
    try:
        return _load(path, path.stat().st_mtime)
    except FileNotFoundError:
        raise InvalidInput(
            f"model {model!r} has no {TOKENIZER_FILE} beside {model_path} (here): it takes "
            "token ids (prompt_ids, or --prompt-ids on the command line)"
        ) from None
    except Exception as exc:  # the tokenizers package's own errors for a bad file
        raise InvalidInput(f"model {model!r}: cannot read {path}: {exc}") from None


# ------------------------------------------------------------------ chat templates

Message = Mapping[str, str]


def is_conversation(prompt: object) -> TypeGuard[Sequence[Message]]:
    """Whether a prompt is a conversation: a list of message dicts (not text or ids)."""
    return (
        isinstance(prompt, Sequence)
        and not isinstance(prompt, str | bytes)
        and len(prompt) > 0
        and isinstance(prompt[0], Mapping)
    )


class _Refused(Exception):
    """What a template's ``raise_exception(message)`` raises."""


def _raise_exception(message: str) -> None:
    raise _Refused(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # As Hugging Face defines it: Jinja's own escapes HTML characters, which a prompt must keep.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)  # Llama 3's templates date their system prompt


@lru_cache(maxsize=1)
def _environment() -> Any:
    """The Jinja environment templates render in: Hugging Face's (a sandbox that lets no
    template change what it is given, ``trim_blocks``, ``lstrip_blocks``, loop controls
    and its helpers), except that reaching for an unsafe attribute (``__class__``...)
    fails the render instead of quietly rendering nothing."""
    from jinja2.exceptions import SecurityError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
            raise SecurityError(
                f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
            )

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A model's chat template: a conversation to the prompt text the model was trained
    on. Rendered as Hugging Face renders it (``apply_chat_template``): a sandboxed Jinja
    environment (a template is code that came with the model: it reads the messages and
    cannot reach Python's internals), ``trim_blocks`` and ``lstrip_blocks``, the
    variables ``messages``, ``add_generation_prompt``, ``bos_token`` and ``eos_token``
    (where the config names them) and the functions ``raise_exception``,
    ``strftime_now`` and the filter ``tojson``."""

    def __init__(
        self,
        model: str,
        source: str,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        origin: str = "",
    ) -> None:
        from jinja2 import TemplateError

        self.model = model
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        try:
            self._template = _environment().from_string(source)
        except TemplateError as exc:
            where = f" in {origin}" if origin else ""
            raise InvalidInput(
                f"model {model!r}: its chat template{where} is not valid Jinja: {exc}"
            ) from None

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (``[{"role": "user", "content": "..."}]``;
        roles ``system``, ``user``, ``assistant`` as the template knows them), ending
        where the assistant's answer starts when ``add_generation_prompt``.
        InvalidInput for messages that are not that, a conversation the template
        refuses (its ``raise_exception``), or a template that fails or tries something
        the sandbox stops."""
        from jinja2.exceptions import SecurityError

        variables: dict[str, Any] = {
            "messages": _checked(messages),
            "add_generation_prompt": bool(add_generation_prompt),
        }
        if self.bos_token is not None:
            variables["bos_token"] = self.bos_token
        if self.eos_token is not None:
            variables["eos_token"] = self.eos_token
        try:
            return str(self._template.render(**variables))
        except _Refused as exc:
            raise InvalidInput(
                f"model {self.model!r}: its chat template refuses this conversation: {exc}"
            ) from None
        except SecurityError as exc:
            raise InvalidInput(
                f"model {self.model!r}: its chat template tried something the sandbox does "
                f"not allow: {exc}"
            ) from None
        except Exception as exc:  # the template's own errors (undefined names, bad types)
            raise InvalidInput(
                f"model {self.model!r}: its chat template failed: {type(exc).__name__}: {exc}"
            ) from None


def _checked(messages: object) -> list[dict[str, str]]:
    """Messages as a template reads them: a non-empty list of dicts whose ``role`` and
    ``content`` are strings (copies: a template cannot change the caller's)."""
    if not is_conversation(messages):
        raise InvalidInput(
            'messages must be a non-empty list of {"role": ..., "content": ...} dicts, got '
            f"{messages!r:.80}"
        )
    assert isinstance(messages, Sequence)
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not all(
            isinstance(message.get(k), str) for k in ("role", "content")
        ):
            raise InvalidInput(
                f"messages[{i}] must be a dict with a string role and content, got {message!r:.80}"
            )
        checked.append(dict(message))
    return checked


def _token_text(token: object) -> str | None:
    """A special token as a tokenizer config writes it: text, or an AddedToken's dict."""
    if isinstance(token, Mapping):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _stamp(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return None


@lru_cache(maxsize=16)
def _load_template(
    model: str, folder: Path, stamps: tuple[float | None, float | None]
) -> ChatTemplate | None:
    config_path, template_path = folder / TOKENIZER_CONFIG_FILE, folder / TEMPLATE_FILE
    config: Any = {}
    if stamps[0] is not None:
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as exc:
            raise InvalidInput(f"model {model!r}: cannot read {config_path}: {exc}") from None
        if not isinstance(config, dict):
            raise InvalidInput(f"model {model!r}: {config_path} is not a JSON object")
    source, origin = config.get("chat_template"), str(config_path)
    if isinstance(source, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
        source = named.get("default")
    if stamps[1] is not None:
        source, origin = template_path.read_text(), str(template_path)
    if not isinstance(source, str) or not source.strip():
        return None
    return ChatTemplate(
        model,
        source,
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
        origin=origin,
    )


def chat_template_for(model: str, model_path: Path) -> ChatTemplate:
    """The chat template beside ``model``'s file: ``chat_template.jinja``, else the
    ``chat_template`` of ``tokenizer_config.json``; InvalidInput saying the model has
    none when neither is there (or it cannot be read here)."""
    folder = model_path.parent
    stamps = (_stamp(folder / TOKENIZER_CONFIG_FILE), _stamp(folder / TEMPLATE_FILE))
    template = _load_template(model, folder, stamps)
    if template is None:
        raise InvalidInput(
            f"model {model!r} has no chat template (no chat_template in a "
            f"{TOKENIZER_CONFIG_FILE} beside {model_path}, here): send the prompt as text "
            "or token ids"
        )
    return template
