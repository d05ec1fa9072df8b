"""What the commands share: printing, connecting to a fleet, and the help's format."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from cluster.cli.interrupts import AfterThis
from edgefleet.errors import EdgeFleetError

if TYPE_CHECKING:
    from cluster.client import FleetClient

Subparsers = argparse._SubParsersAction  # what `add_subparsers` returns: commands go there


def err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def say(msg: str) -> None:
    print(msg, flush=True)


def connect(address: str | None, fleet: str, *, token_auth: bool = False) -> None:
    from cluster.deploy import connect_ray

    with AfterThis():
        connect_ray(address, fleet, token_auth=token_auth)


@contextlib.contextmanager
def fleet_client(args: argparse.Namespace) -> Iterator[FleetClient]:
    """A client of the running fleet ``args.fleet``, closed when the command is done:
    its last counters go to the router and its threads end before Ray shuts down."""
    from cluster.client import FleetClient

    connect(args.address, args.fleet)
    client = FleetClient.connect(fleet=args.fleet)
    try:
        yield client
    finally:
        client.close()


def add_fleet_options(parser: argparse.ArgumentParser) -> None:
    """``--fleet`` and ``--address``: which running fleet a command talks to."""
    parser.add_argument("--fleet", default="local", help="fleet name (default: %(default)s)")
    parser.add_argument("--address", help="Ray cluster address (default: the one `up` started)")


def priority(value: str | int) -> str | int:
    """``--priority``: a class name as given (the fleet knows its classes), or an integer
    priority, checked to be 0-10 as the arguments are read, before anything connects."""
    from edgefleet.priorities import resolve_priority

    if isinstance(value, int):
        return value
    try:
        number = int(value)
    except ValueError:
        return value
    try:
        return resolve_priority(number)
    except EdgeFleetError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class HelpFormatter(argparse.HelpFormatter):
    """Ends each option's help with its default, unless it says it already or has none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            not action.option_strings
            or any(action.default is v for v in (None, False, argparse.SUPPRESS))
            or "default" in text
        ):
            return action.help
        return f"{text} (default: %(default)s)"


class RawHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """:class:`HelpFormatter` that keeps the description's and epilog's lines."""


class Parser(argparse.ArgumentParser):
    """An argument parser whose help shows every option's default (sub-commands too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
