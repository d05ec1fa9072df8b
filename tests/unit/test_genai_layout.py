"""A decoder folder as ONNX Runtime GenAI's builder writes it: model.onnx beside a
genai_config.json and no config.json. The facts the decoder needs (context length,
end-of-sequence ids, heads and head size) are read from genai_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.decoder import DecoderEngine, genai_facts
from edgefleet.errors import EngineError
from edgefleet.modelgen import make_genai_lm


def genai_folder(tmp_path: Path, **decoder_names: str) -> Path:
    """A GenAI builder's folder (the project's generator writes one), its
    genai_config.json saying two end-of-sequence ids and tensor names of
    ``decoder_names``."""
    path = make_genai_lm(tmp_path / "phi-tiny", max_context=96, kv_heads=2)
    file = path.parent / "genai_config.json"
    config = json.loads(file.read_text())
    config["model"]["eos_token_id"] = [7, 9]
    config["model"]["decoder"]["inputs"].update(decoder_names)
    file.write_text(json.dumps(config))
    return path


def test_a_genai_folder_loads_with_what_its_genai_config_says(tmp_path):
    path = genai_folder(tmp_path)
    assert not (path.parent / "config.json").exists()
    engine = DecoderEngine("phi", path)
    assert engine.max_context == 96
    assert engine.stop_ids == (7, 9)
    assert genai_facts(path)["num_key_value_heads"] == 2


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
