"""A fleet's lifecycle from the command line, run as a user runs it: commands for a
fleet that is not running answer at once, `up` refuses a fleet that runs and stops
what it started when it fails, `down` cleans up after a head that died, and Ctrl-C
ends every command promptly without a traceback. A command that never connects to
Ray, failing first, runs in this process (``cli``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from cluster.head import _free_port, head_dir, head_processes
from edgefleet.modelgen import random_inputs
from tests.integration.test_cli import (
    ANSWER_S,
    START_S,
    STOP_S,
    Running,
    _fleet_processes,
    edgefleet,
)

pytestmark = pytest.mark.integration


def _timed(run: Callable[..., Any], *args: str) -> tuple[Any, float]:
    start = time.monotonic()
    result = run(*args)
    return result, time.monotonic() - start


in_subprocess = partial(edgefleet, timeout=120)


def _assert_plain(stderr: str) -> None:
    assert "Traceback" not in stderr and "\x1b[" not in stderr, stderr[-3000:]


def no_ray_here() -> dict[str, str]:
    """Environment for a command that should find no fleet: Ray's discovery ends at an
    address where nothing listens, not at whichever Ray runs on this machine meanwhile
    (another test's, which may be stopping: connecting to it can take minutes). Where
    the command finds a record of the fleet, it still uses that."""
    return {"RAY_ADDRESS": f"127.0.0.1:{_free_port()}"}


def _write_config(path: Path, fleet: str, extra: str = "") -> Path:
    path.write_text(
        f"fleet: {{name: {fleet}}}\n"
        "models:\n  classifier: {path: models/classifier.onnx}\n"
        "  tiny_lm: {path: models/tiny_lm.onnx, kind: decoder}\n" + extra
    )
    return path


def test_commands_for_a_fleet_that_is_not_running_answer_at_once(tmp_path, cli):
    np.savez(tmp_path / "frame.npz", **random_inputs("classifier"))
    infer = ["infer", "classifier", "--input", str(tmp_path / "frame.npz")]
    generate = ["generate", "tiny_lm", "--prompt-ids", "1", "2"]

    # A fleet nobody started: nothing recorded for it (and maybe no Ray at all). In a
    # subprocess: the command may find a Ray on this machine and connect to it.
    never = f"never{os.getpid()}"
    for command in (["status"], ["down"], infer, generate):
        result, took = _timed(in_subprocess, *command, "--fleet", never)
        assert result.returncode == 2, (command, result.stderr[-3000:])
        assert never in result.stderr and "edgefleet up" in result.stderr, result.stderr
        assert command != ["down"] or "nothing to stop" in result.stderr, result.stderr
        _assert_plain(result.stderr)
        assert took < ANSWER_S, (command, took)

    # An address where nothing listens.
    nowhere = f"127.0.0.1:{_free_port()}"
    for command in (["status"], generate):
        result, took = _timed(cli, *command, "--fleet", never, "--address", nowhere)
        assert result.returncode == 2, (command, result.stderr[-3000:])
        assert f"no Ray cluster answers at {nowhere}" in result.stderr, result.stderr
        _assert_plain(result.stderr)
        assert took < ANSWER_S, (command, took)

    # A head `up --detach` recorded, which is gone (Ray itself retries it for a minute).
    stale = f"stale{os.getpid()}"
    state = {"fleet": stale, "address": f"127.0.0.1:{_free_port()}", "token_auth": True}
    head_dir(stale).mkdir(parents=True, exist_ok=True)
    (head_dir(stale) / "edgefleet.json").write_text(json.dumps(state))
    try:
        for command in (["status"], infer, generate):
            result, took = _timed(cli, *command, "--fleet", stale)
            assert result.returncode == 2, (command, result.stderr[-3000:])
            assert f"fleet {stale!r} is not running" in result.stderr, result.stderr
            assert f"`edgefleet down --fleet {stale}` cleans up" in result.stderr
            _assert_plain(result.stderr)
            assert took < ANSWER_S, (command, took)
        down, took = _timed(cli, "down", "--fleet", stale)
        assert down.returncode == 0, down.stderr[-3000:]
        assert "was gone; cleaned up" in down.stdout and str(head_dir(stale)) in down.stdout
        assert not head_dir(stale).exists() and took < ANSWER_S
        again = edgefleet("down", "--fleet", stale, env=no_ray_here())
        assert again.returncode == 2 and "nothing to stop" in again.stderr
    finally:
        shutil.rmtree(head_dir(stale), ignore_errors=True)


def test_down_cleans_up_after_a_head_that_died(tmp_path, cli):
    fleet = f"dead{os.getpid()}"
    config = _write_config(tmp_path / "fleet.yaml", fleet)
    try:
        up = edgefleet("up", str(config), "--detach")
        assert up.returncode == 0, up.stderr[-3000:]
        (gcs,) = [p for p in head_processes(fleet) if p.name() == "gcs_server"]
        gcs.kill()
        gcs.wait(30)

        status, took = _timed(cli, "status", "--fleet", fleet)
        assert status.returncode == 2, status.stderr[-3000:]
        assert f"fleet {fleet!r} is not running" in status.stderr
        assert f"`edgefleet down --fleet {fleet}` cleans up" in status.stderr
        _assert_plain(status.stderr)
        assert took < ANSWER_S, took
    finally:
        down, took = _timed(cli, "down", "--fleet", fleet)
    assert down.returncode == 0, down.stderr[-3000:]
    assert "was gone; cleaned up" in down.stdout, down.stdout
    assert _fleet_processes(str(head_dir(fleet))) == [] and not head_dir(fleet).exists()
    assert took < ANSWER_S, took
    again = edgefleet("down", "--fleet", fleet, env=no_ray_here())
    assert again.returncode == 2 and "nothing to stop" in again.stderr


def test_a_failed_up_says_why_in_one_line_and_stops_what_it_started(tmp_path):
    fleet = f"fail{os.getpid()}"
    # The model loads, but not within the node's memory budget: the node fails to start.
    config = _write_config(
        tmp_path / "fleet.yaml",
        fleet,
        "node_defaults: {memory_budget_mb: 0.5}\nlocal: {nodes: 2}\n",
    )
    try:
        up = edgefleet("up", str(config), "--detach")
        assert up.returncode == 2, up.stdout[-3000:]
        assert "started a Ray head" in up.stdout and "stopped the Ray head it started" in up.stdout
        (line,) = up.stderr.strip().splitlines()
        assert line.startswith("error: node edge-") and "could not start: model " in line, line
        assert "more than the node's memory budget" in line, line
        _assert_plain(up.stderr)
        down = edgefleet("down", "--fleet", fleet, env=no_ray_here())
        assert down.returncode == 2 and "nothing to stop" in down.stderr, down.stderr[-3000:]
        assert _fleet_processes(str(head_dir(fleet))) == [] and not head_dir(fleet).exists()

        # A model file that is not ONNX: refused before anything starts.
        (tmp_path / "models" / "classifier.onnx").write_text("not a model\n")
        bad = edgefleet("up", str(config), "--detach")
        assert bad.returncode == 2 and "classifier" in bad.stderr, bad.stderr[-3000:]
        _assert_plain(bad.stderr)
        assert _fleet_processes(str(head_dir(fleet))) == [] and not head_dir(fleet).exists()
    finally:
        edgefleet("down", "--fleet", fleet, env=no_ray_here())


def test_up_says_which_nodes_wait_for_what_and_gives_up(tmp_path):
    fleet = f"unplaced{os.getpid()}"
    config = tmp_path / "fleet.yaml"
    config.write_text(
        f"fleet: {{name: {fleet}}}\n"
        "models:\n  classifier: {path: models/classifier.onnx}\n"
        "nodes:\n  - {name: cam-0, resources: {no_such_device: 1}}\n"
        "ray: {start_timeout_s: 300}\n"
    )
    up = Running("up", str(config), "--start-timeout", "6")
    try:
        up.proc.wait(START_S)
    finally:
        up.kill()
    assert up.proc.returncode == 2, up.err[-3000:]
    assert re.search(r"still starting after \d+ s \(giving up at 6 s\)", up.out), up.out
    assert "node cam-0 asks for resources no_such_device=1 (no machine offers" in up.out
    (line,) = up.err.strip().splitlines()
    assert line.startswith("error: not started within 6 s: node cam-0 asks for resources "), line
    assert "no_such_device" in line and "start_timeout_s" in line
    # The embedded Ray starts without warnings nobody can act on.
    assert "Token authentication is enabled" not in up.err


def test_ctrl_c_while_up_starts_and_while_it_serves(tmp_path):
    config = _write_config(tmp_path / "fleet.yaml", f"fg{os.getpid()}")

    starting = Running("up", str(config))
    try:
        starting.wait_for("starting an embedded Ray cluster")
        time.sleep(1.0)  # Ray's processes are starting
        started = psutil.Process(starting.proc.pid).children(recursive=True)
        took = starting.interrupt()
    finally:
        starting.kill()
    assert starting.proc.returncode == 130, starting.err[-3000:]
    assert starting.err.strip() == "interrupted", starting.err[-3000:]
    assert took < STOP_S, took
    deadline = time.monotonic() + 30  # the processes it started go with it
    while any(_alive(p) for p in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p.pid for p in started if _alive(p)]

    serving = Running("up", str(config), "--interval", "0.5")
    try:
        serving.wait_for("completed 0")
        took = serving.interrupt()
    finally:
        serving.kill()
    assert serving.proc.returncode == 0, serving.err[-3000:]
    assert "stopping the fleet" in serving.out
    # No Ray warning a user cannot act on (Ray's default of token authentication).
    assert "Token authentication is enabled" not in serving.err, serving.err[-3000:]
    assert "WARNING" not in serving.err, serving.err[-3000:]
    _assert_plain(serving.err)
    assert took < STOP_S, took


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
