"""Shared fixtures: generated models (never downloaded) and one Ray cluster per session."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edgefleet.modelgen import make_all

_fleet_ids = itertools.count()


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
