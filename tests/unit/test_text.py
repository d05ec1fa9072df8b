"""Text in and out of a decoder, in the caller: a model folder's tokenizer.json, and
text decoded as tokens stream in, whole characters only."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.text import TOKENIZER_FILE, tokenizer_for
from edgefleet.errors import InvalidInput
from edgefleet.modelgen import make_tokenizer

TEXT = "the heron saw café crème, 日本語のテキスト and déjà vu"


@pytest.fixture
def tokenizer(tmp_path):
    make_tokenizer(tmp_path / TOKENIZER_FILE)
    return tokenizer_for("lm", tmp_path / "lm.onnx")


def test_text_round_trips_and_multi_byte_characters_span_tokens(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert tokenizer.decode(ids) == TEXT
    assert len(ids) > len(TEXT.split())  # words and characters over several tokens
    assert any("\ufffd" in tokenizer.decode(ids[:n]) for n in range(1, len(ids)))


def test_streamed_text_is_whole_characters_as_tokens_come(tokenizer):
    ids = tokenizer.encode(TEXT)
    decoder = tokenizer.decoder()
    pieces = [decoder.push([i]) for i in ids]
    pieces.append(decoder.finish())
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)
    assert sum(1 for p in pieces if p) > 5  # it streams, not all at the end


def test_a_model_without_a_tokenizer_says_it_takes_token_ids(tmp_path):
    with pytest.raises(InvalidInput, match=r"no tokenizer.json beside .*: it takes token ids"):
        tokenizer_for("lm", tmp_path / "lm.onnx")


def test_a_tokenizer_file_that_is_not_one_is_named(tmp_path):
    (tmp_path / TOKENIZER_FILE).write_text("{not json")
    with pytest.raises(InvalidInput, match=r"cannot read .*tokenizer.json"):
        tokenizer_for("lm", Path(tmp_path / "lm.onnx"))
