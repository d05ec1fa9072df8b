"""Shared fixtures: generated models (never downloaded) and one Ray cluster per session."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from edgefleet.modelgen import make_all

_fleet_ids = itertools.count()


def pytest_configure(config: pytest.Config) -> None:
    """Model caches (nodes' and stores') under a folder of this test process, not the
    user's: every Ray process and command the tests start inherits it."""
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="edgefleet-cache-")
    # A thread a test left behind that calls Ray after the test shut it down must fail,
    # not start a Ray of its own (Ray's auto-init), racing the next test's start of the
    # shared one ("ray.init twice").
    os.environ["RAY_ENABLE_AUTO_CONNECT"] = "0"
    import ray._private.auto_init_hook as auto_init

    auto_init.enable_auto_connect = False


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(os.environ.get("XDG_CACHE_HOME", ""), ignore_errors=True)


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("models")
    make_all(directory)
    return directory


@pytest.fixture(scope="session")
def _shared_ray() -> Iterator[None]:
    import ray

    yield
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def ray_session(_shared_ray: None) -> None:
    """One embedded Ray cluster on loopback shared by the integration tests (started
    again if a multi-node test shut it down to run its own)."""
    import ray

    from cluster.deploy import init_loopback_ray

    if not ray.is_initialized():
        init_loopback_ray(num_cpus=4)


@pytest.fixture
def make_fleet(ray_session: None, models_dir: Path) -> Iterator[Any]:
    """Deploy a fleet from a config dict on the session cluster; torn down after the test."""
    from cluster.client import FleetClient
    from edgefleet.config import parse_config

    clients: list[FleetClient] = []

    def make(config: dict[str, Any]) -> FleetClient:
        config = {"fleet": {"name": f"test-{next(_fleet_ids)}"}, **config}
        client = FleetClient.local(parse_config(config, models_dir))
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


@dataclass(frozen=True)
class Ran:
    """What a command run in this process did, named as ``subprocess.run`` names it."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Callable[..., Ran]:
    """Run an `edgefleet` command in this process: ``cli("validate", path)`` returns its
    exit status and what it printed. It is ``cluster.cli.main`` without the Ctrl-C
    handling a command installs in its own process; argparse's exits (``--help``, a bad
    option) are exit statuses too. Commands that reach a fleet take ``cli_on_ray``."""
    from cluster.cli import build_parser, run

    monkeypatch.setenv("COLUMNS", "80")  # help is wrapped as when a process's output is piped

    def call(*argv: str) -> Ran:
        capsys.readouterr()  # what came before is not the command's
        try:
            code = run(build_parser().parse_args(list(argv)))
        except SystemExit as exc:
            code = int(exc.code or 0)
        out = capsys.readouterr()
        return Ran(code, out.out, out.err)

    return call


@pytest.fixture
def cli_on_ray(
    cli: Callable[..., Ran], ray_session: None, monkeypatch: pytest.MonkeyPatch
) -> Callable[..., Ran]:
    """``cli`` for `status`, `infer` and `generate` on a fleet of the session's Ray
    cluster (``make_fleet``): they use this process's connection instead of making their
    own. Not for `up` and `down`, which start or stop Ray."""
    import cluster.deploy

    def on_session_ray(address: str | None, fleet: str, *, token_auth: bool = False) -> None:
        assert address is None, "in this process, commands reach fleets on the session's Ray"

    monkeypatch.setattr(cluster.deploy, "connect_ray", on_session_ray)
    return cli
