"""The command line around configs, models and input files.

None of these start Ray: `validate` and `models show` only read files, and the `infer`
cases here fail before a fleet is contacted; so they run in this process (``cli``),
but for one `models show` run as a user runs it.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgefleet.modelgen import make_classifier, random_inputs
from tests.integration.test_cli import edgefleet

pytestmark = pytest.mark.integration

NO_FLEET = "nosuchfleet"  # a fleet nobody runs: reaching it would fail differently


def _matmul_model(path: Path, *, op: str = "MatMul", external: bool = False) -> Path:
    """``x[N,4] -> y[N,4]`` through one node; optionally its weight as external data."""
    weight = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "w"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    if external:
        onnx.save(model, path, save_as_external_data=True, location=f"{path.stem}.data",
                  size_threshold=0)  # fmt: skip
    else:
        onnx.save(model, path)
    return path


def _fleet(tmp_path: Path, models: dict[str, str]) -> Path:
    lines = "".join(f"  {name}: {{path: {file}}}\n" for name, file in models.items())
    config = tmp_path / "fleet.yaml"
    config.write_text(f"fleet: {{name: inputs}}\nmodels:\n{lines}")
    return config


# ----------------------------------------------------------------------------- validate


def test_validate_names_each_model_a_node_could_not_load(tmp_path, cli):
    (tmp_path / "notes.onnx").write_text("these are my notes, not a model\n")
    _matmul_model(tmp_path / "odd.onnx", op="Frobnicate")
    config = _fleet(tmp_path, {"mine": "mine.onnx", "notes": "notes.onnx", "odd": "odd.onnx"})
    result = cli("validate", str(config))
    assert result.returncode == 2, result.stdout
    err = result.stderr
    assert "3 model(s) would not load" in err and "valid" not in result.stdout
    assert f"model 'mine': {tmp_path / 'mine.onnx'} does not exist" in err
    assert "models make" not in err  # a user's own model: nothing can generate it
    assert f"model 'notes': {tmp_path / 'notes.onnx'} is not an ONNX model" in err
    assert "model 'odd': cannot load" in err and "Frobnicate" in err
    assert "Traceback" not in err


def test_validate_accepts_external_data_and_notes_missing_builtin_models(tmp_path, cli):
    _matmul_model(tmp_path / "weights.onnx", external=True)
    config = _fleet(tmp_path, {"mine": "weights.onnx", "classifier": "classifier.onnx"})
    result = cli("validate", str(config))
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout and "1 load in ONNX Runtime" in result.stdout
    note = next(line for line in result.stdout.splitlines() if "note:" in line)
    assert "model 'classifier'" in note and "edgefleet up" in note and "models make" in note
    (tmp_path / "weights.data").unlink()  # its external data gone: a node could not load it
    gone = cli("validate", str(config))
    assert gone.returncode == 2 and "model 'mine'" in gone.stderr, gone.stdout


# ----------------------------------------------------------------------------- models show


def test_models_show_prints_inputs_outputs_and_an_npz_line_that_works(tmp_path, monkeypatch, cli):
    make_classifier(tmp_path / "classifier.onnx")
    _matmul_model(tmp_path / "weights.onnx", external=True)
    config = _fleet(tmp_path, {"classifier": "classifier.onnx", "mine": "weights.onnx"})
    result = edgefleet("models", "show", str(config), "classifier", timeout=60)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "input   images  float32 [N,3,32,32]" in out
    assert "output  logits  float32 [N,10]" in out and "mine" not in out
    npz_line = next(line for line in out.splitlines() if "np.savez(" in line)
    monkeypatch.chdir(tmp_path)
    exec(npz_line.split(": ", 1)[1], {"np": np})  # the line as a user pastes it
    written = np.load(tmp_path / "classifier.npz")
    expected = random_inputs("classifier")
    assert {k: (v.dtype, v.shape) for k, v in written.items()} == {
        k: (v.dtype, v.shape) for k, v in expected.items()
    }
    one_file = cli("models", "show", str(tmp_path / "weights.onnx"))
    assert one_file.returncode == 0, one_file.stderr
    assert "input   x  float32 [N,4]" in one_file.stdout
    unknown = cli("models", "show", str(config), "nope")
    assert unknown.returncode == 2 and "unknown model(s): nope" in unknown.stderr


# ----------------------------------------------------------------------------- infer inputs


def _bad_inputs(tmp_path: Path) -> dict[str, Path]:
    text = tmp_path / "frame.txt"
    text.write_text("1 2 3\n")
    objects = tmp_path / "objects.npy"
    np.save(objects, np.array([{"images": 1}], dtype=object), allow_pickle=True)
    pickled = tmp_path / "pickled.npy"
    pickled.write_bytes(pickle.dumps({"images": np.zeros(3)}))
    return {"text": text, "object array": objects, "pickle": pickled}


@pytest.mark.parametrize("kind", ["text", "object array", "pickle"])
def test_infer_refuses_what_is_not_an_npz_or_npy_before_connecting(tmp_path, kind, cli):
    path = _bad_inputs(tmp_path)[kind]
    result = cli("infer", "classifier", "--fleet", NO_FLEET, "--input", str(path))
    assert result.returncode == 2, result.stderr
    assert f"{path} is not a NumPy .npz/.npy file" in result.stderr
    assert "allow_pickle" not in result.stderr and "Traceback" not in result.stderr
    assert "models show" in result.stderr  # how to build the file
    assert NO_FLEET not in result.stderr  # no fleet was looked for


@pytest.mark.parametrize("priority", ["-1", "11"])
def test_infer_and_generate_check_an_integer_priority_before_connecting(tmp_path, priority, cli):
    frame = tmp_path / "frame.npy"
    np.save(frame, random_inputs("classifier")["images"])
    for command in (
        ["infer", "classifier", "--input", str(frame)],
        ["generate", "tiny_lm", "--prompt-ids", "1", "2"],
    ):
        result = cli(*command, "--fleet", NO_FLEET, "--priority", priority)
        assert result.returncode == 2, result.stderr
        assert f"priority must be between 0 and 10, got {priority}" in result.stderr
        assert "unknown priority class" not in result.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--chat", "--prompt-ids", "1", "2"], "--chat takes text"),
        ([], "give the prompt: --prompt-ids, --prompt, or --chat"),
        (["--prompt", "hi", "--system", "be brief"], "--system is the system message of a --chat"),
    ],
)
def test_generate_checks_its_prompt_options_before_connecting(args, says, cli):
    result = cli("generate", "tiny_lm", "--fleet", NO_FLEET, *args)
    assert result.returncode == 2 and says in result.stderr, result.stderr
    assert NO_FLEET not in result.stderr  # no fleet was looked for


# ----------------------------------------------------------------------------- help


HELP = [  # command, what its --help must say
    (["infer"], ["--priority PRIORITY class name or 0-10 (default: foreground)",
                 "--fleet FLEET fleet name (default: local)", "np.savez(", "models show"]),
    (["generate"], ["(default: foreground)", "stop after this many new tokens (default: 64)",
                    "the prompt as token ids", "0 = greedy (default: 0.0)",
                    "render the prompt as a user's message with the model's chat template",
                    "--system TEXT with --chat: the system message (default: none)",
                    "edgefleet generate phi --chat"]),
    (["up"], ["seconds between status lines (default: 2.0)", "fleet.name"]),
    (["status"], ["seconds between refreshes (default: 2.0)", "(default: local)"]),
    (["dashboard", "check"], ["'.*' checks every fleet (default: local)"]),
    (["models", "make"], ["classifier, detector, stateful, slow, heavy, tiny_lm"]),
    (["models", "show"], ["example", "edgefleet models show", "np.savez("]),
]  # fmt: skip


@pytest.mark.parametrize(("command", "shown"), HELP, ids=[" ".join(c) for c, _ in HELP])
def test_help_shows_defaults_and_how_to(command, shown, cli):
    result = cli(*command, "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps lines where the width says
    for words in shown:
        assert " ".join(words.split()) in text, words


def test_every_option_with_a_default_shows_it():
    import argparse

    from cluster.cli import build_parser

    def parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
        found = [parser]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    found += parsers(sub)
        return found

    missing = []
    for parser in parsers(build_parser()):
        help_text = " ".join(parser.format_help().split())
        for action in parser._actions:
            if not action.option_strings or action.default in (None, argparse.SUPPRESS):
                continue
            if action.default is False:  # a flag
                continue
            if "default" not in (action.help or "") and f"(default: {action.default})" not in (
                help_text
            ):
                missing.append(f"{parser.prog} {action.option_strings[0]}")
    assert missing == []
