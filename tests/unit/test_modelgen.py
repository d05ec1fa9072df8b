"""Tests for edgefleet.modelgen: signatures, numerics, determinism and the registry."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from edgefleet import modelgen
from edgefleet.modelgen import (
    BUILTIN_MODELS,
    calibrate_slow,
    make_all,
    make_classifier,
    make_detector,
    make_slow,
    make_spin,
    make_stateful,
    make_tiny_lm,
    random_inputs,
)

FLOAT = "tensor(float)"
INT64 = "tensor(int64)"
DTYPES = {FLOAT: np.float32, INT64: np.int64}


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
    "factory",
    [make_classifier, make_detector, make_stateful, make_slow, make_tiny_lm],
    ids=lambda f: f.__name__,
)
def test_models_are_checked_opset17_ir8(tmp_path: Path, factory: Callable[[Path], Path]) -> None:
    model = onnx.load(str(factory(tmp_path / "m.onnx")))
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 8
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]


def test_spin_runs_as_many_steps_as_asked_and_is_byte_identical(tmp_path: Path) -> None:
    path = make_spin(tmp_path / "spin.onnx")
    assert make_spin(tmp_path / "again.onnx").read_bytes() == path.read_bytes()
    x = np.linspace(-2, 2, 8, dtype=np.float32).reshape(2, 4)
    sess = _session(path)
    (y,) = sess.run(None, {"x": x, "steps": np.array(3, np.int64)})
    np.testing.assert_allclose(y, np.tanh(np.tanh(np.tanh(x))), rtol=1e-6)
    (y0,) = sess.run(None, {"x": x, "steps": np.array(0, np.int64)})
    np.testing.assert_array_equal(y0, x)


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
        assert value.dtype == DTYPES[arg.type]
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
    assert set(BUILTIN_MODELS) >= {"classifier", "detector", "stateful", "slow", "tiny_lm"}
    for name, spec in BUILTIN_MODELS.items():
        assert spec.name == name
        assert spec.filename == f"{name}.onnx"


def test_the_command_line_names_the_builtin_models_without_importing_onnx() -> None:
    from cluster.cli.models import BUILTIN

    assert tuple(BUILTIN_MODELS) == BUILTIN
    shown = "import sys, cluster.cli; cluster.cli.build_parser(); print('onnx' in sys.modules)"
    ran = subprocess.run([sys.executable, "-c", shown], capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "False"


def test_make_all_writes_everything_and_reports(tmp_path: Path) -> None:
    target = tmp_path / "new" / "models"
    calls: list[tuple[str, Path]] = []
    written = make_all(target, progress=lambda name, path: calls.append((name, path)))

    # Compare against the registry so adding a generator later does not break this test.
    expected = set(BUILTIN_MODELS)
    assert {"classifier", "detector", "stateful", "slow", "heavy", "tiny_lm"} == expected
    assert set(written) == expected
    assert len(calls) == len(expected) == 6
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


# --------------------------------------------------------------------------- tiny LM

LAYERS, HEADS, HEAD_DIM, VOCAB, CONTEXT = 4, 4, 32, 512, 512
Feed = dict[str, np.ndarray]


@pytest.fixture(scope="module")
def tiny_lm_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_lm(tmp_path_factory.mktemp("tiny_lm") / "tiny_lm.onnx")


@pytest.fixture(scope="module")
def lm(tiny_lm_path: Path) -> Any:
    return _session(tiny_lm_path)


def _weights(path: Path) -> dict[str, np.ndarray]:
    model = onnx.load(str(path))
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _empty_past(batch: int, layers: int = LAYERS) -> Feed:
    empty = np.zeros((batch, HEADS, 0, HEAD_DIM), dtype=np.float32)
    return {f"past_key_values.{i}.{k}": empty for i in range(layers) for k in ("key", "value")}


def _lm_call(
    sess: Any, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: Feed
) -> tuple[np.ndarray, Feed]:
    """One call of the model: returns the logits and the presents renamed as the next past."""
    feed = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **past}
    out = _run(sess, {k: np.ascontiguousarray(v) for k, v in feed.items()})
    layers = len(past) // 2
    new_past = {
        f"past_key_values.{i}.{k}": out[f"present.{i}.{k}"]
        for i in range(layers)
        for k in ("key", "value")
    }
    return out["logits"], new_past


def _full_forward(sess: Any, ids: np.ndarray) -> np.ndarray:
    batch, seq = ids.shape
    positions = np.tile(np.arange(seq, dtype=np.int64), (batch, 1))
    mask = np.ones((batch, seq), dtype=np.int64)
    logits, _ = _lm_call(sess, ids, mask, positions, _empty_past(batch))
    return logits


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * weight + bias


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def _reference_logits(
    weights: dict[str, np.ndarray], ids: np.ndarray, heads: int, kv_heads: int | None = None
) -> np.ndarray:
    """Pre-LN GPT-2 forward over whole unpadded sequences in float64 numpy; with
    ``kv_heads``, query head ``h`` attends with K/V head ``h // (heads // kv_heads)``."""
    w = {name: array.astype(np.float64) for name, array in weights.items()}
    batch, seq = ids.shape
    hidden = w["wte"].shape[1]
    head_dim = hidden // heads
    kv = kv_heads or heads
    layers = sum(1 for name in w if name.endswith(".ln_1.weight"))
    causal = np.tril(np.ones((seq, seq), dtype=bool))

    def split_heads(x: np.ndarray) -> np.ndarray:
        return x.reshape(batch, seq, -1, head_dim).transpose(0, 2, 1, 3)

    h = w["wte"][ids] + w["wpe"][np.arange(seq)]
    for i in range(layers):
        p = f"h.{i}."
        x = _layer_norm(h, w[p + "ln_1.weight"], w[p + "ln_1.bias"])
        qkv = x @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = (
            split_heads(part) for part in np.split(qkv, [hidden, hidden + kv * head_dim], -1)
        )
        k, v = (np.repeat(t, heads // kv, axis=1) for t in (k, v))
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(head_dim)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        context = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, seq, hidden)
        h = h + context @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        x = _layer_norm(h, w[p + "ln_2.weight"], w[p + "ln_2.bias"])
        fc = _gelu_tanh(x @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"])
        h = h + fc @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    return _layer_norm(h, w["ln_f.weight"], w["ln_f.bias"]) @ w["lm_head.weight"]


def _greedy(sess: Any, prompt: list[int], steps: int) -> list[int]:
    """Greedy decoding with the KV cache: a prefill call, then one token per call."""
    ids = np.array([prompt], dtype=np.int64)
    logits, past = _lm_call(
        sess,
        ids,
        np.ones_like(ids),
        np.arange(len(prompt), dtype=np.int64)[None],
        _empty_past(1),
    )
    tokens: list[int] = []
    for _ in range(steps):
        tokens.append(int(logits[0, -1].argmax()))
        length = len(prompt) + len(tokens)
        logits, past = _lm_call(
            sess,
            np.array([[tokens[-1]]], dtype=np.int64),
            np.ones((1, length), dtype=np.int64),
            np.array([[length - 1]], dtype=np.int64),
            past,
        )
    return tokens


def _has_short_loop(tokens: list[int], window: int = 8) -> bool:
    """Whether some ``window`` consecutive tokens repeat with period 1 or 2."""
    for period in (1, 2):
        run = 0
        for i in range(period, len(tokens)):
            run = run + 1 if tokens[i] == tokens[i - period] else 0
            if run + period >= window:
                return True
    return False


def test_tiny_lm_signature(lm: Any) -> None:
    cache_in = ["batch_size", HEADS, "past_sequence_length", HEAD_DIM]
    cache_out = ["batch_size", HEADS, "total_sequence_length", HEAD_DIM]
    assert _signature(lm.get_inputs()) == [
        ("input_ids", INT64, ["batch_size", "sequence_length"]),
        ("attention_mask", INT64, ["batch_size", "total_sequence_length"]),
        ("position_ids", INT64, ["batch_size", "sequence_length"]),
    ] + [
        (f"past_key_values.{i}.{kind}", FLOAT, cache_in)
        for i in range(LAYERS)
        for kind in ("key", "value")
    ]
    assert _signature(lm.get_outputs()) == [
        ("logits", FLOAT, ["batch_size", "sequence_length", VOCAB]),
    ] + [
        (f"present.{i}.{kind}", FLOAT, cache_out)
        for i in range(LAYERS)
        for kind in ("key", "value")
    ]


def test_tiny_lm_custom_size_signature(tmp_path: Path) -> None:
    path = make_tiny_lm(
        tmp_path / "lm.onnx", layers=2, heads=2, head_dim=8, vocab=50, max_context=64
    )
    sess = _session(path)
    inputs = _signature(sess.get_inputs())
    assert [name for name, _, _ in inputs][3:] == [
        "past_key_values.0.key",
        "past_key_values.0.value",
        "past_key_values.1.key",
        "past_key_values.1.value",
    ]
    assert inputs[3][2] == ["batch_size", 2, "past_sequence_length", 8]
    assert _signature(sess.get_outputs())[0] == (
        "logits",
        FLOAT,
        ["batch_size", "sequence_length", 50],
    )
    assert _weights(path)["wpe"].shape == (64, 16)
    assert sess.get_modelmeta().custom_metadata_map["max_position_embeddings"] == "64"


def test_tiny_lm_metadata(tiny_lm_path: Path, lm: Any) -> None:
    props = {p.key: p.value for p in onnx.load(str(tiny_lm_path)).metadata_props}
    assert props == {"max_position_embeddings": "512", "model_type": "edgefleet-tiny-lm"}
    assert lm.get_modelmeta().custom_metadata_map == props
    assert (modelgen.TINY_LM_VOCAB, modelgen.TINY_LM_CONTEXT) == (VOCAB, CONTEXT)


def test_tiny_lm_rejects_bad_sizes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="heads"):
        make_tiny_lm(tmp_path / "bad.onnx", heads=0)


def test_tiny_lm_file_is_small(tiny_lm_path: Path) -> None:
    assert tiny_lm_path.stat().st_size < 8 * 1024 * 1024


def test_tiny_lm_matches_numpy_reference(tiny_lm_path: Path, lm: Any) -> None:
    ids = np.random.default_rng(1).integers(0, VOCAB, size=(3, 21), dtype=np.int64)
    expected = _reference_logits(_weights(tiny_lm_path), ids, HEADS)
    got = _full_forward(lm, ids)
    assert got.shape == (3, 21, VOCAB) and got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    # Logits of this size make the comparison meaningful: not all ~0, not saturated.
    assert 0.3 < float(got.std()) < 10.0


def test_tiny_lm_custom_size_matches_numpy_reference(tmp_path: Path) -> None:
    path = make_tiny_lm(
        tmp_path / "lm.onnx", layers=2, heads=2, head_dim=8, vocab=50, max_context=64, seed=3
    )
    ids = np.random.default_rng(2).integers(0, 50, size=(2, 64), dtype=np.int64)
    sess = _session(path)
    positions = np.tile(np.arange(64, dtype=np.int64), (2, 1))
    empty = np.zeros((2, 2, 0, 8), dtype=np.float32)
    past = {f"past_key_values.{i}.{k}": empty for i in range(2) for k in ("key", "value")}
    logits, _ = _lm_call(sess, ids, np.ones_like(ids), positions, past)
    np.testing.assert_allclose(
        logits, _reference_logits(_weights(path), ids, 2), rtol=1e-4, atol=1e-4
    )


def test_tiny_lm_random_inputs_are_a_prefill(lm: Any) -> None:
    feed = random_inputs("tiny_lm", 3, seed=4)
    assert feed["input_ids"].shape == (3, 8)
    assert ((feed["input_ids"] >= 0) & (feed["input_ids"] < VOCAB)).all()
    np.testing.assert_array_equal(feed["position_ids"], np.tile(np.arange(8), (3, 1)))
    assert (feed["attention_mask"] == 1).all()
    out = _run(lm, feed)
    assert out["logits"].shape == (3, 8, VOCAB)
    for i in range(LAYERS):
        assert feed[f"past_key_values.{i}.key"].shape == (3, HEADS, 0, HEAD_DIM)
        assert out[f"present.{i}.value"].shape == (3, HEADS, 8, HEAD_DIM)
    assert not np.array_equal(feed["input_ids"], random_inputs("tiny_lm", 3, seed=5)["input_ids"])


@pytest.mark.parametrize("chunks", [[10, 1, 1, 1, 1, 1], [6, 4, 5], [1] * 15])
def test_tiny_lm_kv_cache_matches_full_forward(lm: Any, chunks: list[int]) -> None:
    ids = np.random.default_rng(7).integers(0, VOCAB, size=(2, 15), dtype=np.int64)
    full = _full_forward(lm, ids)
    past = _empty_past(2)
    pieces = []
    start = 0
    for size in chunks:
        stop = start + size
        positions = np.tile(np.arange(start, stop, dtype=np.int64), (2, 1))
        mask = np.ones((2, stop), dtype=np.int64)
        logits, past = _lm_call(lm, ids[:, start:stop], mask, positions, past)
        assert logits.shape == (2, size, VOCAB)
        assert past["past_key_values.0.key"].shape == (2, HEADS, stop, HEAD_DIM)
        pieces.append(logits)
        start = stop
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=1e-4, atol=1e-4)


def test_tiny_lm_present_is_past_plus_chunk(lm: Any) -> None:
    ids = np.random.default_rng(8).integers(0, VOCAB, size=(1, 9), dtype=np.int64)
    _, first = _lm_call(
        lm, ids[:, :6], np.ones((1, 6), np.int64), np.arange(6)[None], _empty_past(1)
    )
    _, second = _lm_call(lm, ids[:, 6:], np.ones((1, 9), np.int64), np.arange(6, 9)[None], first)
    for name, old in first.items():
        np.testing.assert_array_equal(second[name][:, :, :6], old)


def test_tiny_lm_incremental_greedy_equals_recomputed_greedy(lm: Any) -> None:
    prompt = [int(t) for t in np.random.default_rng(9).integers(0, VOCAB, size=10)]
    incremental = _greedy(lm, prompt, 12)
    sequence = list(prompt)
    for _ in range(12):
        logits = _full_forward(lm, np.array([sequence], dtype=np.int64))
        sequence.append(int(logits[0, -1].argmax()))
    assert incremental == sequence[len(prompt) :]


def test_tiny_lm_left_padding_matches_unpadded(lm: Any) -> None:
    rng = np.random.default_rng(10)
    prompts = [rng.integers(0, VOCAB, size=n, dtype=np.int64) for n in (7, 12)]
    width = max(len(p) for p in prompts)
    ids = np.zeros((2, width), dtype=np.int64)
    mask = np.zeros((2, width), dtype=np.int64)
    positions = np.ones((2, width), dtype=np.int64)  # pads get 1, as Hugging Face does
    for row, prompt in enumerate(prompts):
        pad = width - len(prompt)
        ids[row, pad:] = prompt
        mask[row, pad:] = 1
        positions[row, pad:] = np.arange(len(prompt))
    batched, past = _lm_call(lm, ids, mask, positions, _empty_past(2))
    assert np.isfinite(batched).all()

    singles = []
    for row, prompt in enumerate(prompts):
        n = len(prompt)
        alone, single_past = _lm_call(
            lm, prompt[None], np.ones((1, n), np.int64), np.arange(n)[None], _empty_past(1)
        )
        np.testing.assert_allclose(batched[row, width - n :], alone[0], rtol=1e-4, atol=1e-4)
        singles.append((alone, single_past, n))

    # Decoding on from the padded cache still matches each prompt decoded alone.
    next_ids = batched[:, -1].argmax(-1)
    for _ in range(3):
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
        positions = positions[:, -1:] + 1
        batched, past = _lm_call(lm, next_ids[:, None], mask, positions, past)
        for row, (alone, single_past, n) in enumerate(singles):
            token = np.array([[next_ids[row]]], dtype=np.int64)
            alone, single_past = _lm_call(
                lm, token, np.ones((1, n + 1), np.int64), np.array([[n]]), single_past
            )
            np.testing.assert_allclose(batched[row], alone[0], rtol=1e-4, atol=1e-4)
            singles[row] = (alone, single_past, n + 1)
        next_ids = batched[:, -1].argmax(-1)


def test_tiny_lm_fully_padded_row_stays_finite(lm: Any) -> None:
    ids = np.array([[5, 6, 7], [0, 0, 0]], dtype=np.int64)
    mask = np.array([[1, 1, 1], [0, 0, 0]], dtype=np.int64)
    positions = np.array([[0, 1, 2], [1, 1, 1]], dtype=np.int64)
    logits, past = _lm_call(lm, ids, mask, positions, _empty_past(2))
    assert np.isfinite(logits).all()
    assert all(np.isfinite(v).all() for v in past.values())
    np.testing.assert_allclose(logits[0], _full_forward(lm, ids[:1])[0], rtol=1e-4, atol=1e-4)


def test_tiny_lm_generation_is_seeded(tmp_path: Path) -> None:
    a = make_tiny_lm(tmp_path / "a.onnx", seed=0).read_bytes()
    b = make_tiny_lm(tmp_path / "b.onnx", seed=0).read_bytes()
    c = make_tiny_lm(tmp_path / "c.onnx", seed=1).read_bytes()
    assert a == b
    assert a != c


@pytest.mark.parametrize(
    "prompt",
    [[0], [511], [7] * 8, list(range(1, 11)), [100, 200] * 6, list(range(0, 40, 3))],
    ids=["bos", "last", "repeated", "counting", "alternating", "stride3"],
)
def test_tiny_lm_greedy_is_not_degenerate(lm: Any, prompt: list[int]) -> None:
    tokens = _greedy(lm, prompt, 48)
    assert len(set(tokens)) >= 8, tokens
    assert not _has_short_loop(tokens), tokens


def test_short_loop_detector() -> None:
    assert _has_short_loop([1, 2, 3] + [4] * 8)
    assert _has_short_loop([9] + [4, 5] * 4)
    assert not _has_short_loop([4, 4, 4, 5, 6, 5, 6, 7] * 3)


# --------------------------------------------------------------- grouped-query attention

GQA_HEADS, GQA_KV_HEADS = 4, 2


@pytest.fixture(scope="module")
def gqa_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("gqa")
    return make_tiny_lm(directory / "gqa.onnx", heads=GQA_HEADS, kv_heads=GQA_KV_HEADS)


def _gqa_past(batch: int) -> Feed:
    empty = np.zeros((batch, GQA_KV_HEADS, 0, HEAD_DIM), dtype=np.float32)
    return {f"past_key_values.{i}.{k}": empty for i in range(LAYERS) for k in ("key", "value")}


def test_tiny_lm_gqa_signature_and_metadata(gqa_path: Path) -> None:
    sess = _session(gqa_path)
    cache_in = ["batch_size", GQA_KV_HEADS, "past_sequence_length", HEAD_DIM]
    cache_out = ["batch_size", GQA_KV_HEADS, "total_sequence_length", HEAD_DIM]
    assert _signature(sess.get_inputs())[3:] == [
        (f"past_key_values.{i}.{kind}", FLOAT, cache_in)
        for i in range(LAYERS)
        for kind in ("key", "value")
    ]
    assert _signature(sess.get_outputs())[1:] == [
        (f"present.{i}.{kind}", FLOAT, cache_out)
        for i in range(LAYERS)
        for kind in ("key", "value")
    ]
    meta = sess.get_modelmeta().custom_metadata_map
    assert meta["num_key_value_heads"] == str(GQA_KV_HEADS)
    hidden, kv_width = GQA_HEADS * HEAD_DIM, GQA_KV_HEADS * HEAD_DIM
    assert _weights(gqa_path)["h.0.attn.c_attn.weight"].shape == (hidden, hidden + 2 * kv_width)


def test_tiny_lm_gqa_matches_numpy_reference(gqa_path: Path) -> None:
    ids = np.random.default_rng(11).integers(0, VOCAB, size=(2, 19), dtype=np.int64)
    positions = np.tile(np.arange(19, dtype=np.int64), (2, 1))
    logits, past = _lm_call(_session(gqa_path), ids, np.ones_like(ids), positions, _gqa_past(2))
    assert past["past_key_values.0.key"].shape == (2, GQA_KV_HEADS, 19, HEAD_DIM)
    expected = _reference_logits(_weights(gqa_path), ids, GQA_HEADS, GQA_KV_HEADS)
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)
    # Logits of this size make the comparison meaningful: not all ~0, not saturated.
    assert 0.3 < float(logits.std()) < 10.0


@pytest.mark.parametrize("chunks", [[10, 1, 1, 1, 1, 1], [6, 4, 5]])
def test_tiny_lm_gqa_kv_cache_matches_full_forward(gqa_path: Path, chunks: list[int]) -> None:
    sess = _session(gqa_path)
    ids = np.random.default_rng(12).integers(0, VOCAB, size=(2, 15), dtype=np.int64)
    full, _ = _lm_call(sess, ids, np.ones_like(ids), np.tile(np.arange(15), (2, 1)), _gqa_past(2))
    past, pieces, start = _gqa_past(2), [], 0
    for size in chunks:
        stop = start + size
        positions = np.tile(np.arange(start, stop, dtype=np.int64), (2, 1))
        logits, past = _lm_call(
            sess, ids[:, start:stop], np.ones((2, stop), np.int64), positions, past
        )
        assert past["past_key_values.3.value"].shape == (2, GQA_KV_HEADS, stop, HEAD_DIM)
        pieces.append(logits)
        start = stop
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, rtol=1e-4, atol=1e-4)


def test_tiny_lm_kv_heads_equal_to_heads_is_the_multi_head_model(
    tmp_path: Path, tiny_lm_path: Path, lm: Any
) -> None:
    path = make_tiny_lm(tmp_path / "mha.onnx", kv_heads=HEADS)
    ids = np.random.default_rng(13).integers(0, VOCAB, size=(1, 9), dtype=np.int64)
    np.testing.assert_array_equal(_full_forward(_session(path), ids), _full_forward(lm, ids))
    assert _weights(path).keys() == _weights(tiny_lm_path).keys()


@pytest.mark.parametrize("kv_heads", [0, 3, 8])
def test_tiny_lm_rejects_kv_heads_that_do_not_divide_heads(tmp_path: Path, kv_heads: int) -> None:
    with pytest.raises(ValueError, match="kv_heads"):
        make_tiny_lm(tmp_path / "bad.onnx", heads=4, kv_heads=kv_heads)


# ------------------------------------------------------------ ONNX Runtime GenAI layout


@pytest.fixture(scope="module")
def genai_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return modelgen.make_genai_lm(tmp_path_factory.mktemp("genai") / "llama-tiny")


def _genai_call(sess: Any, ids: np.ndarray, mask: np.ndarray, past: Feed) -> tuple[Any, Feed]:
    feed = {"input_ids": ids, "attention_mask": mask, **past}
    out = _run(sess, feed)
    present = {
        k.replace("present.", "past_key_values."): v for k, v in out.items() if k != "logits"
    }
    return out["logits"], present


def _genai_empty(path: Path) -> Feed:
    return {
        i.name: np.zeros((1, modelgen.GENAI_LM_KV_HEADS, 0, modelgen.GENAI_LM_HEAD_DIM), np.float32)
        for i in _session(path).get_inputs()
        if i.name.startswith("past_key_values.")
    }


def test_genai_lm_is_a_genai_folder_without_position_ids(genai_path: Path) -> None:
    from actors.decoder import genai_facts

    assert genai_path.name == "model.onnx" and genai_path.stat().st_size < 1_000_000
    sess = _session(genai_path)
    layers, kv, dim = modelgen.GENAI_LM_LAYERS, modelgen.GENAI_LM_KV_HEADS, 16
    assert _signature(sess.get_inputs()) == [
        ("input_ids", INT64, ["batch_size", "sequence_length"]),
        ("attention_mask", INT64, ["batch_size", "total_sequence_length"]),
    ] + [
        (f"past_key_values.{i}.{kind}", FLOAT, ["batch_size", kv, "past_sequence_length", dim])
        for i in range(layers)
        for kind in ("key", "value")
    ]
    assert [o.name for o in sess.get_outputs()] == ["logits"] + [
        f"present.{i}.{kind}" for i in range(layers) for kind in ("key", "value")
    ]
    ops = {(n.domain, n.op_type) for n in onnx.load(str(genai_path)).graph.node}
    assert {
        ("com.microsoft", "GroupQueryAttention"),
        ("com.microsoft", "SkipSimplifiedLayerNormalization"),
        ("", "SimplifiedLayerNormalization"),
    } <= ops
    assert genai_facts(genai_path) == {
        "max_position_embeddings": modelgen.GENAI_LM_CONTEXT,
        "eos_token_id": modelgen.GENAI_LM_EOS,
        "pad_token_id": 0,
        "vocab_size": modelgen.GENAI_LM_VOCAB,
        "num_hidden_layers": layers,
        "num_attention_heads": modelgen.GENAI_LM_HEADS,
        "num_key_value_heads": kv,
        "head_dim": dim,
        "hidden_size": modelgen.GENAI_LM_HEADS * dim,
    }


def test_genai_lm_is_byte_identical_and_seeded(tmp_path: Path, genai_path: Path) -> None:
    again = modelgen.make_genai_lm(tmp_path / "again")
    assert again.read_bytes() == genai_path.read_bytes()
    config = modelgen.GENAI_CONFIG
    assert (again.parent / config).read_text() == (genai_path.parent / config).read_text()
    assert modelgen.make_genai_lm(tmp_path / "other", seed=1).read_bytes() != again.read_bytes()


def test_genai_lm_prefill_and_decode_match_one_token_at_a_time(genai_path: Path) -> None:
    sess = _session(genai_path)
    prompt = np.random.default_rng(14).integers(3, VOCAB, size=(1, 13), dtype=np.int64)

    def greedy(chunks: list[int], n: int) -> tuple[list[int], Any]:
        past, start, logits = _genai_empty(genai_path), 0, None
        for size in chunks:  # the prompt, in these chunks
            stop = start + size
            mask = np.ones((1, stop), np.int64)
            logits, past = _genai_call(sess, prompt[:, start:stop], mask, past)
            start = stop
        tokens: list[int] = []
        for _ in range(n):
            tokens.append(int(logits[0, -1].argmax()))
            mask = np.ones((1, start + len(tokens)), np.int64)
            logits, past = _genai_call(sess, np.array([[tokens[-1]]]), mask, past)
        return tokens, past

    expected, cache = greedy([1] * 13, 40)
    for chunks in ([13], [5, 8], [6, 1, 1, 5]):
        tokens, past = greedy(chunks, 40)
        assert tokens == expected
        for name, array in past.items():
            assert array.shape == (1, modelgen.GENAI_LM_KV_HEADS, 53, 16)
            np.testing.assert_allclose(array, cache[name], rtol=1e-4, atol=1e-4)
    assert len(set(expected)) >= 8 and not _has_short_loop(expected), expected


def test_genai_lm_rejects_sizes_its_attention_cannot_take(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        modelgen.make_genai_lm(tmp_path / "a", head_dim=24)
    with pytest.raises(ValueError, match="kv_heads"):
        modelgen.make_genai_lm(tmp_path / "b", heads=4, kv_heads=3)


def test_genai_config_is_the_builders_and_onnxruntime_genai_loads_the_folder(
    genai_path: Path,
) -> None:
    import json

    config = json.loads((genai_path.parent / modelgen.GENAI_CONFIG).read_text())
    search = config["search"]
    assert search["past_present_share_buffer"] is True and search["do_sample"] is False
    assert search["max_length"] == config["model"]["context_length"] == modelgen.GENAI_LM_CONTEXT
    assert config["model"]["bos_token_id"] == 1 and config["model"]["type"] == "llama"
    og = pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed")
    og.Model(str(genai_path.parent))


def test_genai_int4_is_the_folder_quantized_with_matmul_nbits(
    tmp_path: Path, genai_path: Path
) -> None:
    from actors.decoder import dynamically_quantized

    path = modelgen.make_genai_int4(genai_path.parent, tmp_path / "int4")
    ops = list(onnx.load(str(path)).graph.node)
    nbits = [n for n in ops if n.op_type == "MatMulNBits"]
    assert nbits and not [n for n in ops if n.op_type == "MatMul"]
    levels = {a.i for n in nbits for a in n.attribute if a.name == "accuracy_level"}
    assert levels == {4} and dynamically_quantized(path)
    config = modelgen.GENAI_CONFIG
    assert (path.parent / config).read_text() == (genai_path.parent / config).read_text()
    with pytest.raises(ValueError, match="not a GenAI folder"):
        modelgen.make_genai_int4(tmp_path, tmp_path / "again")
