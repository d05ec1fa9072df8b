"""Text in and out of a decoder: the ``tokenizer.json`` beside a model's file (every
ONNX Runtime GenAI build and Hugging Face export ships one), read with the Hugging Face
``tokenizers`` package.

The caller tokenizes, not the node: nodes keep speaking token ids, which is what their
caches, sessions, shared prefixes and the continuation of a generation whose node was
lost are keyed by, and a small device spends no CPU on text. The caller needs the
tokenizer file: the deployer's model folder, or a copy at the same path.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

from edgefleet.errors import InvalidInput

TOKENIZER_FILE = "tokenizer.json"
_REPLACEMENT = "\ufffd"  # what a decode gives for the first bytes of a character cut short


class Tokenizer:
    """A model's tokenizer: text to token ids and back."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as HfTokenizer

        self.path = path
        self._tok = HfTokenizer.from_file(str(path))

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self._tok.encode(text).ids)

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
