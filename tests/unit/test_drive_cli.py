"""`edgefleet drive`, in this process: what it refuses before anything starts (one line
on stderr, exit status 2, no Ray), and the report it builds from a run's answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.cli import drive
from cluster.traffic import Answer
from edgefleet.config import load_config
from edgefleet.errors import Evicted, Rejected, TimedOut
from edgefleet.messages import Reply
from sim.report import report_markdown
from sim.workload import Arrival

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs" / "local.yaml")


@pytest.fixture(autouse=True)
def _no_ray() -> None:
    """No Ray in this process as each test starts (a test file that ran before on this
    worker may have left the session's up; the next that needs it starts it again), so
    that a refusal is seen to start and connect nothing."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _workload(tmp_path: Path, mix: str, head: str = "") -> str:
    path = tmp_path / "w.yaml"
    path.write_text(
        f"seed: 1\nrequests: 20\n{head}arrivals: {{process: poisson, rate: 50}}\nmix:\n{mix}"
    )
    return str(path)


def _refused(result: object) -> str:
    import ray

    assert result.returncode == 2, (result.stdout, result.stderr)  # type: ignore[attr-defined]
    lines = result.stderr.strip().splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 1, lines
    assert lines[0].startswith("error: "), lines
    assert result.stdout == ""  # type: ignore[attr-defined]
    assert not ray.is_initialized()  # nothing started, nothing connected
    return lines[0]


def test_drive_has_help_with_an_example(cli):
    result = cli("drive", "--help")
    assert result.returncode == 0
    assert "edgefleet drive configs/local.yaml --workload" in result.stdout
    assert "--record" in result.stdout and "--fleet" in result.stdout


def test_a_model_the_fleet_does_not_serve_is_refused_before_anything_starts(tmp_path, cli):
    workload = _workload(
        tmp_path, "  - {model: classifier, priority: inline}\n  - {model: nosuch, priority: 10}\n"
    )
    line = _refused(cli("drive", CONFIG, "--workload", workload))
    assert "mix.1.model (line 6)" in line
    assert "does not serve 'nosuch'" in line and "classifier" in line


def test_an_unknown_priority_class_is_refused(tmp_path, cli):
    workload = _workload(tmp_path, "  - {model: classifier, priority: urgent}\n")
    line = _refused(cli("drive", CONFIG, "--workload", workload))
    assert "mix.0.priority" in line and "'urgent'" in line


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("seed: 1\nrequests: 5\narrivals: {process: poisson, rate: 1, bogus: 2}\nmix:\n"
         "  - {model: classifier, priority: inline}\n", "arrivals.bogus (line 3): unknown key"),
        ("seed: 1\narrivals: {process: poisson, rate: 1}\nmix:\n"
         "  - {model: classifier, priority: inline}\n", "nothing ends the arrivals"),
        ("- just a list\n", "the top level must be a mapping"),
        ("arrivals: [unclosed\n", "not valid YAML"),
    ],
    ids=["unknown key", "no end", "not a mapping", "not yaml"],
)  # fmt: skip
def test_a_bad_workload_file_is_refused_on_one_line(tmp_path, cli, text, said):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    line = _refused(cli("drive", CONFIG, "--workload", str(path)))
    assert said in line and str(path) in line


def test_a_missing_workload_file_is_refused(tmp_path, cli):
    line = _refused(cli("drive", CONFIG, "--workload", str(tmp_path / "none.yaml")))
    assert "cannot read workload" in line


def test_generations_of_a_model_that_is_not_a_decoder_are_refused(tmp_path, cli):
    workload = _workload(
        tmp_path,
        "  - {model: classifier, priority: inline, generate: {prompt_tokens: 4, "
        "max_new_tokens: 2}}\n",
    )
    line = _refused(cli("drive", CONFIG, "--workload", workload))
    assert "mix.0.generate (line 5)" in line and "'classifier' is not a decoder" in line


def test_inference_on_a_decoder_is_refused(tmp_path, cli):
    workload = _workload(tmp_path, "  - {model: tiny_lm, priority: inline}\n")
    line = _refused(cli("drive", CONFIG, "--workload", workload))
    assert "'tiny_lm' is a decoder" in line


def test_a_fleet_that_is_not_running_is_refused(tmp_path, cli):
    workload = _workload(tmp_path, "  - {model: classifier, priority: inline}\n")
    args = ("--workload", workload, "--fleet", "nope", "--address", "127.0.0.1:1")
    line = _refused(cli("drive", CONFIG, *args))
    assert "fleet 'nope'" in line and "127.0.0.1:1" in line


def test_a_bad_config_is_refused(tmp_path, cli):
    workload = _workload(tmp_path, "  - {model: classifier, priority: inline}\n")
    line = _refused(cli("drive", str(tmp_path / "none.yaml"), "--workload", workload))
    assert "cannot read config" in line


@pytest.mark.parametrize(
    "argv",
    [
        ["drive", CONFIG],  # no --workload
        ["drive", CONFIG, "--workload", "w.yaml", "--requests", "0"],
        ["drive", CONFIG, "--workload", "w.yaml", "--requests", "many"],
        ["drive", "--workload", "w.yaml"],  # no CONFIG
    ],
    ids=["no workload", "zero requests", "not a number", "no config"],
)
def test_bad_arguments_are_usage_errors(cli, argv):
    result = cli(*argv)
    assert result.returncode == 2
    assert "usage: edgefleet drive" in result.stderr


def test_the_report_has_each_class_every_outcome_and_the_errors_by_type():
    config = load_config(CONFIG)
    p = config.priorities
    arrivals = [
        Arrival(0.0, "classifier", p["foreground"]),
        Arrival(0.1, "classifier", p["foreground"]),
        Arrival(0.2, "heavy", p["background"], rows=2),
        Arrival(0.3, "heavy", p["offline"]),
        Arrival(0.4, "heavy", p["offline"]),
    ]
    replies = [
        Reply("a", "edge-0", service_s=0.004, batch_size=2),
        Reply("b", "edge-1", service_s=0.002, batch_size=1),
        Reply("c", "", error=Rejected("full", retry_after_s=0.1)),
        Reply("d", "edge-1", error=Evicted("room")),
        Reply("e", "", error=TimedOut("late")),
    ]
    tally = drive._Tally()
    for i, (arrival, reply) in enumerate(zip(arrivals, replies, strict=True)):
        due = 10.0 + arrival.at
        tally.add(
            Answer(reply, due + 0.001, due + 0.010 * (i + 1), due + 0.001, True, arrival, due)
        )
    tally.sent = 5
    tally.samples = [(0.5, 3, 2)]
    plan = drive._Plan([*arrivals, Arrival(0.5, "classifier", p["inline"])], dict(p), 2, 1)
    result = drive._result(tally, plan, config, {"spilled": 2}, 1.0, interrupted=True)
    rows = {r["name"]: r for r in result.latency_table()}
    assert rows["foreground"]["completed"] == 2
    assert rows["foreground"]["p99_ms"] == pytest.approx(19.9, abs=0.2)  # due to answer
    assert rows["background"]["answered"] == 1 and rows["background"]["completed"] == 0
    assert rows["all"]["answered"] == 5
    counts = result.counts()
    outcomes = ("completed", "rejected", "evicted", "failed")
    assert [counts[k] for k in outcomes] == [2, 1, 1, 1]
    assert counts["failed: TimedOut"] == 1 and counts["spilled"] == 2
    assert counts["not sent (interrupted)"] == 1
    assert result.recorder.busy_s == pytest.approx([0.002, 0.002])
    text = report_markdown([result], title="Live fleet", description=["a run"])
    assert result.simulated_s == pytest.approx(0.45)  # the start to the last answer
    assert f"Drove a live fleet for {result.simulated_s:.1f} s; 5 answers." in text
    assert "| foreground " in text and "| failed: TimedOut " in text
    assert "Interrupted: results so far" in text and "simulated" not in text
    assert "![" not in text  # printed: no plots


def test_inputs_follow_the_rows_and_refuse_what_a_model_cannot_batch():
    config = load_config(CONFIG)
    assert drive._inputs(config, "heavy", 3)["x"].shape[0] == 3
    assert drive._inputs(config, "classifier", 1)["images"].shape == (1, 3, 32, 32)
    with pytest.raises(Exception, match="stateful"):
        drive._inputs(config, "stateful", 2)


def test_one_line_joins_each_problem():
    from edgefleet.errors import ConfigError

    def fail() -> None:
        raise ConfigError("workload w.yaml does not fit the fleet:\n  a: one\n  b: two")

    with pytest.raises(ConfigError) as exc:
        drive._one_line(fail)
    assert str(exc.value) == "workload w.yaml does not fit the fleet: a: one; b: two"


def test_a_live_run_reads_as_one_in_the_simulators_report(tmp_path):
    from sim.report import Recorder, RunResult, write_report

    recorder = Recorder(["edge-0"], {"foreground": 10})
    recorder.answer(10, "completed", 0.01, 0)
    result = RunResult("live", recorder, 2.0, 2.0, 1, live=True)
    text = write_report(tmp_path, [result], title="Live fleet").read_text()
    assert "Drove a live fleet for 2.0 s; 1 answers." in text
    assert "(latency_cdf.png)" in text and (tmp_path / "latency_cdf.png").is_file()
    assert "queued on nodes and in flight over time into the run" in text
    assert "simulated time" not in text


def test_a_users_own_model_gets_the_inputs_its_node_warms_up_with(tmp_path):
    import onnxruntime as ort

    from actors.engine import session_signature
    from actors.models import synthetic_inputs
    from edgefleet.config import parse_config
    from edgefleet.modelgen import make_classifier

    make_classifier(tmp_path / "mine.onnx")  # not a built-in's file name
    config = parse_config({"models": {"mine": {"path": "mine.onnx"}}}, tmp_path)
    sig = session_signature(ort.InferenceSession(str(tmp_path / "mine.onnx")))
    got, expected = drive._inputs(config, "mine", 3), synthetic_inputs(sig, 3)
    assert got.keys() == expected.keys()
    for name, array in got.items():
        assert array.shape[0] == 3 and (array == expected[name]).all()


class _Stream:
    def __init__(self, result: object, error: Exception | None = None) -> None:
        self.result, self._error = result, error
        self.node = getattr(result, "node", None)

    def collect(self) -> list[int]:
        if self._error is not None:
            raise self._error
        return []


def test_a_generation_is_answered_as_one_reply_with_its_outcome():
    from edgefleet.errors import Cancelled
    from edgefleet.messages import GenerationResult

    done = GenerationResult("g1", "edge-0", (5, 6), "length", queue_s=0.01, engine_s=0.2)
    cancelled = GenerationResult("g2", "edge-1", (5,), "cancelled")
    streams = {
        "g1": _Stream(done),
        "g2": _Stream(cancelled),
        "g3": _Stream(None, Rejected("full", retry_after_s=0.1)),
    }

    class Client:
        def generate(self, model: str, prompt: tuple[int, ...], **kw: object) -> _Stream:
            assert kw["timeout_s"] == 5.0 and prompt == (1, 2)
            return streams[str(kw["request_id"])]

    timed = drive._Timed(Client(), 5.0)  # type: ignore[arg-type]
    try:
        got = {
            rid: timed.submit_generation("lm", (1, 2), request_id=rid, priority=3).result(30)
            for rid in streams
        }
    finally:
        timed.close()
    assert got["g1"].error is None and got["g1"].node == "edge-0"
    assert (got["g1"].queue_s, got["g1"].service_s, got["g1"].batch_size) == (0.01, 0.2, 1)
    assert isinstance(got["g2"].error, Cancelled) and got["g2"].node == "edge-1"
    assert isinstance(got["g3"].error, Rejected) and got["g3"].node == ""
