"""The edgefleet command: run as a user runs it (the console script, in a subprocess)
where the process is what is checked (one run of each command, Ctrl-C, separate Ray
instances), else in this process (the ``cli`` fixture), checking exit codes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from cluster.text import TOKENIZER_FILE, tokenizer_for
from edgefleet.modelgen import make_tokenizer, random_inputs

REPO = Path(__file__).resolve().parents[2]
EDGEFLEET = Path(sys.executable).parent / "edgefleet"  # the console script
pytestmark = pytest.mark.integration


def edgefleet(
    *args: str, cwd: Path = REPO, timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """The console script run as a user runs it; ``env``: more environment for it."""
    return subprocess.run(
        [str(EDGEFLEET), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else {**os.environ, **env},
    )


COMMANDS = [
    ["up"], ["down"], ["status"], ["join"], ["infer"], ["generate"], ["demo"], ["validate"],
    ["models", "make"], ["models", "show"], ["dashboard", "export"], ["dashboard", "push"],
    ["dashboard", "prometheus-config"], ["dashboard", "check"],
]  # fmt: skip


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_has_help_with_an_example(command, cli):
    result = cli(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert "example" in result.stdout and f"edgefleet {' '.join(command)}" in result.stdout


START_S = 240.0  # starting Ray and a fleet on a busy machine
ANSWER_S = 30.0  # a command for a fleet that is not there answers by then (Ray would retry
# for a minute); starting Python and Ray alone takes 3-12 s on a busy 2-core machine
STOP_S = 10.0  # Ctrl-C: about 2 s on an idle machine; slack for a busy one


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Running:
    """A command started as a user starts it, its output watched as it comes."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [str(EDGEFLEET), *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # Ctrl-C in a terminal reaches the whole process group
            # As from a terminal: SIGINT not ignored, though this test run may ignore it
            # (a shell without job control starts background commands so) and a child
            # inherits that.
            preexec_fn=_default_sigint,
        )
        self._out: list[bytes] = []
        self._err: list[bytes] = []
        self._more = threading.Condition()
        for stream, into in ((self.proc.stdout, self._out), (self.proc.stderr, self._err)):
            threading.Thread(target=self._read, args=(stream, into), daemon=True).start()

    def _read(self, stream: object, into: list[bytes]) -> None:
        fd = stream.fileno()  # type: ignore[attr-defined]
        while chunk := os.read(fd, 4096):
            with self._more:
                into.append(chunk)
                self._more.notify_all()
        # The end of its output: a waiter learns at once that the process exited (not
        # after its whole timeout, when what it waits for never came).
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        with self._more:
            self._more.notify_all()

    @property
    def out(self) -> str:
        return b"".join(self._out).decode()

    @property
    def err(self) -> str:
        return b"".join(self._err).decode()

    def wait_for(self, text: str, timeout_s: float = START_S, *, err: bool = False) -> None:
        """Until ``text`` is in the output (``err``: in what it wrote to stderr); fails,
        showing the output, if it never comes."""

        def said() -> str:
            return self.err if err else self.out

        with self._more:
            came = self._more.wait_for(
                lambda: text in said() or self.proc.poll() is not None, timeout_s
            )
        assert came and text in said(), (self.out + self.err)[-3000:]

    def interrupt(self) -> float:
        """Ctrl-C; the seconds until the command exited."""
        os.killpg(self.proc.pid, signal.SIGINT)
        sent = time.monotonic()
        self.proc.wait(START_S)
        return time.monotonic() - sent

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def test_help_lists_commands_with_examples():
    result = subprocess.run(  # `python -m cluster.cli` is the command too
        [sys.executable, "-m", "cluster.cli", "--help"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0
    for word in ("demo", "models", "validate", "examples:"):
        assert word in result.stdout


def test_models_make_writes_every_model(tmp_path, cli):
    result = cli("models", "make", str(tmp_path / "m"))
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in (tmp_path / "m").glob("*.onnx"))
    assert names == [
        "classifier.onnx",
        "detector.onnx",
        "heavy.onnx",
        "slow.onnx",
        "stateful.onnx",
        "tiny_lm.onnx",
    ]
    assert "[6/6]" in result.stdout
    bad = cli("models", "make", str(tmp_path / "m"), "--only", "gpt5")
    assert bad.returncode == 2 and "unknown model" in bad.stderr


def test_validate_good_and_bad(tmp_path, cli):
    ok = edgefleet("validate", "configs/local.yaml")
    assert ok.returncode == 0 and "valid" in ok.stdout
    broken = tmp_path / "broken.yaml"
    broken.write_text("models:\n  a: {path: a.onnx, batching: {window_ms: fast}}\n")
    bad = cli("validate", str(broken))
    assert bad.returncode == 2
    assert "models.a.batching.window_ms (line 2)" in bad.stderr


def test_demo_runs_to_its_report_beside_another_embedded_fleet(tmp_path, make_fleet):
    # Another embedded fleet runs on this machine meanwhile (this test's own Ray): two
    # embedded Ray instances must not collide (ports, agents, temporary folders).
    other = make_fleet({"models": {"classifier": {"path": "classifier.onnx"}}})
    shutil.copy(REPO / "configs" / "local.yaml", tmp_path / "local.yaml")
    result = edgefleet("demo", "--config", str(tmp_path / "local.yaml"), "--duration", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    assert other.infer("classifier", random_inputs("classifier"))["logits"].shape == (1, 10)
    out = result.stdout
    assert "generating model classifier" in out  # models made on first run
    assert "running a mixed workload" in out
    for cls in ("foreground", "inline", "background", "offline"):
        assert any(line.startswith(cls) for line in out.splitlines()), cls
    assert "ran on: edge-0" in out
    assert "router: shed " in out and "nodes: admitted " in out
    chat = next(line for line in out.splitlines() if line.startswith("chat "))
    assert int(chat.split()[1]) > 0, chat  # chat turns completed
    assert "event: edge-1 is now in the background" in out


def test_ctrl_c_stops_the_demo_quickly_with_its_report_so_far(tmp_path):
    shutil.copy(REPO / "configs" / "local.yaml", tmp_path / "local.yaml")
    demo = Running("demo", "--config", str(tmp_path / "local.yaml"))
    try:
        demo.wait_for("s] completed")
        took = demo.interrupt()
    finally:
        demo.kill()
    assert demo.proc.returncode == 130, (demo.out[-2000:], demo.err[-2000:], took)
    assert "interrupted: stopping the fleet" in demo.out
    assert any(line.startswith("background") for line in demo.out.splitlines()), demo.out
    assert "generation       turns" in demo.out
    assert "Traceback" not in demo.err and "WARNING" not in demo.err, demo.err[-3000:]
    assert took < 10, took  # 3 s on an idle machine; slack for a busy one


def _fleet_processes(marker: str) -> list[int]:
    """Every process whose command line or open files mention ``marker``."""
    import psutil

    pids = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(marker in part for part in proc.info["cmdline"] or ()) or any(
                marker in f.path for f in proc.open_files()
            ):
                pids.append(proc.pid)
        except psutil.Error:
            continue
    return pids


def test_up_detach_status_client_down(tmp_path):
    from cluster.head import head_dir, head_processes

    fleet = f"clitest{os.getpid()}"
    config = tmp_path / "fleet.yaml"
    config.write_text(
        f"fleet: {{name: {fleet}}}\nlocal: {{nodes: 2}}\n"
        "models:\n  classifier: {path: models/classifier.onnx}\n"
        "  tiny_lm: {path: models/tiny_lm.onnx, kind: decoder}\n"
    )
    made = edgefleet("models", "make", str(tmp_path / "models"), "--only", "classifier", "tiny_lm")
    assert made.returncode == 0, made.stderr
    make_tokenizer(tmp_path / "models" / TOKENIZER_FILE)
    try:
        up = edgefleet("up", str(config), "--detach")
        assert up.returncode == 0, up.stderr[-3000:]
        assert f"fleet '{fleet}' is up: 2 node(s)" in up.stdout
        processes = sorted(p.pid for p in head_processes(fleet))

        second = edgefleet("up", str(config), "--detach")
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"fleet {fleet!r} is already running" in second.stderr
        assert f"`edgefleet down --fleet {fleet}`" in second.stderr
        assert "started a Ray head" not in second.stdout
        assert sorted(p.pid for p in head_processes(fleet)) == processes  # nothing new
        # Prometheus finds the head's metrics agent, on loopback, where Ray would say.
        sd_file = head_dir(fleet) / "prom_metrics_service_discovery.json"
        (entry,) = json.loads(sd_file.read_text())
        assert [t.split(":")[0] for t in entry["targets"]] == ["127.0.0.1"]

        status = edgefleet("status", "--fleet", fleet, "--json")
        assert status.returncode == 0, status.stderr[-3000:]
        data = json.loads(status.stdout)
        assert sorted(n["name"] for n in data["nodes"]) == ["edge-0", "edge-1"]
        assert all(n["healthy"] for n in data["nodes"])
        # Another fleet's name: Ray's discovery finds this (token-authenticated) head,
        # which has no such fleet; said at once, not a connection traceback.
        other = edgefleet("status", "--fleet", f"{fleet}-other")
        assert other.returncode == 2, other.stderr[-3000:]
        assert f"no fleet '{fleet}-other' is running on this Ray cluster" in other.stderr

        client = subprocess.run(
            [sys.executable, "-c", CLIENT.format(fleet=fleet)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert client.returncode == 0, client.stderr[-3000:]
        assert "logits (1, 10)" in client.stdout

        # The same prompt as token ids, then as text (tokenized by the caller with the
        # tokenizer.json beside the model): greedy, so the text is those ids decoded.
        tokenizer = tokenizer_for("tiny_lm", tmp_path / "models" / "tiny_lm.onnx")
        ids = [str(i) for i in tokenizer.encode("a heron by the dock")]
        gen = edgefleet(
            "generate", "tiny_lm", "--fleet", fleet, "--prompt-ids", *ids,
            "--max-new-tokens", "6", "--priority", "background",
        )  # fmt: skip
        assert gen.returncode == 0, gen.stderr[-3000:]
        assert len(gen.stdout.split()) == 6 and "finish: length (6 tokens" in gen.stderr
        text = edgefleet(
            "generate", "tiny_lm", "--fleet", fleet, "--prompt", "a heron by the dock",
            "--max-new-tokens", "6",
        )  # fmt: skip
        assert text.returncode == 0, text.stderr[-3000:]
        assert text.stdout.rstrip("\n") == tokenizer.decode(int(t) for t in gen.stdout.split())

        np.savez(tmp_path / "frame.npz", **random_inputs("classifier"))
        infer = edgefleet(
            "infer", "classifier", "--fleet", fleet, "--input", str(tmp_path / "frame.npz"),
            "--priority", "inline", "--out", str(tmp_path / "out.npz"),
        )  # fmt: skip
        assert infer.returncode == 0, infer.stderr[-3000:]
        assert "logits: float32 [1, 10]" in infer.stdout
        assert np.load(tmp_path / "out.npz")["logits"].shape == (1, 10)

        # Ctrl-C in the middle of a stream cancels it: exit 130, no traceback.
        stream = Running(
            "generate", "tiny_lm", "--fleet", fleet, "--prompt-ids", "1", "2", "3",
            "--max-new-tokens", "400", "--priority", "background",
        )  # fmt: skip
        try:
            stream.wait_for(" ")  # the first token
            took = stream.interrupt()
        finally:
            stream.kill()
        # It may have finished just before the signal came (exit 0).
        assert stream.proc.returncode in (0, 130), stream.err[-3000:]
        assert "Traceback" not in stream.err, stream.err[-3000:]
        assert took < STOP_S, took

        # Ctrl-C is how `status --watch` ends: exit 0.
        watch = Running("status", "--fleet", fleet, "--watch", "--interval", "0.5")
        try:
            watch.wait_for("overview over the last")  # the second screen
            took = watch.interrupt()
        finally:
            watch.kill()
        assert "overview since the nodes started" in watch.out  # the first
        assert "overview over the last" in watch.out and "throughput" in watch.out
        assert watch.proc.returncode == 0, watch.err[-3000:]
        assert "Traceback" not in watch.err, watch.err[-3000:]
        assert took < STOP_S, took
    finally:
        started = time.monotonic()
        down = edgefleet("down", "--fleet", fleet)
        took = time.monotonic() - started
    assert down.returncode == 0, down.stderr[-3000:]
    assert f"fleet {fleet!r} stopped (2 node(s) and its router)" in down.stdout
    assert "stopped the Ray head" in down.stdout
    assert _fleet_processes(str(head_dir(fleet))) == [] and not head_dir(fleet).exists()
    assert took < ANSWER_S, took  # it was 17 s when every process was stopped at once


def test_status_table_too_long_prompt_and_npy_input(tmp_path, make_fleet, cli_on_ray):
    from cluster.client import FleetClient

    fleet = make_fleet(
        {
            "local": {"nodes": 2},
            "models": {
                "classifier": {"path": "classifier.onnx"},
                "tiny_lm": {"path": "tiny_lm.onnx", "kind": "decoder"},
            },
        }
    ).config.fleet.name
    with FleetClient.connect(fleet=fleet) as client:  # another caller, as CLIENT is above
        client.infer("classifier", random_inputs("classifier"), priority="inline")

    table = cli_on_ray("status", "--fleet", fleet)
    assert "edge-0" in table.stdout and "completed 1" in table.stdout
    assert re.search(r"latency p50/p99 ms .* inline \d+/\d+ ", table.stdout), table.stdout

    too_long = cli_on_ray("generate", "tiny_lm", "--fleet", fleet, "--prompt-ids", *["1"] * 600)
    assert too_long.returncode == 2 and "does not fit the context" in too_long.stderr

    npy = tmp_path / "frame.npy"  # one unnamed array: the model's only input
    np.save(npy, random_inputs("classifier")["images"])
    one = cli_on_ray("infer", "classifier", "--fleet", fleet, "--input", str(npy))
    assert one.returncode == 0 and "logits: float32 [1, 10]" in one.stdout, one.stderr[-3000:]


CLIENT = """
from edgefleet import FleetClient
from edgefleet.modelgen import random_inputs

client = FleetClient.connect(fleet="{fleet}")
out = client.infer("classifier", random_inputs("classifier"), priority="inline")
print("logits", out["logits"].shape)
"""
