"""The ONNX Runtime engine on generated models: signatures, validation, batching, abort."""

from __future__ import annotations

import threading
import time

import numpy as np
import onnxruntime as ort
import pytest

from actors.engine import OnnxEngine, RunAborted, check_inputs
from edgefleet.errors import EngineError, InvalidInput, ModelNotFound
from edgefleet.modelgen import make_slow, random_inputs

MiB = 1024 * 1024


def engine(models_dir, name, **kw):
    return OnnxEngine(name, models_dir / f"{name}.onnx", **kw)


@pytest.mark.parametrize(
    ("name", "batchable"),
    [("classifier", True), ("detector", True), ("slow", True), ("stateful", False)],
)
def test_batchable_detection(models_dir, name, batchable):
    assert engine(models_dir, name).signature.batchable is batchable


def test_missing_file_is_model_not_found(tmp_path):
    with pytest.raises(ModelNotFound, match="does not exist"):
        OnnxEngine("x", tmp_path / "x.onnx")


def test_corrupt_file_is_engine_error(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(EngineError, match="cannot load"):
        OnnxEngine("bad", bad)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (
            {"images": np.zeros((1, 3, 32, 32), np.uint8)},
            "input 'images' expects float32 [N,3,32,32], got uint8 [1,3,32,32]",
        ),
        (
            {"images": np.zeros((3, 32, 32), np.float32)},
            "input 'images' expects float32 [N,3,32,32], got float32 [3,32,32]",
        ),
        (
            {"images": np.zeros((1, 3, 16, 32), np.float32)},
            "input 'images' expects float32 [N,3,32,32], got float32 [1,3,16,32]",
        ),
        ({"pixels": np.zeros((1, 3, 32, 32), np.float32)}, "unknown input 'pixels'"),
        ({}, "missing input 'images': expects float32 [N,3,32,32]"),
        ({"images": [[1.0]]}, "input 'images' expects a numpy array"),
        ({"images": np.zeros((0, 3, 32, 32), np.float32)}, "empty batch"),
        ({"images": np.zeros((64, 3, 32, 32), np.float32)}, "the limit is 65536 bytes"),
    ],
)
def test_validation_names_input_expected_and_got(models_dir, inputs, message):
    e = engine(models_dir, "classifier")
    with pytest.raises(InvalidInput) as info:
        e.check(inputs, max_bytes=64 * 1024)
    assert message in str(info.value)


def test_non_finite_inputs_are_refused_when_the_model_asks(models_dir):
    sig = engine(models_dir, "classifier").signature
    images = random_inputs("classifier")["images"]
    images[0, 0, 0, :2] = [np.nan, np.inf]
    assert check_inputs(sig, "classifier", {"images": images}, MiB).rows == 1
    with pytest.raises(InvalidInput, match="input 'images' of model 'classifier' holds 2 NaN"):
        check_inputs(sig, "classifier", {"images": images}, MiB, finite=True)


def test_stateful_validation_checks_fixed_dims(models_dir):
    e = engine(models_dir, "stateful")
    good = random_inputs("stateful")
    assert e.check(good, MiB).group is None  # cannot batch: runs alone
    bad = dict(good, state=np.zeros((1, 2, 16), np.float32))
    with pytest.raises(InvalidInput, match=r"input 'state' expects float32 \[2,1,16\]"):
        e.check(bad, MiB)


def test_batched_run_equals_single_runs_and_pads(models_dir):
    e = engine(models_dir, "classifier", pad_to=[4, 8])
    session = ort.InferenceSession(str(models_dir / "classifier.onnx"))
    batch = [random_inputs("classifier", batch=n, seed=i) for i, n in enumerate([1, 2, 1])]
    outs = e.run(batch)
    assert [o["logits"].shape[0] for o in outs] == [1, 2, 1]  # 4 rows run, padding dropped
    for inp, out in zip(batch, outs, strict=True):
        (expected,) = session.run(None, inp)
        np.testing.assert_allclose(out["logits"], expected, rtol=1e-4, atol=1e-5)


def test_shape_groups_differ_for_detector_sizes(models_dir):
    e = engine(models_dir, "detector")
    a = e.check(random_inputs("detector", height=32, width=32), MiB)
    b = e.check(random_inputs("detector", height=48, width=32), MiB)
    c = e.check(random_inputs("detector", batch=3, height=32, width=32, seed=1), MiB)
    assert a.group != b.group and a.group == c.group and c.rows == 3


def test_abort_interrupts_a_running_call(tmp_path):
    path = make_slow(tmp_path / "heavy.onnx", layers=400, width=512)
    e = OnnxEngine("heavy", path)
    x = {"x": np.ones((32, 512), np.float32)}
    t0 = time.perf_counter()
    e.run([x])
    full = time.perf_counter() - t0
    threading.Timer(full / 10, e.abort).start()
    t0 = time.perf_counter()
    with pytest.raises(RunAborted):
        e.run([x])
    assert time.perf_counter() - t0 < full * 0.8
    assert e.run([x])[0]["y"].shape == (32, 512)  # usable again after an abort


def test_a_stop_set_before_the_call_starts_is_not_missed(models_dir):
    # A preemption can arrive after the node hands a call to the engine thread but
    # before the thread enters ONNX Runtime: the call must not start at all.
    e = engine(models_dir, "classifier")
    stop = threading.Event()
    stop.set()
    with pytest.raises(RunAborted):
        e.run([random_inputs("classifier")], stop)
    assert e.run([random_inputs("classifier")], threading.Event())[0]["logits"].shape == (1, 10)
