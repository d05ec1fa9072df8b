"""edgefleet: priority-aware inference scheduling across a fleet of edge nodes.

``from edgefleet import FleetClient`` is the entry point; the shared vocabulary
(errors, requests, priorities, configuration) lives in the submodules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from edgefleet import errors
from edgefleet.messages import FleetStatus
from edgefleet.priorities import DEFAULT_PRIORITIES
from edgefleet.request import RequestState

if TYPE_CHECKING:
    from cluster.client import FleetClient
    from edgefleet.config import FleetConfig, load_config

__version__ = "0.1.0"
__all__ = [
    "DEFAULT_PRIORITIES",
    "FleetClient",
    "FleetConfig",
    "FleetStatus",
    "RequestState",
    "errors",
    "load_config",
]


def __getattr__(name: str) -> Any:
    # The client pulls in Ray; import it only when asked for, so that the
    # vocabulary stays cheap to import inside node processes and tools.
    if name == "FleetClient":
        from cluster.client import FleetClient

        return FleetClient
    # The configuration is built on the policies, which use the vocabulary: importing
    # it here, first, would make importing a policy first a circular import.
    if name in ("FleetConfig", "load_config"):
        from edgefleet import config

        return getattr(config, name)
    raise AttributeError(f"module 'edgefleet' has no attribute {name!r}")
