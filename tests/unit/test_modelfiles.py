"""Input files and model signatures as the command line reads them (no Ray)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cluster.modelfiles import name_single_input, read_input_file
from edgefleet.config import load_config
from edgefleet.errors import InvalidInput, ModelNotFound
from edgefleet.modelgen import make_classifier, make_stateful, random_inputs


def test_an_npy_gets_the_name_of_the_single_input_its_model_takes(tmp_path: Path):
    make_classifier(tmp_path / "classifier.onnx")
    make_stateful(tmp_path / "stateful.onnx")
    (tmp_path / "fleet.yaml").write_text(
        "models:\n  clf: {path: classifier.onnx}\n  state: {path: stateful.onnx}\n"
        "  elsewhere: {path: elsewhere.onnx}\n"
    )
    config = load_config(tmp_path / "fleet.yaml")
    frame = tmp_path / "frame.npy"
    np.save(frame, random_inputs("classifier")["images"])
    array = read_input_file(frame)
    assert isinstance(array, np.ndarray)
    assert list(name_single_input(config, "clf", array)) == ["images"]
    with pytest.raises(InvalidInput, match=r"takes 2 inputs, x .*, state .*: use an .npz"):
        name_single_input(config, "state", array)
    with pytest.raises(InvalidInput, match="not on this machine"):
        name_single_input(config, "elsewhere", array)
    with pytest.raises(ModelNotFound, match="no model 'nope'; it has: clf, elsewhere, state"):
        name_single_input(config, "nope", array)


def test_an_npz_is_read_as_named_arrays(tmp_path: Path):
    np.savez(tmp_path / "in.npz", **random_inputs("stateful"))
    arrays = read_input_file(tmp_path / "in.npz")
    assert isinstance(arrays, dict) and sorted(arrays) == ["state", "x"]
    (tmp_path / "cut.npz").write_bytes((tmp_path / "in.npz").read_bytes()[:40])
    with pytest.raises(InvalidInput, match=r"cut.npz is not a NumPy .npz/.npy file"):
        read_input_file(tmp_path / "cut.npz")


def test_models_show_says_when_a_decoder_is_dynamically_quantized(tmp_path: Path):
    import onnxruntime as ort
    from onnxruntime.quantization import quantize_dynamic

    from actors.engine import session_signature
    from cluster.modelfiles import signature_lines
    from edgefleet.config import ModelConfig
    from edgefleet.modelgen import make_tiny_lm

    plain = make_tiny_lm(tmp_path / "lm.onnx")
    quantized = tmp_path / "lm.int8.onnx"
    quantize_dynamic(str(plain), str(quantized))
    for path, said in ((plain, False), (quantized, True)):
        sig = session_signature(ort.InferenceSession(str(path)))
        lines = signature_lines("lm", ModelConfig(path=path, kind="decoder"), sig)
        assert any("dynamically quantized" in line for line in lines) is said
