"""Tests for edgefleet.modelgen: signatures, numerics, determinism and the registry."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from edgefleet import modelgen
from edgefleet.modelgen import (
    BUILTIN_MODELS,
    calibrate_slow,
    make_all,
    make_classifier,
    make_detector,
    make_slow,
    make_stateful,
    random_inputs,
)

FLOAT = "tensor(float)"


def _session(path: Path) -> Any:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _signature(args: list[Any]) -> list[tuple[str, str, list[int | str]]]:
    return [(a.name, a.type, list(a.shape)) for a in args]


def _run(session: Any, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feed), strict=True))


# --------------------------------------------------------------------------- signatures


def test_classifier_signature_and_run(tmp_path: Path) -> None:
    path = make_classifier(tmp_path / "classifier.onnx")
    assert path == tmp_path / "classifier.onnx" and path.is_file()
    sess = _session(path)
    assert _signature(sess.get_inputs()) == [("images", FLOAT, ["N", 3, 32, 32])]
    assert _signature(sess.get_outputs()) == [("logits", FLOAT, ["N", 10])]

    out = _run(sess, random_inputs("classifier", 3))
    assert out["logits"].shape == (3, 10)
    assert out["logits"].dtype == np.float32
    assert np.isfinite(out["logits"]).all()
    # Distinct images should not collapse to one prediction vector.
    assert not np.allclose(out["logits"][0], out["logits"][1])


def test_detector_signature_and_run(tmp_path: Path) -> None:
    sess = _session(make_detector(tmp_path / "detector.onnx"))
    assert _signature(sess.get_inputs()) == [("images", FLOAT, ["N", 3, "H", "W"])]
    assert _signature(sess.get_outputs()) == [
        ("heatmap", FLOAT, ["N", 5, "H", "W"]),
        ("scores", FLOAT, ["N", 5]),
    ]

    out = _run(sess, random_inputs("detector", 2))
    assert out["heatmap"].shape == (2, 5, 32, 32)
    assert out["scores"].shape == (2, 5)
    assert np.isfinite(out["heatmap"]).all() and np.isfinite(out["scores"]).all()
    # scores is defined as Sigmoid(max over H, W of the heatmap).
    expected = 1.0 / (1.0 + np.exp(-out["heatmap"].max(axis=(2, 3))))
    np.testing.assert_allclose(out["scores"], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("height", "width"), [(32, 32), (17, 45)])
def test_detector_runs_at_different_sizes(tmp_path: Path, height: int, width: int) -> None:
    sess = _session(make_detector(tmp_path / "detector.onnx"))
    feed = random_inputs("detector", 1, height=height, width=width)
    assert feed["images"].shape == (1, 3, height, width)
    out = _run(sess, feed)
    assert out["heatmap"].shape == (1, 5, height, width)
    assert out["scores"].shape == (1, 5)
    assert np.isfinite(out["heatmap"]).all()
    assert ((out["scores"] > 0) & (out["scores"] < 1)).all()


def test_stateful_signature_and_run(tmp_path: Path) -> None:
    sess = _session(make_stateful(tmp_path / "stateful.onnx"))
    # Every dim is fixed (ints), which is what marks the model as non-batchable.
    assert _signature(sess.get_inputs()) == [
        ("x", FLOAT, []),
        ("state", FLOAT, [2, 1, 16]),
    ]
    assert _signature(sess.get_outputs()) == [
        ("y", FLOAT, []),
        ("new_state", FLOAT, [2, 1, 16]),
    ]

    feed = random_inputs("stateful")
    assert feed["x"].shape == () and feed["state"].shape == (2, 1, 16)
    out = _run(sess, feed)
    assert out["y"].shape == ()
    assert out["new_state"].shape == (2, 1, 16)
    assert np.isfinite(out["new_state"]).all()
    assert np.abs(out["new_state"]).max() <= 1.0  # Tanh range
    np.testing.assert_allclose(out["y"], out["new_state"].sum(), rtol=1e-5, atol=1e-5)


def test_stateful_output_depends_on_state(tmp_path: Path) -> None:
    sess = _session(make_stateful(tmp_path / "stateful.onnx"))
    feed = random_inputs("stateful", seed=1)
    first = _run(sess, feed)
    # Feeding the new state back in is how a caller would step the model.
    second = _run(sess, {"x": feed["x"], "state": first["new_state"]})
    assert not np.allclose(first["new_state"], second["new_state"])
    assert not np.isclose(first["y"], second["y"])
    # Same inputs give the same outputs: the state is explicit, not hidden in the session.
    again = _run(sess, feed)
    np.testing.assert_array_equal(first["new_state"], again["new_state"])


def test_stateful_inputs_refuse_batching() -> None:
    with pytest.raises(ValueError, match="cannot be batched"):
        random_inputs("stateful", 2)


def test_slow_signature_and_run(tmp_path: Path) -> None:
    sess = _session(make_slow(tmp_path / "slow.onnx"))
    assert _signature(sess.get_inputs()) == [("x", FLOAT, ["N", 256])]
    assert _signature(sess.get_outputs()) == [("y", FLOAT, ["N", 256])]
    out = _run(sess, random_inputs("slow", 2))
    assert out["y"].shape == (2, 256)
    assert np.isfinite(out["y"]).all()
    # Unit-variance scaling means Tanh neither saturates nor collapses to zero.
    assert 0.05 < float(np.abs(out["y"]).mean()) < 0.95


def test_slow_custom_width(tmp_path: Path) -> None:
    sess = _session(make_slow(tmp_path / "slow.onnx", layers=3, width=64))
    assert _signature(sess.get_inputs()) == [("x", FLOAT, ["N", 64])]
    (y,) = sess.run(None, {"x": np.ones((4, 64), dtype=np.float32)})
    assert y.shape == (4, 64)


def test_slow_more_layers_more_nodes(tmp_path: Path) -> None:
    few = onnx.load(str(make_slow(tmp_path / "few.onnx", layers=2)))
    many = onnx.load(str(make_slow(tmp_path / "many.onnx", layers=12)))
    assert len(few.graph.node) == 4
    assert len(many.graph.node) == 24
    # Weights are pooled, so depth does not grow the file without bound.
    assert len(many.graph.initializer) == modelgen.SLOW_DISTINCT_WEIGHTS


def test_slow_rejects_bad_layers(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="layers"):
        make_slow(tmp_path / "bad.onnx", layers=0)


@pytest.mark.parametrize(
    "factory", [make_classifier, make_detector, make_stateful, make_slow], ids=lambda f: f.__name__
)
def test_models_are_checked_opset17_ir8(tmp_path: Path, factory: Callable[[Path], Path]) -> None:
    model = onnx.load(str(factory(tmp_path / "m.onnx")))
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 8
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]


# --------------------------------------------------------------------------- batching


@pytest.mark.parametrize("name", ["classifier", "slow"])
def test_batch_rows_match_single_runs(tmp_path: Path, name: str) -> None:
    sess = _session(BUILTIN_MODELS[name](tmp_path / f"{name}.onnx"))
    (input_name,) = [i.name for i in sess.get_inputs()]
    batch = random_inputs(name, 5, seed=3)[input_name]
    assert batch.shape[0] == 5

    (batched,) = sess.run(None, {input_name: batch})
    assert batched.shape[0] == 5
    for row in range(5):
        (single,) = sess.run(None, {input_name: batch[row : row + 1]})
        assert single.shape[0] == 1
        np.testing.assert_allclose(batched[row], single[0], rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_generation_is_byte_identical(tmp_path: Path, name: str) -> None:
    first = BUILTIN_MODELS[name](tmp_path / "a" / f"{name}.onnx")
    second = BUILTIN_MODELS[name](tmp_path / "b" / f"{name}.onnx")
    assert first.read_bytes() == second.read_bytes()
    assert len(first.read_bytes()) > 0


def test_seed_changes_weights(tmp_path: Path) -> None:
    a = make_classifier(tmp_path / "a.onnx", seed=0).read_bytes()
    b = make_classifier(tmp_path / "b.onnx", seed=1).read_bytes()
    assert a != b


def test_random_inputs_deterministic_and_seeded() -> None:
    a = random_inputs("detector", 2, seed=7)
    b = random_inputs("detector", 2, seed=7)
    c = random_inputs("detector", 2, seed=8)
    np.testing.assert_array_equal(a["images"], b["images"])
    assert not np.array_equal(a["images"], c["images"])
    assert a["images"].dtype == np.float32


def test_random_inputs_unknown_model() -> None:
    with pytest.raises(ValueError, match="unknown builtin model"):
        random_inputs("nope")


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_random_inputs_match_session_inputs(tmp_path: Path, name: str) -> None:
    sess = _session(BUILTIN_MODELS[name](tmp_path / f"{name}.onnx"))
    feed = random_inputs(name)
    assert sorted(feed) == sorted(i.name for i in sess.get_inputs())
    for arg in sess.get_inputs():
        value = feed[arg.name]
        assert value.dtype == np.float32
        assert value.ndim == len(arg.shape)
        for got, want in zip(value.shape, arg.shape, strict=True):
            assert isinstance(want, str) or got == want
    outputs = sess.run(None, feed)
    assert all(np.isfinite(o).all() for o in outputs)


# --------------------------------------------------------------------------- calibration


def test_calibrate_slow_writes_loadable_model(tmp_path: Path) -> None:
    path, layers = calibrate_slow(tmp_path / "calibrated.onnx", 2.0)
    assert path == tmp_path / "calibrated.onnx"
    assert isinstance(layers, int) and layers >= 1
    model = onnx.load(str(path))
    assert len(model.graph.node) == 2 * layers
    sess = _session(path)
    (y,) = sess.run(None, random_inputs("slow"))
    assert y.shape == (1, 256) and np.isfinite(y).all()


def test_calibrate_slow_longer_target_needs_more_layers(tmp_path: Path) -> None:
    _, short = calibrate_slow(tmp_path / "short.onnx", 0.2)
    _, long = calibrate_slow(tmp_path / "long.onnx", 4.0)
    # 20x the target: even on a noisy machine the deeper model must be clearly deeper.
    assert long > 2 * short


def test_calibrate_slow_rejects_bad_target(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="target_ms"):
        calibrate_slow(tmp_path / "x.onnx", 0.0)


# --------------------------------------------------------------------------- registry


def test_builtin_registry_contents() -> None:
    assert set(BUILTIN_MODELS) >= {"classifier", "detector", "stateful", "slow"}
    for name, spec in BUILTIN_MODELS.items():
        assert spec.name == name
        assert spec.filename == f"{name}.onnx"


def test_make_all_writes_everything_and_reports(tmp_path: Path) -> None:
    target = tmp_path / "new" / "models"
    calls: list[tuple[str, Path]] = []
    written = make_all(target, progress=lambda name, path: calls.append((name, path)))

    # Compare against the registry so adding a generator later does not break this test.
    expected = set(BUILTIN_MODELS)
    assert {"classifier", "detector", "stateful", "slow", "heavy"} == expected
    assert set(written) == expected
    assert len(calls) == len(expected) == 5
    assert {name for name, _ in calls} == expected
    for name, path in calls:
        assert path == written[name] == target / f"{name}.onnx"
        assert path.is_file()
        _session(path)  # every written file loads
    # Nothing else (e.g. leftover temp files) is left in the directory.
    assert sorted(p.name for p in target.iterdir()) == sorted(f"{n}.onnx" for n in expected)


def test_make_all_without_progress(tmp_path: Path) -> None:
    written = make_all(tmp_path)
    assert all(p.is_file() for p in written.values())
    assert set(written) == set(BUILTIN_MODELS)
