"""A decoder folder as ONNX Runtime GenAI's builder writes it: model.onnx beside a
genai_config.json and no config.json. The facts the decoder needs (context length,
end-of-sequence ids, heads and head size) are read from genai_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from actors.decoder import DecoderEngine, genai_facts
from edgefleet.errors import EngineError
from edgefleet.modelgen import make_tiny_lm


def genai_folder(tmp_path: Path, **decoder_names: str) -> Path:
    """The tiny LM without its ONNX metadata, with a genai_config.json as the builder
    writes one (trimmed to what matters here)."""
    path = make_tiny_lm(tmp_path / "source.onnx")
    model = onnx.load(str(path))
    del model.metadata_props[:]  # what it knows comes from genai_config.json alone
    folder = tmp_path / "phi-tiny"
    folder.mkdir()
    onnx.save(model, str(folder / "model.onnx"))
    config = {
        "model": {
            "context_length": 96,
            "eos_token_id": [7, 9],
            "pad_token_id": 0,
            "vocab_size": 512,
            "type": "llama",
            "decoder": {
                "filename": "model.onnx",
                "head_size": 32,
                "hidden_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "num_hidden_layers": 4,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                    **decoder_names,
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {"max_length": 96},
    }
    (folder / "genai_config.json").write_text(json.dumps(config))
    return folder / "model.onnx"


def test_a_genai_folder_loads_with_what_its_genai_config_says(tmp_path):
    path = genai_folder(tmp_path)
    assert not (path.parent / "config.json").exists()
    engine = DecoderEngine("phi", path)
    assert engine.max_context == 96
    assert engine.stop_ids == (7, 9)
    assert genai_facts(path)["num_key_value_heads"] == 4


def test_tensor_names_edgefleet_does_not_run_by_are_a_clear_error(tmp_path):
    path = genai_folder(tmp_path, past_key_names="past.%d.k")
    with pytest.raises(
        EngineError, match=r"names the model's tensors otherwise: inputs.past_key_names='past.%d.k'"
    ):
        DecoderEngine("phi", path)


def test_models_show_prints_what_was_read(tmp_path, capsys):
    from cluster.cli import main

    path = genai_folder(tmp_path)
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(f"models:\n  phi: {{path: {path}, kind: decoder}}\n")
    assert main(["models", "show", str(fleet)]) == 0
    out = capsys.readouterr().out
    assert "read from genai_config.json: max_position_embeddings 96, eos_token_id [7, 9]" in out
