"""Every public FleetClient method answers bad arguments with a typed EdgeFleetError,
and the fleet keeps serving good requests alongside them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from cluster.client import FleetClient
from edgefleet.errors import EdgeFleetError
from edgefleet.modelgen import random_inputs

pytestmark = pytest.mark.integration


def _reply_error(reply: Any) -> None:
    """A submit future's reply: an error travels in ``Reply.error``; raise it."""
    reply.unwrap()


def bad_calls(fleet: FleetClient) -> dict[str, Callable[[], Any]]:
    good = random_inputs("classifier")
    x = good["images"]
    return {
        "infer unknown model": lambda: fleet.infer("gpt5", good),
        "infer inputs not a mapping": lambda: fleet.infer("classifier", [x]),  # type: ignore[arg-type]
        "infer input not an array": lambda: fleet.infer("classifier", {"images": "pixels"}),
        "infer wrong input name": lambda: fleet.infer("classifier", {"pixels": x}),
        "infer wrong dtype": lambda: fleet.infer("classifier", {"images": x.astype(np.int64)}),
        "infer wrong rank": lambda: fleet.infer("classifier", {"images": x[0]}),
        "infer NaN input": lambda: fleet.infer("classifier", {"images": x * np.nan}),
        "infer infinite input": lambda: fleet.infer("classifier", {"images": x + np.inf}),
        "infer object array": lambda: fleet.infer("classifier", {"images": x.astype(object)}),
        "infer unknown priority": lambda: fleet.infer("classifier", good, priority="urgent"),
        "infer priority out of range": lambda: fleet.infer("classifier", good, priority=11),
        "infer priority of a wrong type": lambda: fleet.infer("classifier", good, priority=1.5),  # type: ignore[arg-type]
        "infer negative deadline": lambda: fleet.infer("classifier", good, deadline_s=-1),
        "infer deadline not a number": lambda: fleet.infer("classifier", good, deadline_s="soon"),  # type: ignore[arg-type]
        "infer key not a string": lambda: fleet.infer("classifier", good, key=7),  # type: ignore[arg-type]
        "infer id not a string": lambda: fleet.infer("classifier", good, request_id=7),  # type: ignore[arg-type]
        "infer_reply unknown model": lambda: fleet.infer_reply("gpt5", good).unwrap(),
        "submit wrong dtype": lambda: _reply_error(
            fleet.submit("classifier", {"images": x.astype(np.float64)}).result(60)
        ),
        "submit unknown priority": lambda: fleet.submit("classifier", good, priority="urgent"),
        "infer_async wrong shape": lambda: asyncio.run(
            fleet.infer_async("classifier", {"images": np.zeros((1, 3, 8, 8), np.float32)})
        ),
        "generate unknown model": lambda: fleet.generate("gpt5", [1, 2]),
        "generate on a tensor model": lambda: fleet.generate("classifier", [1, 2]).collect(),
        "generate prompt not ids": lambda: fleet.generate("tiny_lm", ["a", "b"]),
        "generate empty prompt": lambda: fleet.generate("tiny_lm", []).collect(),
        "generate token id out of vocabulary": lambda: fleet.generate(
            "tiny_lm", [1, 10**9]
        ).collect(),
        "generate negative token id": lambda: fleet.generate("tiny_lm", [-5]).collect(),
        "generate negative max_new_tokens": lambda: fleet.generate(
            "tiny_lm", [1], max_new_tokens=-1
        ).collect(),
        "generate huge max_new_tokens": lambda: fleet.generate(
            "tiny_lm", [1], max_new_tokens=10**9
        ).collect(),
        "generate bad temperature": lambda: fleet.generate(
            "tiny_lm", [1], temperature=-1
        ).collect(),
        "generate bad stop ids": lambda: fleet.generate("tiny_lm", [1], stop_ids=["x"]),  # type: ignore[list-item]
        "gather timeout": lambda: FleetClient.gather(
            [fleet.submit("classifier", good) for _ in range(64)], timeout_s=0
        ),
        "set_lifecycle unknown node": lambda: fleet.set_lifecycle("edge-9", "background"),
        "set_lifecycle bad state": lambda: fleet.set_lifecycle("edge-0", "asleep"),
        "switch_model unknown node": lambda: fleet.switch_model("edge-9", "classifier"),
        "switch_model unknown model": lambda: fleet.switch_model("edge-0", "gpt5"),
        "drain unknown node": lambda: fleet.drain("edge-9"),
        "cancel id not a string": lambda: fleet.cancel(7),  # type: ignore[arg-type]
        "with_placement unknown policy": lambda: fleet.with_placement(policy="fastest"),
        "local missing config file": lambda: FleetClient.local("no/such/fleet.yaml"),
        "connect unknown fleet": lambda: FleetClient.connect(fleet="no-such-fleet"),
    }


def test_every_public_method_answers_bad_arguments_with_a_typed_error(make_fleet):
    fleet = make_fleet(
        {
            "local": {"nodes": 2},
            "models": {
                "classifier": {"path": "classifier.onnx"},
                "tiny_lm": {"path": "tiny_lm.onnx", "kind": "decoder"},
            },
        }
    )
    good = random_inputs("classifier")
    background = [fleet.submit("classifier", good, priority="background") for _ in range(32)]
    untyped: dict[str, str] = {}
    for name, call in bad_calls(fleet).items():
        try:
            call()
        except EdgeFleetError as exc:
            assert str(exc), name  # a message that names the problem
            continue
        except BaseException as exc:  # noqa: BLE001 - what escapes is the finding
            untyped[name] = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"[:300]
            continue
        untyped[name] = "no error"
    assert untyped == {}, "\n".join(f"{k}: {v}" for k, v in untyped.items())
    # Good requests sent alongside were all answered, and the fleet still serves.
    assert all(r.error is None for r in FleetClient.gather(background, 120))
    assert fleet.infer("classifier", good)["logits"].shape == (1, 10)
    assert all(fleet.status().healthy.values())
