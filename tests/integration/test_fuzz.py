"""Bad requests, generated: every one gets a typed EdgeFleetError naming the problem,
while good requests on the same nodes keep completing and no node goes down."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.client import FleetClient
from edgefleet.errors import EdgeFleetError
from edgefleet.modelgen import TINY_LM_VOCAB, random_inputs

pytestmark = pytest.mark.integration

EXAMPLES = 300  # per test; two tests: 600 bad requests in a run
MAX_INPUT_BYTES = 64 * 1024  # small, so that oversized inputs are cheap to make
GOOD = random_inputs("classifier")["images"]  # float32 [1,3,32,32]

_DTYPES = [np.float64, np.float16, np.int32, np.int64, np.uint8, np.bool_, np.complex64]


def _shape_off(draw: Any) -> np.ndarray:
    shape = draw(
        st.lists(st.integers(0, 6), min_size=0, max_size=5).filter(
            lambda s: len(s) != 4 or s[1:] != [3, 32, 32] or s[0] == 0
        )
    )
    return np.zeros(shape, np.float32)


@st.composite
def bad_infer(draw: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(model, inputs, keywords) of a request that must be refused: a good request with
    one thing wrong."""
    model, inputs, kw = "classifier", {"images": GOOD}, {}
    kind = draw(
        st.sampled_from(
            ["model", "name", "extra", "missing", "dtype", "shape", "nan", "object", "type",
             "oversized", "priority", "deadline", "key", "id"]
        )
    )  # fmt: skip
    if kind == "model":
        model = draw(st.text(min_size=0, max_size=12).filter(lambda m: m != "classifier"))
    elif kind == "name":
        name = draw(st.text(min_size=0, max_size=12).filter(lambda n: n != "images"))
        inputs = {name: GOOD}
    elif kind == "extra":
        inputs = {"images": GOOD, "mask": GOOD}
    elif kind == "missing":
        inputs = {}
    elif kind == "dtype":
        inputs = {"images": GOOD.astype(draw(st.sampled_from(_DTYPES)))}
    elif kind == "shape":
        inputs = {"images": _shape_off(draw)}
    elif kind == "nan":
        bad = GOOD.copy()
        bad.flat[draw(st.integers(0, bad.size - 1))] = draw(
            st.sampled_from([np.nan, np.inf, -np.inf])
        )
        inputs = {"images": bad}
    elif kind == "object":
        inputs = {"images": GOOD.astype(object)}
    elif kind == "type":
        inputs = {"images": draw(st.sampled_from([GOOD.tolist(), "pixels", None, 3.0, b"x"]))}
    elif kind == "oversized":
        rows = draw(st.integers(MAX_INPUT_BYTES // GOOD.nbytes + 1, 64))
        inputs = {"images": np.zeros((rows, 3, 32, 32), np.float32)}
    elif kind == "priority":
        kw["priority"] = draw(
            st.one_of(
                st.integers().filter(lambda p: not 0 <= p <= 10),
                st.text(max_size=10).filter(
                    lambda p: p not in ("foreground", "inline", "background", "offline")
                ),
                st.floats(allow_nan=True),
                st.none(),
            )
        )
    elif kind == "deadline":
        kw["deadline_s"] = draw(
            st.one_of(st.floats(max_value=-1e-3), st.just(float("nan")), st.text(max_size=4))
        )
    elif kind == "key":
        kw["key"] = draw(st.one_of(st.integers(), st.just(""), st.lists(st.integers())))
    else:
        kw["request_id"] = draw(st.one_of(st.integers(), st.just(""), st.floats()))
    return model, inputs, kw


@st.composite
def bad_generate(draw: Any) -> tuple[str, Any, dict[str, Any]]:
    model, prompt, kw = "tiny_lm", [1, 2, 3], {}
    kind = draw(
        st.sampled_from(
            ["model", "tensor", "empty", "vocab", "negative", "not_ids", "new_tokens",
             "temperature", "top_k", "prefix", "stop", "context"]
        )
    )  # fmt: skip
    if kind == "model":
        model = draw(st.text(max_size=12).filter(lambda m: m not in ("tiny_lm", "classifier")))
    elif kind == "tensor":
        model = "classifier"
    elif kind == "empty":
        prompt = []
    elif kind == "vocab":
        prompt = [1, draw(st.integers(TINY_LM_VOCAB, 2**62))]
    elif kind == "negative":
        prompt = [draw(st.integers(max_value=-1)), 2]
    elif kind == "not_ids":
        prompt = draw(
            st.one_of(
                st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=4),
                st.lists(st.floats(), min_size=1, max_size=4),
                st.just(None),
            )
        )
    elif kind == "new_tokens":
        kw["max_new_tokens"] = draw(st.one_of(st.integers(max_value=0), st.integers(10**6)))
    elif kind == "temperature":
        kw["temperature"] = draw(st.one_of(st.floats(max_value=-1e-6), st.just(float("nan"))))
    elif kind == "top_k":
        kw["top_k"] = draw(st.integers(max_value=-1))
    elif kind == "prefix":
        kw["prefix_len"] = draw(st.one_of(st.integers(max_value=-1), st.integers(4, 10**6)))
    elif kind == "stop":
        kw["stop_ids"] = draw(st.lists(st.text(min_size=1, max_size=2), min_size=1, max_size=3))
    else:
        prompt = [1] * draw(st.integers(600, 2000))
    return model, prompt, kw


class GoodTraffic:
    """Good requests on every node while the bad ones arrive; counts how they end."""

    def __init__(self, fleet: FleetClient) -> None:
        self.fleet = fleet
        self.outcomes: Counter[str] = Counter()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            refs = [self.fleet.submit("classifier", {"images": GOOD}) for _ in range(4)]
            stream = self.fleet.generate("tiny_lm", [1, 2, 3], max_new_tokens=4)
            tokens = stream.collect()
            self.outcomes["generated" if len(tokens) == 4 else "short"] += 1
            for reply in FleetClient.gather(refs, 60):
                self.outcomes["completed" if reply.error is None else repr(reply.error)] += 1

    def __enter__(self) -> GoodTraffic:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)


@pytest.fixture(scope="module")
def fuzz_fleet(models_dir: Any) -> Any:
    import ray

    from cluster.deploy import init_loopback_ray
    from edgefleet.config import parse_config

    if not ray.is_initialized():
        init_loopback_ray(num_cpus=4)
    config = parse_config(
        {
            "fleet": {"name": "fuzz"},
            "local": {"nodes": 2},
            "models": {
                "classifier": {"path": "classifier.onnx", "max_input_bytes": MAX_INPUT_BYTES},
                "tiny_lm": {"path": "tiny_lm.onnx", "kind": "decoder"},
            },
        },
        models_dir,
    )
    with FleetClient.local(config) as fleet:
        pids = {n.name: n.pid for n in fleet.status().nodes}
        with GoodTraffic(fleet) as good:
            yield fleet
        # Nothing crashed and every good request alongside completed.
        status = fleet.status()
        assert {n.name: n.pid for n in status.nodes} == pids
        assert all(status.healthy.values())
        assert set(good.outcomes) == {"completed", "generated"}, good.outcomes
        assert good.outcomes["completed"] > 0


def _typed(call: Any) -> EdgeFleetError:
    try:
        call()
    except EdgeFleetError as exc:
        assert str(exc)  # it says what is wrong
        return exc
    raise AssertionError("a bad request was served")


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same requests every run
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=bad_infer())
def test_bad_inference_requests_get_typed_errors(fuzz_fleet, case):
    model, inputs, kw = case
    _typed(lambda: fuzz_fleet.infer(model, inputs, **kw))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=bad_generate())
def test_bad_generation_requests_get_typed_errors(fuzz_fleet, case):
    model, prompt, kw = case
    _typed(lambda: fuzz_fleet.generate(model, prompt, **kw).collect())
