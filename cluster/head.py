"""A Ray head on loopback that outlives the command which started it (``up --detach``).

Each fleet's head gets its own Ray temporary folder, so ``down`` can stop exactly the
processes ``up`` started, and nothing else on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from edgefleet.errors import FleetStartError

LOOPBACK = "127.0.0.1"


def head_dir(fleet: str) -> Path:
    # Short on purpose: Ray puts Unix sockets under it, and socket paths are limited.
    return Path(tempfile.gettempdir()) / f"edgefleet-{fleet}"


def _state_file(fleet: str) -> Path:
    return head_dir(fleet) / "edgefleet.json"


def _recorded(fleet: str) -> dict[str, object]:
    try:
        state = json.loads(_state_file(fleet).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def recorded_address(fleet: str) -> str | None:
    """The address of the head ``up --detach`` started for ``fleet``, if any."""
    address = _recorded(fleet).get("address")
    return str(address) if address else None


def recorded_token_auth(fleet: str) -> bool:
    """Whether that head runs with token authentication (it does unless told not to)."""
    return bool(_recorded(fleet).get("token_auth", True))


def reachable(address: str, timeout_s: float = 2.0) -> bool:
    """Whether anything accepts a TCP connection at a Ray address (``host:port``, maybe
    with a scheme such as ``ray://``): a quick answer before Ray's own connect, which
    retries a dead address for a minute. An address without a port counts as reachable."""
    host, _, port = address.split("://")[-1].rstrip("/").rpartition(":")
    if not host or not port.isdigit():
        return True
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def start_head(
    fleet: str, num_cpus: int, *, dashboard_port: int | None = None, token_auth: bool = True
) -> str:
    """Start a Ray head bound to 127.0.0.1 for ``fleet``; returns its address. With
    ``dashboard_port`` it also serves Ray's dashboard and job API there (loopback)."""
    directory = head_dir(fleet)
    directory.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    ray_cli = Path(sys.executable).with_name("ray")
    cmd = [
        str(ray_cli),
        "start",
        "--head",
        f"--port={port}",
        f"--node-ip-address={LOOPBACK}",
        *(
            ["--include-dashboard=false"]
            if dashboard_port is None
            else [
                "--include-dashboard=true",
                f"--dashboard-host={LOOPBACK}",
                f"--dashboard-port={dashboard_port}",
            ]
        ),
        f"--ray-client-server-port={_free_port()}",
        # Free ports, not Ray's fixed default: another Ray on this machine (an embedded
        # fleet, another head) may hold it, and the head dies with its agent.
        f"--dashboard-agent-listen-port={_free_port()}",
        f"--num-cpus={num_cpus}",
        f"--temp-dir={directory}",
        "--disable-usage-stats",
    ]
    # Loopback only, and token authentication on unless the config turns it off (the
    # token lives in ~/.ray/auth_token; clients here find it once RAY_AUTH_MODE=token).
    # Jobs submitted to it run `edgefleet` (and `python`) from this environment.
    path = os.pathsep.join([str(ray_cli.parent), os.environ.get("PATH", "")])
    env = dict(
        os.environ,
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_AUTH_MODE="token" if token_auth else "disabled",
        PATH=path,
    )
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    if result.returncode != 0:
        raise FleetStartError(f"could not start a Ray head: {result.stderr.strip()[-2000:]}")
    address = f"{LOOPBACK}:{port}"
    state = {"fleet": fleet, "address": address, "token_auth": token_auth}
    _state_file(fleet).write_text(json.dumps(state))
    return address


def head_processes(fleet: str) -> list[psutil.Process]:
    """Processes of the head ``up`` started for ``fleet``: those whose command line
    names its folder or its address, and their descendants (agents and workers
    rename themselves)."""
    markers = [str(head_dir(fleet))]
    address = recorded_address(fleet)
    if address is not None:  # Ray's client server names only the head's address
        markers.append(f"--address={address}")
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(m in part for part in proc.info["cmdline"] or () for m in markers):
                found[proc.pid] = proc
                found.update((c.pid, c) for c in proc.children(recursive=True))
        except psutil.Error:
            continue
    return list(found.values())


def _gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _end(procs: list[psutil.Process], grace_s: float) -> None:
    """Terminate ``procs``, wait up to ``grace_s`` for them to exit, kill the rest."""
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    deadline = time.monotonic() + grace_s
    while (alive := [p for p in procs if not _gone(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    deadline = time.monotonic() + grace_s
    while any(not _gone(p) for p in alive) and time.monotonic() < deadline:
        time.sleep(0.05)


def stop_children(grace_s: float = 1.0) -> int:
    """Stop every process this one started, and theirs; returns how many there were.
    For a command whose embedded Ray start was interrupted: Ray had no handle yet to
    stop them by, and its agents would outlive the command."""
    procs = psutil.Process().children(recursive=True)
    _end(procs, grace_s)
    return len(procs)


def stop_head(fleet: str, grace_s: float = 2.0) -> int:
    """Stop the processes of ``fleet``'s head and remove its folder; returns how many
    processes there were. In Ray's own order (``ray stop``): the raylet (its workers go
    with it), then the other processes, the GCS last; stopped at once, they wait on each
    other for many seconds. Whatever outlives ``grace_s`` after SIGTERM is killed."""
    procs = [p for p in head_processes(fleet) if p.pid != os.getpid()]
    names: dict[int, str] = {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            names[p.pid] = p.name()
    first = [p for p in procs if names.get(p.pid) == "raylet"]
    last = [p for p in procs if names.get(p.pid) == "gcs_server"]
    for group in (first, [p for p in procs if p not in first and p not in last], last):
        _end(group, grace_s)
    shutil.rmtree(head_dir(fleet), ignore_errors=True)
    return len(procs)
