"""A Ray head on loopback that outlives the command which started it (``up --detach``).

Each fleet's head gets its own Ray temporary folder, so ``down`` can stop exactly the
processes ``up`` started, and nothing else on the machine. With ``ray.redis`` the head
keeps the cluster's state in a Redis of its own (Ray's GCS fault tolerance), so it can
be restarted (:func:`restart_head`) while the nodes on other machines keep serving.
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
from collections.abc import Iterable, Mapping
from pathlib import Path

import psutil

from edgefleet.errors import FleetNotRunning, FleetStartError

LOOPBACK = "127.0.0.1"
REDIS_READY_S = 10.0  # a redis-server that does not accept connections by then failed
RAY_START_TIMEOUT_S = 120.0
RAY_START_ATTEMPTS = 3  # starts of a Ray node that timed out on a busy machine, retried


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


def token_auth_at(address: str) -> bool:
    """Whether a head ``up --detach`` started (for any fleet) at ``address`` runs with
    token authentication: a cluster Ray's discovery finds may be another fleet's head."""
    for state in Path(tempfile.gettempdir()).glob("edgefleet-*/edgefleet.json"):
        fleet = state.parent.name.removeprefix("edgefleet-")
        if recorded_address(fleet) == address and recorded_token_auth(fleet):
            return True
    return False


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
    fleet: str,
    num_cpus: int,
    *,
    dashboard_port: int | None = None,
    token_auth: bool = True,
    redis: bool = False,
    env: Mapping[str, str] | None = None,
) -> str:
    """Start a Ray head bound to 127.0.0.1 for ``fleet``; returns its address. With
    ``dashboard_port`` it also serves Ray's dashboard and job API there (loopback).
    With ``redis`` it first starts a ``redis-server`` on loopback (its data under
    :func:`head_dir`) and keeps the cluster's state there (Ray's GCS fault tolerance).
    ``env``: more environment for the head's processes (Ray's ``RAY_*`` settings, such
    as its health checks). What it started is recorded for :func:`restart_head` (which
    starts it with the same settings) and :func:`stop_head`; when the head does not
    start, the Redis it started is stopped."""
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
    settings = {**(env or {}), "RAY_AUTH_MODE": "token" if token_auth else "disabled"}
    address = f"{LOOPBACK}:{port}"
    state: dict[str, object] = {"fleet": fleet, "address": address, "token_auth": token_auth}
    if redis:
        state["redis"] = started = _start_redis(directory)
        settings["RAY_REDIS_ADDRESS"] = f"{LOOPBACK}:{started['port']}"
        settings["RAY_external_storage_namespace"] = fleet
    state["head"] = {"cmd": cmd, "env": settings}
    # Recorded before Ray starts: `down` finds the Redis even if what follows is cut short.
    _state_file(fleet).write_text(json.dumps(state))
    try:
        _run_head(fleet, cmd, settings)
    except BaseException:
        _stop_redis(state)
        _state_file(fleet).unlink(missing_ok=True)
        raise
    return address


def restart_head(fleet: str, grace_s: float = 2.0) -> str:
    """Start ``fleet``'s head again with the settings it was started with (the same
    port, folder and Redis), after it crashed or to replace it; returns its address.
    Whatever is left of the old head is stopped first; its Redis is kept.

    With Redis (``ray.redis``) the new head takes over the cluster's state: raylets on
    other machines reconnect (they wait ``RAY_gcs_rpc_server_reconnect_timeout_s``, 60 s
    by default), the actors on them never stopped, and those of the old head (the
    router) are started again. Without, the new head is a new cluster that refuses
    every raylet of the old one. Raises FleetNotRunning when no head was recorded for
    ``fleet``, FleetStartError when its Redis is gone or Ray does not start."""
    state = _recorded(fleet)
    head = state.get("head")
    if not isinstance(head, dict):
        raise FleetNotRunning(
            f"fleet {fleet!r}: no Ray head started by `edgefleet up --detach` is recorded"
        )
    if "redis" in state and _redis_process(state) is None:
        raise FleetStartError(
            f"fleet {fleet!r}: the Redis that held its cluster's state is gone; stop what is "
            f"left with `edgefleet down --fleet {fleet}` and start it again with `up`"
        )
    _stop_processes(fleet, grace_s)
    # `ray start --head` refuses an address its folder records while any process here
    # names it: raylets on this machine waiting for the head to come back do.
    (head_dir(fleet) / "ray_current_cluster").unlink(missing_ok=True)
    _run_head(fleet, list(head["cmd"]), dict(head["env"]))
    return str(state["address"])


def ray_start_timed_out(said: str) -> bool:
    """Whether Ray gave up starting a node because its raylet did not register within
    Ray's fixed 30 s: on a busy machine it does later, so the start is worth a retry."""
    return "timed out during startup" in said


def _run_head(fleet: str, cmd: list[str], settings: dict[str, str]) -> None:
    # Jobs submitted to the head run `edgefleet` (and `python`) from this environment.
    path = os.pathsep.join([str(Path(cmd[0]).parent), os.environ.get("PATH", "")])
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PATH=path, **settings)
    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            result = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=RAY_START_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            raise FleetStartError(
                f"`ray start --head` did not finish within {RAY_START_TIMEOUT_S:g} s"
            ) from None
        if result.returncode == 0:
            return
        said = result.stderr.strip()
        if attempt == RAY_START_ATTEMPTS or not ray_start_timed_out(said):
            raise FleetStartError(f"could not start a Ray head: {said[-2000:]}")
        _stop_processes(fleet, grace_s=2.0)  # what the attempt started, before the next
        (head_dir(fleet) / "ray_current_cluster").unlink(missing_ok=True)


def _start_redis(directory: Path) -> dict[str, int]:
    """A ``redis-server`` on 127.0.0.1 and a free port, its data in ``directory/redis``
    (appended to a log on disk, so a restarted Redis has it too); its pid and port."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise FleetStartError(
            "ray.redis (up --redis) needs redis-server, which is not installed: "
            "`apt-get install redis-server` (Debian, Ubuntu)"
        )
    data = directory / "redis"
    data.mkdir(exist_ok=True)
    pidfile = data / "redis.pid"
    pidfile.unlink(missing_ok=True)
    port = _free_port()
    cmd = [exe, "--bind", LOOPBACK, "--port", str(port), "--dir", str(data)]
    cmd += ["--appendonly", "yes", "--logfile", str(data / "redis.log")]
    cmd += ["--daemonize", "yes", "--pidfile", str(pidfile)]
    # Daemonized, as Ray's own processes: it outlives `up`, and `down` stops it by pid.
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=REDIS_READY_S)
    deadline = time.monotonic() + REDIS_READY_S
    while result.returncode == 0 and time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            started = {"pid": int(pidfile.read_text()), "port": port}
            if reachable(f"{LOOPBACK}:{port}", timeout_s=1.0):
                return started
        time.sleep(0.05)
    with contextlib.suppress(OSError, ValueError, psutil.Error):
        psutil.Process(int(pidfile.read_text())).kill()
    log = data / "redis.log"
    said = log.read_text().strip()[-1000:] if log.exists() else result.stderr.strip()
    raise FleetStartError(f"redis-server did not start on {LOOPBACK}:{port}: {said}")


def _redis_process(state: dict[str, object]) -> psutil.Process | None:
    """The recorded Redis, if it still runs (and its pid is not another process's now)."""
    redis = state.get("redis")
    if not isinstance(redis, dict):
        return None
    try:
        proc = psutil.Process(int(redis["pid"]))
        if proc.name() == "redis-server" and f":{redis['port']}" in " ".join(proc.cmdline()):
            return None if _gone(proc) else proc
    except (psutil.Error, KeyError, TypeError, ValueError):
        pass
    return None


def _stop_redis(state: dict[str, object], grace_s: float = 2.0) -> int:
    proc = _redis_process(state)
    if proc is None:
        return 0
    _end([proc], grace_s)
    return 1


def head_processes(fleet: str) -> list[psutil.Process]:
    """Processes of the head ``up`` started for ``fleet``: those whose command line
    names its folder or its address, and their descendants (agents and workers
    rename themselves)."""
    markers = [str(head_dir(fleet))]
    address = recorded_address(fleet)
    if address is not None:  # Ray's client server names only the head's address
        markers.append(f"--address={address}")
    redis = _redis_process(_recorded(fleet))  # its data lives in the folder too
    return processes_naming(markers, skip=() if redis is None else (redis.pid,))


def processes_naming(markers: Iterable[str], skip: Iterable[int] = ()) -> list[psutil.Process]:
    """Processes whose command line names one of ``markers`` (a Ray folder, say), and
    their descendants, but for the pids in ``skip``."""
    markers, skip = list(markers), set(skip)
    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline"]):
        if proc.pid in skip:
            continue
        try:
            if any(m in part for part in proc.info["cmdline"] or () for m in markers):
                found[proc.pid] = proc
                found.update((c.pid, c) for c in proc.children(recursive=True))
        except psutil.Error:
            continue
    return list(found.values())


def kill_head(fleet: str) -> list[int]:
    """The head's machine dies: SIGKILL ``fleet``'s GCS and head raylet at once (the
    head's other processes follow its raylet, or :func:`restart_head` stops them). Its
    Redis lives on. Returns the pids killed."""
    doomed = []
    for proc in head_processes(fleet):
        with contextlib.suppress(psutil.Error):
            if proc.name() in ("gcs_server", "raylet"):
                proc.kill()
                doomed.append(proc.pid)
    return doomed


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


def children() -> set[int]:
    """The pids of the processes this one started, and theirs."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


def stop_children(grace_s: float = 1.0, *, spare: Iterable[int] = ()) -> int:
    """Stop every process this one started, and theirs, but those in ``spare``; returns
    how many there were. For a command whose embedded Ray start failed or was
    interrupted: Ray had no handle yet to stop them by, and its agents would outlive
    the command."""
    kept = set(spare)
    procs = [p for p in psutil.Process().children(recursive=True) if p.pid not in kept]
    _end(procs, grace_s)
    return len(procs)


def stop_head(fleet: str, grace_s: float = 2.0) -> int:
    """Stop the processes of ``fleet``'s head, then its Redis, and remove its folder;
    returns how many processes there were. Whatever outlives ``grace_s`` after SIGTERM
    is killed."""
    count = _stop_processes(fleet, grace_s)
    count += _stop_redis(_recorded(fleet), grace_s)
    shutil.rmtree(head_dir(fleet), ignore_errors=True)
    return count


def _stop_processes(fleet: str, grace_s: float) -> int:
    """Stop the Ray processes of ``fleet``'s head in Ray's own order (``ray stop``): the
    raylet (its workers go with it), then the other processes, the GCS last; stopped at
    once, they wait on each other for many seconds."""
    procs = [p for p in head_processes(fleet) if p.pid != os.getpid()]
    names: dict[int, str] = {}
    for p in procs:
        with contextlib.suppress(psutil.Error):
            names[p.pid] = p.name()
    first = [p for p in procs if names.get(p.pid) == "raylet"]
    last = [p for p in procs if names.get(p.pid) == "gcs_server"]
    for group in (first, [p for p in procs if p not in first and p not in last], last):
        _end(group, grace_s)
    return len(procs)
