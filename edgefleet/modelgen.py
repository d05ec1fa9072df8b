"""Deterministic generators of small ONNX models for tests, benchmarks and the demo.

Every model is built in code (no downloads) with weights drawn from
``numpy.random.default_rng(seed)``, so the same call always writes a byte-identical
file. Models use opset 17 and IR version 8, which every supported onnxruntime loads,
and each one passes ``onnx.checker.check_model`` before it is written.

Builtin models (see :data:`BUILTIN_MODELS`):

* ``classifier`` -- ``images[N,3,32,32] -> logits[N,10]``
* ``detector``   -- ``images[N,3,H,W] -> heatmap[N,5,H,W], scores[N,5]``
* ``stateful``   -- ``x[], state[2,1,16] -> y[], new_state[2,1,16]`` (not batchable)
* ``slow``       -- ``x[N,256] -> y[N,256]`` (tunable cost, see :func:`calibrate_slow`)
* ``heavy``      -- the slow model deep enough to keep an engine busy (a few ms per call)
* ``tiny_lm``    -- a GPT-style causal LM with a KV cache in the Hugging Face Optimum
  decoder-with-past layout (``input_ids``, ``attention_mask``, ``position_ids``,
  ``past_key_values.{i}.key/value`` -> ``logits``, ``present.{i}.key/value``)

Not a builtin: :func:`make_spin` writes a model that loops for as long as it is asked
(for tests of engine calls that do not end).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
DEFAULT_SEED = 0
PRODUCER_NAME = "edgefleet.modelgen"

CLASSIFIER_SIZE = 32
CLASSIFIER_CLASSES = 10
DETECTOR_CLASSES = 5
STATE_SHAPE: tuple[int, int, int] = (2, 1, 16)
SLOW_LAYERS = 4
SLOW_WIDTH = 256
# A calibrated slow model may need thousands of layers; cycling through a small pool of
# weight matrices keeps the file a few MB instead of gigabytes, and keeps the per-layer
# cost steady because the working set no longer grows with the layer count.
SLOW_DISTINCT_WEIGHTS = 8
TINY_LM_LAYERS = 4
TINY_LM_HEADS = 4
TINY_LM_HEAD_DIM = 32
TINY_LM_VOCAB = 512
TINY_LM_CONTEXT = 512
TINY_LM_MODEL_TYPE = "edgefleet-tiny-lm"

PathLike = str | os.PathLike[str]
Dim = int | str
FloatArray = npt.NDArray[np.float32]


# --------------------------------------------------------------------------- helpers


def _value_info(name: str, shape: Sequence[Dim]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def _init(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.ascontiguousarray(array, dtype=np.float32), name)


def _he_normal(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int) -> FloatArray:
    # He scaling keeps activations O(1) through Relu stacks, so outputs stay finite and
    # batch-vs-row comparisons are not dominated by float rounding of huge values.
    return (rng.standard_normal(shape) * math.sqrt(2.0 / fan_in)).astype(np.float32)


def _finish(graph: onnx.GraphProto, path: PathLike, metadata: dict[str, str] | None = None) -> Path:
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET)],
        ir_version=IR_VERSION,
        producer_name=PRODUCER_NAME,
    )
    if metadata:
        helper.set_model_props(model, metadata)
    onnx.checker.check_model(model, full_check=True)
    return _write_atomic(model.SerializeToString(), Path(path))


def _write_atomic(data: bytes, path: Path) -> Path:
    # Benchmarks and actors may load a model while the demo regenerates it; writing to a
    # temporary file and renaming means a reader never sees a half-written model.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return path


# --------------------------------------------------------------------------- models


def make_classifier(path: PathLike, *, seed: int = DEFAULT_SEED) -> Path:
    """Write a tiny image classifier and return its path.

    Signature: ``images`` float32 ``[N, 3, 32, 32]`` -> ``logits`` float32 ``[N, 10]``.
    Conv(3->8, 3x3, pad 1), Relu, Conv(8->16, 3x3, stride 2, pad 1), Relu,
    GlobalAveragePool, Flatten, Gemm(16->10).
    """
    rng = np.random.default_rng(seed)
    w1 = _he_normal(rng, (8, 3, 3, 3), 3 * 9)
    b1 = (rng.standard_normal(8) * 0.1).astype(np.float32)
    w2 = _he_normal(rng, (16, 8, 3, 3), 8 * 9)
    b2 = (rng.standard_normal(16) * 0.1).astype(np.float32)
    w3 = _he_normal(rng, (CLASSIFIER_CLASSES, 16), 16)
    b3 = (rng.standard_normal(CLASSIFIER_CLASSES) * 0.1).astype(np.float32)

    nodes = [
        helper.make_node(
            "Conv",
            ["images", "conv1.w", "conv1.b"],
            ["c1"],
            kernel_shape=[3, 3],
            pads=[1, 1, 1, 1],
        ),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node(
            "Conv",
            ["r1", "conv2.w", "conv2.b"],
            ["c2"],
            kernel_shape=[3, 3],
            pads=[1, 1, 1, 1],
            strides=[2, 2],
        ),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("GlobalAveragePool", ["r2"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "classifier",
        [_value_info("images", ["N", 3, CLASSIFIER_SIZE, CLASSIFIER_SIZE])],
        [_value_info("logits", ["N", CLASSIFIER_CLASSES])],
        [
            _init("conv1.w", w1),
            _init("conv1.b", b1),
            _init("conv2.w", w2),
            _init("conv2.b", b2),
            _init("fc.w", w3),
            _init("fc.b", b3),
        ],
    )
    return _finish(graph, path)


def make_detector(path: PathLike, *, seed: int = DEFAULT_SEED) -> Path:
    """Write a detector-like fully convolutional model and return its path.

    Signature: ``images`` float32 ``[N, 3, H, W]`` -> ``heatmap`` float32
    ``[N, 5, H, W]`` and ``scores`` float32 ``[N, 5]``, where
    ``scores = Sigmoid(ReduceMax(heatmap, axes=[2, 3]))``. N, H and W are dynamic.
    """
    rng = np.random.default_rng(seed)
    w1 = _he_normal(rng, (8, 3, 3, 3), 3 * 9)
    b1 = (rng.standard_normal(8) * 0.1).astype(np.float32)
    w2 = _he_normal(rng, (DETECTOR_CLASSES, 8, 1, 1), 8)
    b2 = (rng.standard_normal(DETECTOR_CLASSES) * 0.1).astype(np.float32)

    nodes = [
        helper.make_node(
            "Conv",
            ["images", "conv1.w", "conv1.b"],
            ["c1"],
            kernel_shape=[3, 3],
            pads=[1, 1, 1, 1],
        ),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "head.w", "head.b"], ["heatmap"], kernel_shape=[1, 1]),
        # Opset 17 still takes ReduceMax axes as an attribute (it became an input in 18).
        helper.make_node("ReduceMax", ["heatmap"], ["peak"], axes=[2, 3], keepdims=0),
        helper.make_node("Sigmoid", ["peak"], ["scores"]),
    ]
    graph = helper.make_graph(
        nodes,
        "detector",
        [_value_info("images", ["N", 3, "H", "W"])],
        [
            _value_info("heatmap", ["N", DETECTOR_CLASSES, "H", "W"]),
            _value_info("scores", ["N", DETECTOR_CLASSES]),
        ],
        [_init("conv1.w", w1), _init("conv1.b", b1), _init("head.w", w2), _init("head.b", b2)],
    )
    return _finish(graph, path)


def make_stateful(path: PathLike, *, seed: int = DEFAULT_SEED) -> Path:
    """Write a recurrent-style model that cannot be batched and return its path.

    Signature: ``x`` float32 ``[]`` (scalar), ``state`` float32 ``[2, 1, 16]`` ->
    ``y`` float32 ``[]``, ``new_state`` float32 ``[2, 1, 16]``, where
    ``new_state = Tanh(state * W + x)`` and ``y = ReduceSum(new_state)``.
    All dims are fixed and the would-be batch axis of ``state`` is axis 1, so a batcher
    that stacks requests along axis 0 must refuse this model.
    """
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal(STATE_SHAPE).astype(np.float32)

    nodes = [
        helper.make_node("Mul", ["state", "state.w"], ["scaled"]),
        helper.make_node("Add", ["scaled", "x"], ["pre"]),
        helper.make_node("Tanh", ["pre"], ["new_state"]),
        # No axes input and noop_with_empty_axes=0 means "reduce everything" -> scalar.
        helper.make_node("ReduceSum", ["new_state"], ["y"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "stateful",
        [_value_info("x", []), _value_info("state", STATE_SHAPE)],
        [_value_info("y", []), _value_info("new_state", STATE_SHAPE)],
        [_init("state.w", weight)],
    )
    return _finish(graph, path)


def _slow_graph(
    layers: int, width: int, seed: int, distinct_weights: int, fail_above: float | None = None
) -> onnx.GraphProto:
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if distinct_weights < 1:
        raise ValueError(f"distinct_weights must be >= 1, got {distinct_weights}")
    rng = np.random.default_rng(seed)
    pool = min(layers, distinct_weights)
    # 1/sqrt(width) keeps each pre-activation at unit variance, so Tanh never saturates
    # to a constant and deep stacks still produce informative, finite outputs.
    weights = [
        _init(f"w{i}", rng.standard_normal((width, width)) / math.sqrt(width)) for i in range(pool)
    ]
    nodes: list[onnx.NodeProto] = []
    prev = "x"
    if fail_above is not None:
        # x reshaped to [-1, width + 1000 * (max(x) > fail_above)]: a call holding such
        # an input fails (its size does not divide), any other runs unchanged.
        weights += [
            numpy_helper.from_array(np.array(fail_above, np.float32), "limit"),
            numpy_helper.from_array(np.array([-1, width], np.int64), "shape"),
            numpy_helper.from_array(np.array([0, 1000], np.int64), "bump"),
        ]
        nodes += [
            helper.make_node("ReduceMax", ["x"], ["peak"], keepdims=0),
            helper.make_node("Greater", ["peak", "limit"], ["over"]),
            helper.make_node("Cast", ["over"], ["over_i"], to=TensorProto.INT64),
            helper.make_node("Mul", ["bump", "over_i"], ["grow"]),
            helper.make_node("Add", ["shape", "grow"], ["shape_x"]),
            helper.make_node("Reshape", ["x", "shape_x"], ["x_checked"]),
        ]
        prev = "x_checked"
    for i in range(layers):
        out = "y" if i == layers - 1 else f"h{i}"
        nodes.append(helper.make_node("MatMul", [prev, f"w{i % pool}"], [f"m{i}"]))
        nodes.append(helper.make_node("Tanh", [f"m{i}"], [out]))
        prev = out
    return helper.make_graph(
        nodes,
        "slow",
        [_value_info("x", ["N", width])],
        [_value_info("y", ["N", width])],
        weights,
    )


def make_slow(
    path: PathLike,
    *,
    layers: int = SLOW_LAYERS,
    width: int = SLOW_WIDTH,
    seed: int = DEFAULT_SEED,
    distinct_weights: int = SLOW_DISTINCT_WEIGHTS,
    fail_above: float | None = None,
) -> Path:
    """Write a tunable-cost MLP and return its path.

    Signature: ``x`` float32 ``[N, width]`` -> ``y`` float32 ``[N, width]``, computed as
    ``layers`` repetitions of ``Tanh(h @ W_i)`` with ``W_i`` of shape ``[width, width]``
    scaled by ``1/sqrt(width)``. Cost per call grows with ``layers * width**2``; per-item
    cost falls with batch size because every weight is read once per call. Layer ``i``
    uses weight ``i % distinct_weights`` so the file size stays bounded. With
    ``fail_above``, a call fails (ONNX Runtime raises) when any input value is above it:
    a version of a model that fails some requests.
    """
    return _finish(_slow_graph(layers, width, seed, distinct_weights, fail_above), path)


def _session(model_bytes: bytes, threads: int) -> Any:
    # Imported lazily: writing models needs only onnx, so callers that never calibrate
    # (e.g. a model-preparation step) do not pay for loading onnxruntime.
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])


def median_call_s(session: Any, feed: dict[str, FloatArray], runs: int, warmup: int = 3) -> float:
    """The median wall time of ``runs`` calls of ``session`` on ``feed``, after
    ``warmup`` calls (also the benchmarks' timer of a bare ONNX Runtime session)."""
    run = session.run
    for _ in range(warmup):
        run(None, feed)  # first calls pay for allocations and page faults
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        run(None, feed)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _time_slow(layers: int, width: int, seed: int, threads: int, runs: int, warmup: int) -> float:
    graph = _slow_graph(layers, width, seed, SLOW_DISTINCT_WEIGHTS)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION
    )
    session = _session(model.SerializeToString(), threads)
    feed = {"x": np.ones((1, width), dtype=np.float32)}
    return median_call_s(session, feed, runs=runs, warmup=warmup)


# Probe and re-time only graphs whose measurement stays cheap: session creation grows
# with node count (~0.3 s at 3000 layers) and each timed run costs up to the target.
_PROBE_MAX_S = 0.005
_PROBE_MAX_LAYERS = 3000
_MEASURE_BUDGET_S = 0.3


def _runs_for(expected_s: float) -> int:
    return max(3, min(15, int(_MEASURE_BUDGET_S / max(expected_s, 1e-6))))


def calibrate_slow(
    path: PathLike,
    target_ms: float,
    *,
    width: int = SLOW_WIDTH,
    threads: int = 1,
    seed: int = DEFAULT_SEED,
) -> tuple[Path, int]:
    """Write a slow model whose batch-1 call takes about ``target_ms`` here.

    Timing uses in-memory probes on onnxruntime's CPUExecutionProvider with
    ``intra_op_num_threads=threads`` and ``inter_op_num_threads=1``, median of a few runs
    each: a shallow probe and a deeper one (sized towards the target, capped at ~5 ms
    per call) give per-layer cost and fixed overhead; ``layers`` (at least 1) then solves
    ``overhead + layers * per_layer = target``. If that estimate is still cheap to time
    (at most 3000 layers) it is measured once more and corrected. Returns
    ``(path, layers)``; the file is ``make_slow(path, layers=layers, width=width,
    seed=seed)``.
    """
    if target_ms <= 0:
        raise ValueError(f"target_ms must be > 0, got {target_ms}")
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    target_s = target_ms / 1000.0

    # Probes are at least one full weight pool deep so they share the final model's
    # working set; the difference between two depths cancels the fixed per-call overhead.
    small = SLOW_DISTINCT_WEIGHTS
    t_small = _time_slow(small, width, seed, threads, runs=15, warmup=3)
    # Per-layer cost drifts with depth (more intermediate buffers), so the second probe
    # is made as deep as the target needs, within the cost cap.
    rough = t_small / small
    large = round(min(target_s, _PROBE_MAX_S) / rough)
    large = min(max(large, 4 * small), _PROBE_MAX_LAYERS)
    t_large = _time_slow(large, width, seed, threads, runs=_runs_for(large * rough), warmup=2)

    # Timer noise can make the difference non-positive on a tiny width; fall back to the
    # average so the division below stays meaningful.
    per_layer = (t_large - t_small) / (large - small)
    if per_layer <= 0:
        per_layer = t_large / large
    overhead = max(0.0, t_small - small * per_layer)
    layers = max(1, round((target_s - overhead) / per_layer))

    # A direct measurement of the estimate removes most of the remaining depth bias.
    if layers <= _PROBE_MAX_LAYERS and abs(layers - large) > 0.1 * large:
        measured = _time_slow(layers, width, seed, threads, runs=_runs_for(target_s), warmup=1)
        effective = (measured - overhead) / layers
        if effective > 0:
            layers = max(1, round((target_s - overhead) / effective))
    return make_slow(path, layers=layers, width=width, seed=seed), layers


# Scales of the tiny LM's random weights. With GPT-2's own init (std 0.02) the untrained
# model's greedy output collapses into one repeated token. Unit-std token and position
# embeddings keep each step's input distinct, and 1/sqrt(fan_in) projections let every
# block add an O(1) share, so greedy decoding wanders through the vocabulary while the
# next token still depends on the context, not only on the last token and position.
_TINY_LM_TOKEN_STD = 1.0
_TINY_LM_POSITION_STD = 1.0
_TINY_LM_NORM_JITTER = 0.1
_TINY_LM_BIAS_STD = 0.02
_TINY_LM_LN_EPS = 1e-5
_TINY_LM_MASK_VALUE = float(np.finfo(np.float32).min) / 2
_GELU_COEFF = 0.044715


def _int64_init(name: str, value: Sequence[int] | int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=np.int64), name)


def _tiny_lm_weights(
    rng: np.random.Generator, layers: int, hidden: int, kv_width: int, vocab: int, max_context: int
) -> dict[str, FloatArray]:
    def normal(shape: tuple[int, ...], std: float) -> FloatArray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def scaled(fan_in: int, fan_out: int) -> FloatArray:
        return normal((fan_in, fan_out), 1.0 / math.sqrt(fan_in))

    def norm(prefix: str) -> dict[str, FloatArray]:
        return {
            f"{prefix}.weight": 1.0 + normal((hidden,), _TINY_LM_NORM_JITTER),
            f"{prefix}.bias": normal((hidden,), _TINY_LM_NORM_JITTER),
        }

    weights = {
        "wte": normal((vocab, hidden), _TINY_LM_TOKEN_STD),
        "wpe": normal((max_context, hidden), _TINY_LM_POSITION_STD),
    }
    for i in range(layers):
        p = f"h.{i}"
        weights |= norm(f"{p}.ln_1")
        weights[f"{p}.attn.c_attn.weight"] = scaled(hidden, hidden + 2 * kv_width)
        weights[f"{p}.attn.c_attn.bias"] = normal((hidden + 2 * kv_width,), _TINY_LM_BIAS_STD)
        weights[f"{p}.attn.c_proj.weight"] = scaled(hidden, hidden)
        weights[f"{p}.attn.c_proj.bias"] = normal((hidden,), _TINY_LM_BIAS_STD)
        weights |= norm(f"{p}.ln_2")
        weights[f"{p}.mlp.c_fc.weight"] = scaled(hidden, 4 * hidden)
        weights[f"{p}.mlp.c_fc.bias"] = normal((4 * hidden,), _TINY_LM_BIAS_STD)
        weights[f"{p}.mlp.c_proj.weight"] = scaled(4 * hidden, hidden)
        weights[f"{p}.mlp.c_proj.bias"] = normal((hidden,), _TINY_LM_BIAS_STD)
    weights |= norm("ln_f")
    weights["lm_head.weight"] = scaled(hidden, vocab)
    return weights


class _Nodes:
    """Appends nodes to a graph under construction; each call returns its output name."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []

    def __call__(self, op: str, inputs: Sequence[str], output: str, **attrs: Any) -> str:
        self.nodes.append(helper.make_node(op, list(inputs), [output], **attrs))
        return output

    def multi(self, op: str, inputs: Sequence[str], outputs: Sequence[str], **attrs: Any) -> None:
        self.nodes.append(helper.make_node(op, list(inputs), list(outputs), **attrs))


def _tiny_lm_mask(add: _Nodes) -> str:
    """Nodes computing ``allowed`` bool ``[B, 1, S, T]``: query ``i`` of the chunk sits at
    absolute position ``past + i`` and sees key ``j`` iff ``j <= past + i`` and
    ``attention_mask[b, j]`` is 1."""
    seq = add("Shape", ["input_ids"], "mask.seq_len", start=1, end=2)
    total = add("Shape", ["attention_mask"], "mask.total_len", start=1, end=2)
    past = add("Sub", [total, seq], "mask.past_len")
    past_s = add("Squeeze", [past], "mask.past_len_scalar")
    total_s = add("Squeeze", [total], "mask.total_len_scalar")
    keys = add("Range", ["const.zero", total_s, "const.one"], "mask.key_pos")
    queries = add("Range", [past_s, total_s, "const.one"], "mask.query_pos")
    query_col = add("Unsqueeze", [queries, "const.axes_1"], "mask.query_col")
    causal = add("LessOrEqual", [keys, query_col], "mask.causal")
    padding = add("Cast", ["attention_mask"], "mask.padding", to=TensorProto.BOOL)
    padding4 = add("Unsqueeze", [padding, "const.axes_1_2"], "mask.padding4")
    return add("And", [causal, padding4], "mask.allowed")


def _tiny_lm_block(add: _Nodes, i: int, h: str, allowed: str, grouped: bool) -> str:
    p = f"h.{i}"

    def linear(x: str, name: str) -> str:
        y = add("MatMul", [x, f"{name}.weight"], f"{name}.matmul")
        return add("Add", [y, f"{name}.bias"], f"{name}.out")

    def layer_norm(x: str, name: str) -> str:
        return add(
            "LayerNormalization",
            [x, f"{name}.weight", f"{name}.bias"],
            f"{name}.out",
            axis=-1,
            epsilon=_TINY_LM_LN_EPS,
        )

    qkv = linear(layer_norm(h, f"{p}.ln_1"), f"{p}.attn.c_attn")
    qkv = add("Reshape", [qkv, "const.qkv_shape"], f"{p}.attn.qkv_heads")
    qkv = add("Transpose", [qkv], f"{p}.attn.qkv_bhsd", perm=[0, 2, 1, 3])
    q, k, v = (f"{p}.attn.{n}" for n in ("q", "k", "v"))
    if grouped:
        add.multi("Split", [qkv, "const.qkv_split"], [q, k, v], axis=1)
    else:
        add.multi("Split", [qkv], [q, k, v], axis=1)
    key = add("Concat", [f"past_key_values.{i}.key", k], f"present.{i}.key", axis=2)
    value = add("Concat", [f"past_key_values.{i}.value", v], f"present.{i}.value", axis=2)
    if grouped:
        key, value = (
            _repeat_kv(add, key, f"{p}.attn.key"),
            _repeat_kv(add, value, f"{p}.attn.value"),
        )
    key_t = add("Transpose", [key], f"{p}.attn.key_t", perm=[0, 1, 3, 2])
    scores = add("MatMul", [q, key_t], f"{p}.attn.scores")
    scores = add("Mul", [scores, "const.attn_scale"], f"{p}.attn.scaled")
    scores = add("Where", [allowed, scores, "const.mask_value"], f"{p}.attn.masked")
    probs = add("Softmax", [scores], f"{p}.attn.probs", axis=-1)
    ctx = add("MatMul", [probs, value], f"{p}.attn.context")
    ctx = add("Transpose", [ctx], f"{p}.attn.context_bshd", perm=[0, 2, 1, 3])
    ctx = add("Reshape", [ctx, "const.hidden_shape"], f"{p}.attn.merged")
    h = add("Add", [h, linear(ctx, f"{p}.attn.c_proj")], f"{p}.attn.residual")

    fc = linear(layer_norm(h, f"{p}.ln_2"), f"{p}.mlp.c_fc")
    cube = add("Mul", [fc, add("Mul", [fc, fc], f"{p}.mlp.sq")], f"{p}.mlp.cube")
    inner = add("Mul", [cube, "const.gelu_coeff"], f"{p}.mlp.cube_scaled")
    inner = add("Add", [fc, inner], f"{p}.mlp.inner")
    inner = add("Mul", [inner, "const.gelu_scale"], f"{p}.mlp.inner_scaled")
    gate = add("Add", [add("Tanh", [inner], f"{p}.mlp.tanh"), "const.f_one"], f"{p}.mlp.gate")
    half = add("Mul", [fc, "const.f_half"], f"{p}.mlp.half")
    act = add("Mul", [half, gate], f"{p}.mlp.gelu")
    return add("Add", [h, linear(act, f"{p}.mlp.c_proj")], f"{p}.out")


def _repeat_kv(add: _Nodes, x: str, name: str) -> str:
    """``[B, kv_heads, T, D]`` -> ``[B, heads, T, D]``, each K/V head repeated for the
    ``heads / kv_heads`` consecutive query heads that share it (Hugging Face's
    ``repeat_kv``)."""
    x = add("Unsqueeze", [x, "const.axes_2"], f"{name}.grouped")
    x = add("Expand", [x, "const.kv_expand"], f"{name}.repeated")
    return add("Reshape", [x, "const.kv_heads_shape"], f"{name}.heads")


def make_tiny_lm(
    path: PathLike,
    *,
    layers: int = TINY_LM_LAYERS,
    heads: int = TINY_LM_HEADS,
    head_dim: int = TINY_LM_HEAD_DIM,
    vocab: int = TINY_LM_VOCAB,
    max_context: int = TINY_LM_CONTEXT,
    seed: int = DEFAULT_SEED,
    kv_heads: int | None = None,
) -> Path:
    """Write a tiny GPT-style causal language model with a KV cache and return its path.

    The signature is the Hugging Face Optimum decoder-with-past layout, so code written
    for this model also drives real Optimum exports. Inputs: ``input_ids`` and
    ``position_ids`` int64 ``[batch_size, sequence_length]``, ``attention_mask`` int64
    ``[batch_size, total_sequence_length]`` (1 = attend, 0 = padding), then
    ``past_key_values.{i}.key`` and ``.value`` float32
    ``[batch_size, heads, past_sequence_length, head_dim]`` for each layer ``i``.
    Outputs: ``logits`` float32 ``[batch_size, sequence_length, vocab]``, then
    ``present.{i}.key`` and ``.value`` float32
    ``[batch_size, heads, total_sequence_length, head_dim]``, which are the past
    concatenated with the current chunk and are fed back as the next call's past.
    A past of length 0 is the prefill call.

    Architecture (pre-LayerNorm GPT-2): ``wte[input_ids] + wpe[position_ids]`` (``wpe``
    has ``max_context`` rows); per layer a causal multi-head self-attention over past
    and current positions (one fused ``c_attn`` projection to Q, K, V, scores scaled by
    ``1/sqrt(head_dim)``, a query at absolute position ``past + i`` sees keys at
    positions ``<= past + i`` whose ``attention_mask`` is 1) and a tanh-GELU MLP of
    width ``4 * heads * head_dim``, each with a residual; a final LayerNorm and an
    untied ``lm_head`` give the logits. Weights are random (``default_rng(seed)``) and
    scaled so greedy decoding does not collapse into a repeated token. Metadata:
    ``max_position_embeddings`` and ``model_type`` (``edgefleet-tiny-lm``).

    ``kv_heads`` (a divisor of ``heads``) makes the attention grouped-query, as Llama and
    Qwen exports are: ``c_attn`` projects to ``heads`` query heads and ``kv_heads`` key
    and value heads, the cache inputs and outputs are ``[batch_size, kv_heads, ...,
    head_dim]``, and each K/V head serves ``heads / kv_heads`` consecutive query heads.
    The metadata then also holds ``num_key_value_heads``. None (the default) writes the
    multi-head model, byte for byte as before the option existed.
    """
    for name, value in (
        ("layers", layers),
        ("heads", heads),
        ("head_dim", head_dim),
        ("vocab", vocab),
        ("max_context", max_context),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    kv = heads if kv_heads is None else kv_heads
    if not 1 <= kv <= heads or heads % kv:
        raise ValueError(f"kv_heads must divide heads ({heads}), got {kv_heads}")
    grouped = kv != heads
    hidden = heads * head_dim
    weights = _tiny_lm_weights(
        np.random.default_rng(seed), layers, hidden, kv * head_dim, vocab, max_context
    )
    constants = [
        _int64_init("const.zero", 0),
        _int64_init("const.one", 1),
        _int64_init("const.axes_1", [1]),
        _int64_init("const.axes_1_2", [1, 2]),
        _int64_init("const.qkv_shape", [0, 0, heads + 2 * kv, head_dim]),
        _int64_init("const.hidden_shape", [0, 0, hidden]),
        _init("const.attn_scale", np.array(1.0 / math.sqrt(head_dim))),
        _init("const.mask_value", np.array(_TINY_LM_MASK_VALUE)),
        _init("const.gelu_coeff", np.array(_GELU_COEFF)),
        _init("const.gelu_scale", np.array(math.sqrt(2.0 / math.pi))),
        _init("const.f_one", np.array(1.0)),
        _init("const.f_half", np.array(0.5)),
    ]
    if grouped:
        constants += [
            _int64_init("const.qkv_split", [heads, kv, kv]),
            _int64_init("const.axes_2", [2]),
            _int64_init("const.kv_expand", [1, 1, heads // kv, 1, 1]),
            _int64_init("const.kv_heads_shape", [0, heads, -1, head_dim]),
        ]

    add = _Nodes()
    tokens = add("Gather", ["wte", "input_ids"], "embed.tokens")
    positions = add("Gather", ["wpe", "position_ids"], "embed.positions")
    h = add("Add", [tokens, positions], "embed.out")
    allowed = _tiny_lm_mask(add)
    for i in range(layers):
        h = _tiny_lm_block(add, i, h, allowed, grouped)
    h = add(
        "LayerNormalization",
        [h, "ln_f.weight", "ln_f.bias"],
        "ln_f.out",
        axis=-1,
        epsilon=_TINY_LM_LN_EPS,
    )
    add("MatMul", [h, "lm_head.weight"], "logits")

    def ids(name: str, length: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.INT64, ["batch_size", length])

    cache_in: list[Dim] = ["batch_size", kv, "past_sequence_length", head_dim]
    cache_out: list[Dim] = ["batch_size", kv, "total_sequence_length", head_dim]
    inputs = [
        ids("input_ids", "sequence_length"),
        ids("attention_mask", "total_sequence_length"),
        ids("position_ids", "sequence_length"),
    ]
    outputs = [_value_info("logits", ["batch_size", "sequence_length", vocab])]
    for i in range(layers):
        for kind in ("key", "value"):
            inputs.append(_value_info(f"past_key_values.{i}.{kind}", cache_in))
            outputs.append(_value_info(f"present.{i}.{kind}", cache_out))
    graph = helper.make_graph(
        add.nodes,
        "tiny_lm",
        inputs,
        outputs,
        [_init(name, array) for name, array in weights.items()] + constants,
    )
    metadata = {"max_position_embeddings": str(max_context), "model_type": TINY_LM_MODEL_TYPE}
    if kv_heads is not None:
        metadata["num_key_value_heads"] = str(kv_heads)
    return _finish(graph, path, metadata)


# ONNX Runtime GenAI's layout. Its model builder writes a folder: model.onnx beside a
# genai_config.json. The graph has no position_ids input: GroupQueryAttention (a
# com.microsoft op) takes each row's length from the attention mask (seqlens_k, the
# row's total length - 1) and rotates queries and keys by those positions itself.
GENAI_LM_LAYERS = 3
GENAI_LM_HEADS = 4
GENAI_LM_KV_HEADS = 2
GENAI_LM_HEAD_DIM = 16  # GroupQueryAttention's rotary needs a multiple of 16
GENAI_LM_VOCAB = 512
GENAI_LM_CONTEXT = 256
GENAI_LM_EOS = 2
GENAI_LM_MODEL_TYPE = "llama"
GENAI_CONFIG = "genai_config.json"
MS_DOMAIN = "com.microsoft"
_GENAI_ROPE_THETA = 10000.0
_GENAI_RMS_EPS = 1e-5
# Token embeddings of std 2 (the tiny LM's are 1): with rotary positions only, a unit
# scale left greedy output stuck in a repeated token for a few prompts in 10; at 2, with
# 3 layers, none of 10 prompts looped over 60 tokens.
_GENAI_TOKEN_STD = 2.0


def _genai_lm_weights(
    rng: np.random.Generator, layers: int, hidden: int, kv_width: int, inner: int, vocab: int
) -> dict[str, FloatArray]:
    def normal(shape: tuple[int, ...], std: float) -> FloatArray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def scaled(fan_in: int, fan_out: int) -> FloatArray:
        return normal((fan_in, fan_out), 1.0 / math.sqrt(fan_in))

    # Scaled as the tiny LM's (see its constants) but for the token embeddings.
    weights = {"model.embed_tokens.weight": normal((vocab, hidden), _GENAI_TOKEN_STD)}
    for i in range(layers):
        p = f"model.layers.{i}"
        weights[f"{p}.input_layernorm.weight"] = 1.0 + normal((hidden,), _TINY_LM_NORM_JITTER)
        weights[f"{p}.attn.q_proj.weight"] = scaled(hidden, hidden)
        weights[f"{p}.attn.k_proj.weight"] = scaled(hidden, kv_width)
        weights[f"{p}.attn.v_proj.weight"] = scaled(hidden, kv_width)
        weights[f"{p}.attn.o_proj.weight"] = scaled(hidden, hidden)
        weights[f"{p}.post_attention_layernorm.weight"] = 1.0 + normal(
            (hidden,), _TINY_LM_NORM_JITTER
        )
        weights[f"{p}.mlp.gate_proj.weight"] = scaled(hidden, inner)
        weights[f"{p}.mlp.up_proj.weight"] = scaled(hidden, inner)
        weights[f"{p}.mlp.down_proj.weight"] = scaled(inner, hidden)
    weights["model.norm.weight"] = 1.0 + normal((hidden,), _TINY_LM_NORM_JITTER)
    weights["lm_head.weight"] = scaled(hidden, vocab)
    return weights


def _rotary_caches(context: int, head_dim: int) -> tuple[FloatArray, FloatArray]:
    """cos and sin ``[context, head_dim / 2]`` of the rotary embedding (base 10000), as
    GroupQueryAttention's ``cos_cache`` / ``sin_cache`` take them."""
    inv_freq = 1.0 / _GENAI_ROPE_THETA ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.outer(np.arange(context, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def make_genai_lm(
    folder: PathLike,
    *,
    layers: int = GENAI_LM_LAYERS,
    heads: int = GENAI_LM_HEADS,
    kv_heads: int = GENAI_LM_KV_HEADS,
    head_dim: int = GENAI_LM_HEAD_DIM,
    vocab: int = GENAI_LM_VOCAB,
    max_context: int = GENAI_LM_CONTEXT,
    eos_token_id: int = GENAI_LM_EOS,
    seed: int = DEFAULT_SEED,
) -> Path:
    """Write a tiny Llama-style decoder as ONNX Runtime GenAI's model builder lays one
    out: ``<folder>/model.onnx`` beside ``<folder>/genai_config.json``. Returns the
    path of ``model.onnx``.

    Inputs: ``input_ids`` and ``attention_mask`` int64 (``[batch_size,
    sequence_length]`` and ``[batch_size, total_sequence_length]``), then
    ``past_key_values.{i}.key`` / ``.value`` float32 ``[batch_size, kv_heads,
    past_sequence_length, head_dim]``; no ``position_ids``. Outputs: ``logits`` float32
    ``[batch_size, sequence_length, vocab]`` and ``present.{i}.key`` / ``.value``
    ``[batch_size, kv_heads, total_sequence_length, head_dim]``.

    The ops are the builder's for a CPU float32 model: ``SimplifiedLayerNormalization``
    and ``com.microsoft.SkipSimplifiedLayerNormalization`` (RMS norms, the second
    adding the residual), and per layer a ``com.microsoft.GroupQueryAttention`` with
    ``do_rotary=1`` and ``cos_cache`` / ``sin_cache`` of ``max_context`` rows. Its
    ``seqlens_k`` (each row's total length - 1, int32) is the attention mask's row sum
    - 1, and its ``total_sequence_length`` the mask's width, as the builder computes
    them. The op then takes a row's positions and the extent of its past from
    ``seqlens_k``: a row's past must fill columns ``0 .. seqlens_k - 1`` (padding on
    the right). The MLP is SiLU-gated (``Sigmoid``, ``Mul``) of width ``2 * hidden``;
    an untied ``lm_head`` gives the logits. Weights are random (``default_rng(seed)``).

    ``genai_config.json`` is what the builder writes for such a model (no tokenizer:
    the folder is fed token ids): ``bos_token_id``, ``context_length``,
    ``eos_token_id``, ``pad_token_id``, ``vocab_size``, ``type``, the decoder's file,
    sizes and tensor names, and the builder's ``search`` defaults with
    ``past_present_share_buffer`` on (GroupQueryAttention writes a preallocated cache in
    place). So ``onnxruntime_genai.Model(folder)`` loads it and its ``Generator`` gives
    reference outputs; edgefleet's decoder reads the facts it needs from the same
    file. The graph uses ONNX Runtime's
    contrib ops, so it is checked by loading it in ONNX Runtime, not by onnx.checker
    (which knows no ``SimplifiedLayerNormalization`` in the default domain).
    """
    for name, value in (
        ("layers", layers),
        ("heads", heads),
        ("vocab", vocab),
        ("max_context", max_context),
    ):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if head_dim < 16 or head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (rotary attention), got {head_dim}")
    if not 1 <= kv_heads <= heads or heads % kv_heads:
        raise ValueError(f"kv_heads must divide heads ({heads}), got {kv_heads}")
    hidden, kv_width = heads * head_dim, kv_heads * head_dim
    inner = 2 * hidden
    weights = _genai_lm_weights(np.random.default_rng(seed), layers, hidden, kv_width, inner, vocab)
    cos, sin = _rotary_caches(max_context, head_dim)
    initializers = [_init(name, array) for name, array in weights.items()] + [
        _init("cos_cache", cos),
        _init("sin_cache", sin),
        _int64_init("const.one", 1),
        _int64_init("const.axes_1", [1]),
    ]

    add = _Nodes()
    # What GroupQueryAttention needs to know of the rows, computed once.
    total = add("ReduceSum", ["attention_mask", "const.axes_1"], "mask.row_sum", keepdims=0)
    last = add("Sub", [total, "const.one"], "mask.row_last")
    seqlens_k = add("Cast", [last], "mask.seqlens_k", to=TensorProto.INT32)
    width = add("Shape", ["attention_mask"], "mask.shape")
    width = add("Gather", [width, "const.one"], "mask.width", axis=0)
    total_len = add("Cast", [width], "mask.total_seq_len", to=TensorProto.INT32)

    residual = add("Gather", ["model.embed_tokens.weight", "input_ids"], "embed.out")
    pending: str | None = None  # a sublayer's output not yet added to the residual

    def norm(weight: str) -> str:
        nonlocal residual
        if pending is None:
            return add(
                "SimplifiedLayerNormalization",
                [residual, weight],
                f"{weight}.out",
                axis=-1,
                epsilon=_GENAI_RMS_EPS,
                stash_type=1,
            )
        out, summed = f"{weight}.out", f"{weight}.residual"
        add.nodes.append(
            helper.make_node(
                "SkipSimplifiedLayerNormalization",
                [pending, residual, weight],
                [out, "", "", summed],
                domain=MS_DOMAIN,
                epsilon=_GENAI_RMS_EPS,
            )
        )
        residual = summed
        return out

    for i in range(layers):
        p = f"model.layers.{i}"
        x = norm(f"{p}.input_layernorm.weight")
        q, k, v = (
            add("MatMul", [x, f"{p}.attn.{n}_proj.weight"], f"{p}.attn.{n}_proj.out")
            for n in ("q", "k", "v")
        )
        attn = f"{p}.attn.gqa.out"
        add.nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                [
                    q,
                    k,
                    v,
                    f"past_key_values.{i}.key",
                    f"past_key_values.{i}.value",
                    seqlens_k,
                    total_len,
                    "cos_cache",
                    "sin_cache",
                ],
                [attn, f"present.{i}.key", f"present.{i}.value"],
                domain=MS_DOMAIN,
                num_heads=heads,
                kv_num_heads=kv_heads,
                scale=1.0 / math.sqrt(head_dim),
                do_rotary=1,
                rotary_interleaved=0,
                local_window_size=-1,
            )
        )
        pending = add("MatMul", [attn, f"{p}.attn.o_proj.weight"], f"{p}.attn.o_proj.out")
        x = norm(f"{p}.post_attention_layernorm.weight")
        gate = add("MatMul", [x, f"{p}.mlp.gate_proj.weight"], f"{p}.mlp.gate_proj.out")
        up = add("MatMul", [x, f"{p}.mlp.up_proj.weight"], f"{p}.mlp.up_proj.out")
        silu = add("Mul", [gate, add("Sigmoid", [gate], f"{p}.mlp.sigmoid")], f"{p}.mlp.silu")
        gated = add("Mul", [silu, up], f"{p}.mlp.gated")
        pending = add("MatMul", [gated, f"{p}.mlp.down_proj.weight"], f"{p}.mlp.down_proj.out")
    add("MatMul", [norm("model.norm.weight"), "lm_head.weight"], "logits")

    def ids(name: str, length: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.INT64, ["batch_size", length])

    cache_in: list[Dim] = ["batch_size", kv_heads, "past_sequence_length", head_dim]
    cache_out: list[Dim] = ["batch_size", kv_heads, "total_sequence_length", head_dim]
    inputs = [ids("input_ids", "sequence_length"), ids("attention_mask", "total_sequence_length")]
    outputs = [_value_info("logits", ["batch_size", "sequence_length", vocab])]
    for i in range(layers):
        for kind in ("key", "value"):
            inputs.append(_value_info(f"past_key_values.{i}.{kind}", cache_in))
            outputs.append(_value_info(f"present.{i}.{kind}", cache_out))
    graph = helper.make_graph(add.nodes, "genai_lm", inputs, outputs, initializers)
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS_DOMAIN, 1)],
        ir_version=IR_VERSION,
        producer_name=PRODUCER_NAME,
    )
    data = model.SerializeToString()
    _session(data, 1)  # ONNX Runtime resolves every op and shape, or raises
    root = Path(folder)
    path = _write_atomic(data, root / "model.onnx")
    config = {
        "model": {
            "bos_token_id": 1,
            "context_length": max_context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": path.name,
                "head_size": head_dim,
                "hidden_size": hidden,
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": heads,
                "num_hidden_layers": layers,
                "num_key_value_heads": kv_heads,
            },
            "eos_token_id": eos_token_id,
            "pad_token_id": 0,
            "type": GENAI_LM_MODEL_TYPE,
            "vocab_size": vocab,
        },
        # The builder's search defaults (for a config.json that sets none of them). A
        # GroupQueryAttention graph shares past and present buffers: the runtime gives
        # every past input a buffer of max_length columns the op writes in place.
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": max_context,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": True,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 50,
            "top_p": 1.0,
        },
    }
    _write_atomic((json.dumps(config, indent=4) + "\n").encode(), root / GENAI_CONFIG)
    return path


def make_genai_int4(
    source: PathLike, folder: PathLike, *, accuracy_level: int = 4, block_size: int = 32
) -> Path:
    """Quantize the GenAI folder ``source`` (see :func:`make_genai_lm`) to int4 in a new
    folder ``folder``, as ONNX Runtime GenAI's builder makes its CPU int4 models: every
    MatMul with a constant weight becomes a ``com.microsoft.MatMulNBits`` (symmetric,
    blocks of ``block_size``) by ONNX Runtime's own ``MatMulNBitsQuantizer``;
    ``accuracy_level`` 4 (the builder's CPU default) computes with int8 activations
    quantized per call. The embedding stays float32. ``genai_config.json`` is copied
    unchanged. Returns the path of the new ``model.onnx``. Needs the ``onnx-ir``
    package (the quantizer imports it).
    """
    import logging

    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    src = Path(source)
    if not (src / GENAI_CONFIG).is_file():
        raise ValueError(f"{src} is not a GenAI folder: no {GENAI_CONFIG}")
    # The quantizer logs a line per MatMul at INFO.
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    quantizer = MatMulNBitsQuantizer(
        onnx.load(str(src / "model.onnx")),
        block_size=block_size,
        is_symmetric=True,
        accuracy_level=accuracy_level,
    )
    quantizer.process()
    root = Path(folder)
    path = _write_atomic(quantizer.model.model.SerializeToString(), root / "model.onnx")
    _write_atomic((src / GENAI_CONFIG).read_bytes(), root / GENAI_CONFIG)
    return path


# --------------------------------------------------------------------------- registry


class InputMaker(Protocol):
    """Builds a valid feed for one model from ``(rng, batch, height, width)``."""

    def __call__(
        self, rng: np.random.Generator, batch: int, height: int, width: int
    ) -> dict[str, np.ndarray]: ...


@dataclass(frozen=True)
class ModelSpec:
    """One builtin model: how to write it, its file name, and how to feed it.

    Instances are callable as ``spec(path) -> Path``, so :data:`BUILTIN_MODELS` can be
    used as a plain ``name -> factory`` mapping.
    """

    name: str
    factory: Callable[[Path], Path]
    inputs: InputMaker

    @property
    def filename(self) -> str:
        return f"{self.name}.onnx"

    def __call__(self, path: PathLike) -> Path:
        return self.factory(Path(path))


HEAVY_LAYERS = 1500


_TOKENIZER_TEXT = (
    "a heron stood by the river at dawn",
    "the camera on the dock saw two boats",
    "café crème brûlée, déjà vu",
    "日本語のテキストと絵文字",
    "edge devices serve models to the fleet",
)


# A ChatML template as Qwen's models ship it, less their default system prompt and tools.
CHAT_TEMPLATE = """\
{%- for message in messages %}
    {%- if message.role not in ('system', 'user', 'assistant') %}
        {{- raise_exception('unknown role ' + message.role) }}
    {%- elif message.role == 'system' and not loop.first %}
        {{- raise_exception('the system message must come first') }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")


def make_tokenizer(path: PathLike, *, vocab: int = 512, chat: bool = False) -> Path:
    """A byte-level BPE ``tokenizer.json`` (the Hugging Face ``tokenizers`` format)
    trained on a few fixed lines of English, French and Japanese, at most ``vocab``
    tokens (the tiny LM's by default): multi-byte characters span several tokens.

    ``chat``: a chat model's, as Qwen's folders have it: ``<|im_start|>`` and
    ``<|im_end|>`` are special tokens, and a ``tokenizer_config.json`` beside it has
    :data:`CHAT_TEMPLATE` and ``<|im_end|>`` as its ``eos_token``."""
    import json

    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(
        list(_TOKENIZER_TEXT) * 4,
        vocab_size=vocab,
        min_frequency=1,
        show_progress=False,
        special_tokens=list(CHAT_TOKENS) if chat else [],
    )
    path = Path(path)
    tokenizer.save(str(path))
    if chat:
        config = {"chat_template": CHAT_TEMPLATE, "bos_token": None, "eos_token": CHAT_TOKENS[1]}
        (path.parent / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path


def make_heavy(path: PathLike, *, seed: int = DEFAULT_SEED) -> Path:
    """The slow model made deep enough to cost a few milliseconds per call on a CPU
    core (about 5 ms at batch 1 on the reference machine): background work that keeps
    an engine busy. Signature as :func:`make_slow` with the default width."""
    return make_slow(path, layers=HEAVY_LAYERS, seed=seed)


SPIN_WIDTH = 4


def make_spin(path: PathLike) -> Path:
    """Write a model that runs as long as it is asked to and return its path: a test
    of what a node does with an engine call that does not end (a model that loops, a
    wedged accelerator). Not a builtin: nothing should serve it by accident.

    Signature: ``x`` float32 ``[N, 4]``, ``steps`` int64 ``[]`` -> ``y`` float32
    ``[N, 4]``: a ``Loop`` applies ``Tanh`` to ``x`` ``steps`` times (a few microseconds
    a step on a CPU: ``steps = 10**15`` runs for years). ONNX Runtime checks its
    terminate flag at every step. Zero steps (what warm-up feeds an int64 input) cost
    nothing.
    """
    width = SPIN_WIDTH
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond"], ["cond_out"]),
            helper.make_node("Tanh", ["h"], ["h_out"]),
        ],
        "spin_step",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            _value_info("h", ["N", width]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            _value_info("h_out", ["N", width]),
        ],
    )
    always = helper.make_tensor("always", TensorProto.BOOL, [], [True])
    graph = helper.make_graph(
        [
            helper.make_node("Constant", [], ["true"], value=always),
            helper.make_node("Loop", ["steps", "true", "x"], ["y"], body=body),
        ],
        "spin",
        [
            _value_info("x", ["N", width]),
            helper.make_tensor_value_info("steps", TensorProto.INT64, []),
        ],
        [_value_info("y", ["N", width])],
    )
    return _finish(graph, path)


def _classifier_inputs(
    rng: np.random.Generator, batch: int, height: int, width: int
) -> dict[str, np.ndarray]:
    # The classifier's spatial size is fixed; height/width only apply to the detector.
    shape = (batch, 3, CLASSIFIER_SIZE, CLASSIFIER_SIZE)
    return {"images": rng.standard_normal(shape).astype(np.float32)}


def _detector_inputs(
    rng: np.random.Generator, batch: int, height: int, width: int
) -> dict[str, np.ndarray]:
    return {"images": rng.standard_normal((batch, 3, height, width)).astype(np.float32)}


def _stateful_inputs(
    rng: np.random.Generator, batch: int, height: int, width: int
) -> dict[str, np.ndarray]:
    if batch != 1:
        raise ValueError("the stateful model cannot be batched; use batch=1")
    return {
        "x": np.asarray(rng.standard_normal(), dtype=np.float32),
        "state": rng.standard_normal(STATE_SHAPE).astype(np.float32),
    }


def _slow_inputs(
    rng: np.random.Generator, batch: int, height: int, width: int
) -> dict[str, np.ndarray]:
    # Matches the registry's slow model (default width), not the image width argument.
    return {"x": rng.standard_normal((batch, SLOW_WIDTH)).astype(np.float32)}


def _tiny_lm_inputs(
    rng: np.random.Generator, batch: int, height: int, width: int
) -> dict[str, np.ndarray]:
    # A prefill call of the registry's tiny LM: no padding and an empty cache.
    length = 8
    feed: dict[str, np.ndarray] = {
        "input_ids": rng.integers(0, TINY_LM_VOCAB, size=(batch, length), dtype=np.int64),
        "attention_mask": np.ones((batch, length), dtype=np.int64),
        "position_ids": np.tile(np.arange(length, dtype=np.int64), (batch, 1)),
    }
    empty = np.zeros((batch, TINY_LM_HEADS, 0, TINY_LM_HEAD_DIM), dtype=np.float32)
    for i in range(TINY_LM_LAYERS):
        feed[f"past_key_values.{i}.key"] = empty
        feed[f"past_key_values.{i}.value"] = empty
    return feed


#: Builtin models by name. Adding a generator takes one entry: name, factory, inputs.
BUILTIN_MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("classifier", make_classifier, _classifier_inputs),
        ModelSpec("detector", make_detector, _detector_inputs),
        ModelSpec("stateful", make_stateful, _stateful_inputs),
        ModelSpec("slow", make_slow, _slow_inputs),
        ModelSpec("heavy", make_heavy, _slow_inputs),
        ModelSpec("tiny_lm", make_tiny_lm, _tiny_lm_inputs),
    )
}


def make_all(
    directory: PathLike, *, progress: Callable[[str, Path], None] | None = None
) -> dict[str, Path]:
    """Write every builtin model as ``<directory>/<name>.onnx`` and return name -> path.

    ``directory`` is created if missing; ``progress(name, path)`` is called after each
    model is written.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    for name, spec in BUILTIN_MODELS.items():
        written[name] = spec(root / spec.filename)
        if progress is not None:
            progress(name, written[name])
    return written


def builtin_model(path: PathLike) -> ModelSpec | None:
    """The built-in model a model file stands for, by its stem (``tiny_lm.onnx`` is
    ``tiny_lm``), or None for a user's own model."""
    return BUILTIN_MODELS.get(Path(path).stem)


def make_missing_models(config: Any, progress: Callable[[str], None] | None = None) -> None:
    """Write the built-in models a fleet config names (see :func:`builtin_model`) whose
    files are missing. A user's own models are left alone; the config reports them
    missing when the fleet starts."""
    for name, model in config.models.items():
        spec = builtin_model(model.path)
        if model.path.is_file() or spec is None:
            continue
        if progress is not None:
            progress(f"generating model {name} -> {model.path}")
        spec(model.path)


def random_inputs(
    model_name: str,
    batch: int = 1,
    *,
    seed: int = DEFAULT_SEED,
    height: int = 32,
    width: int = 32,
) -> dict[str, np.ndarray]:
    """Return a valid, deterministic input feed for the builtin model ``model_name``.

    ``batch`` is the leading dim (must be 1 for ``stateful``); ``height``/``width``
    only affect ``detector``. ``slow`` inputs use the default width (256). ``tiny_lm``
    inputs are a prefill call of the default model: 8 random token ids per row, a full
    attention mask, positions 0..7 and an empty cache for every layer.
    """
    spec = BUILTIN_MODELS.get(model_name)
    if spec is None:
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise ValueError(f"unknown builtin model {model_name!r}; known: {known}")
    if batch < 1 or height < 1 or width < 1:
        raise ValueError("batch, height and width must all be >= 1")
    return spec.inputs(np.random.default_rng(seed), batch, height, width)


__all__ = [
    "BUILTIN_MODELS",
    "IR_VERSION",
    "OPSET",
    "TINY_LM_CONTEXT",
    "TINY_LM_VOCAB",
    "InputMaker",
    "ModelSpec",
    "builtin_model",
    "calibrate_slow",
    "make_all",
    "make_classifier",
    "make_detector",
    "make_genai_lm",
    "make_heavy",
    "make_missing_models",
    "make_slow",
    "make_spin",
    "make_stateful",
    "make_tiny_lm",
    "median_call_s",
    "random_inputs",
]
