"""`edgefleet join`: the device side. This machine joins a fleet's Ray cluster as a node
(``ray start --address ... --block``), and joins again whenever it drops out."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator

from cluster.cli.common import RawHelpFormatter, Subparsers, err, say
from cluster.device import DEVICE_LABEL
from edgefleet.errors import InvalidInput
from edgefleet.providers import PROVIDERS_LABEL


def add_parser(sub: Subparsers) -> None:
    join = sub.add_parser(
        "join",
        help="join this machine to a fleet's Ray cluster as a device, again whenever it drops out",
        description=(
            "Run `ray start --address ADDRESS --block` with this device's labels and\n"
            "resources, and start it again whenever it exits (the head declared the device\n"
            "dead after a network outage, its raylet crashed, the head restarted), waiting\n"
            "longer after each failed attempt. Ctrl-C or SIGTERM stops what it started and\n"
            "exits 0."
        ),
        epilog="examples:\n"
        "  edgefleet join 10.0.0.1:6379 --labels zone=dock --resources '{\"cam-7\": 1}'\n"
        "  edgefleet join head.lan:6379 --device cam-7 --max-attempts 5   # for a script",
        formatter_class=RawHelpFormatter,
    )
    join.add_argument(
        "address",
        metavar="ADDRESS",
        type=_address,
        help="the Ray head's address, HOST:PORT (its `ray start --head --port`)",
    )
    join.add_argument(
        "--labels",
        type=_labels,
        metavar="K=V,...",
        help="Ray node labels of this machine, for the `labels:` of the fleet's nodes",
    )
    join.add_argument(
        "--device",
        type=_label_value,
        metavar="NAME",
        help=f"the device's name, given to Ray as label {DEVICE_LABEL}=NAME "
        "(default: the host name)",
    )
    join.add_argument(
        "--resources",
        type=_resources,
        metavar="JSON",
        help="Ray custom resources this machine offers, e.g. '{\"cam-7\": 1}'",
    )
    join.add_argument("--num-cpus", type=int, metavar="N", help="CPUs Ray may use (default: all)")
    join.add_argument(
        "--node-ip-address",
        metavar="IP",
        help="the address the cluster reaches this machine at (default: the one this "
        "machine reaches the head from)",
    )
    join.add_argument(
        "--temp-dir", metavar="DIR", help="Ray's folder on this machine (default: Ray's)"
    )
    join.add_argument(
        "--auth",
        choices=("token", "none"),
        default="token",
        help="the cluster's authentication (its fleet file's ray.auth); the token comes from "
        "RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token",
    )
    join.add_argument(
        "--max-attempts",
        type=int,
        metavar="N",
        help="give up (exit status 1) after N failed attempts in a row (default: never)",
    )
    join.add_argument(
        "--steady",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="an attempt that stayed up this long succeeded: the next waits as the first",
    )
    join.add_argument(
        "--max-delay",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="the longest wait between attempts (the first waits up to 1 s, each next twice as "
        "long)",
    )
    join.add_argument(
        "--stop-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="on Ctrl-C or SIGTERM, how long Ray gets to stop its processes before they are killed",
    )
    join.set_defaults(func=cmd_join)


def _address(text: str) -> str:
    host, _, port = text.split("://")[-1].rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT (e.g. 10.0.0.1:6379)")
    return f"{host}:{port}"


def _labels(text: str) -> dict[str, str]:
    from ray._private.label_utils import parse_node_labels_string, validate_node_labels

    try:
        labels = parse_node_labels_string(text)
        validate_node_labels(labels)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc} (e.g. zone=dock,camera=rgb)") from None
    return labels


def _label_value(text: str) -> str:
    from ray._private.label_utils import validate_label_value

    try:
        validate_label_value(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _resources(text: str) -> dict[str, float]:
    try:
        resources = json.loads(text)
    except ValueError:
        resources = None
    if not isinstance(resources, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and v >= 0
        for v in resources.values()
    ):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a JSON object of resource amounts (e.g. '{{\"cam-7\": 1}}')"
        )
    return {str(k): float(v) for k, v in resources.items()}


def _device_labels(args: argparse.Namespace) -> dict[str, str]:
    """The labels with the device's name: ``--device``, else a name the labels give,
    else the host name."""
    labels = dict(args.labels or {})
    given = labels.get(DEVICE_LABEL)
    if args.device and given and given != args.device:
        raise InvalidInput(
            f"--device {args.device} and --labels {DEVICE_LABEL}={given} name the device "
            "differently; give one of them"
        )
    name = args.device or given
    if name is None:
        name = socket.gethostname()
        try:
            _label_value(name)
        except argparse.ArgumentTypeError as exc:
            raise InvalidInput(
                f"the host name cannot name the device ({exc}); pass --device NAME"
            ) from None
    return {**labels, DEVICE_LABEL: name, PROVIDERS_LABEL: _providers()}


def _providers() -> str:
    """This device's execution providers (its ONNX Runtime build's), as the fleet's
    router reads them before it starts a strict model here."""
    from actors.engine import device_providers
    from edgefleet.providers import providers_label

    return providers_label(device_providers().providers)


@contextlib.contextmanager
def _stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """Within it, Ctrl-C (SIGINT) and SIGTERM set ``stop``; the handlers before are
    restored after."""
    caught = (signal.SIGINT, signal.SIGTERM)
    before = {s: signal.signal(s, lambda *_: stop.set()) for s in caught}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _stamped(out: Callable[[str], None]) -> Callable[[str], None]:
    """``out`` with each line led by the local time (a journal adds its own; a terminal
    or a log file has none)."""

    def write(msg: str) -> None:
        out(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {msg}")

    return write


def cmd_join(args: argparse.Namespace) -> int:
    from cluster.device import JoinSpec, RayStart, supervise
    from cluster.rejoin import Rejoin, RejoinPolicy
    from edgefleet.clock import MonotonicClock

    try:
        policy = RejoinPolicy(
            max_delay_s=args.max_delay,
            first_delay_s=min(1.0, args.max_delay),
            steady_s=args.steady,
            max_attempts=args.max_attempts,
        )
    except ValueError as exc:
        raise InvalidInput(f"--max-delay, --steady or --max-attempts: {exc}") from None
    spec = JoinSpec(
        address=args.address,
        labels=_device_labels(args),
        resources=args.resources or {},
        num_cpus=args.num_cpus,
        node_ip=args.node_ip_address,
        temp_dir=args.temp_dir,
        token_auth=args.auth == "token",
    )
    stop = threading.Event()
    with _stop_on_signals(stop):
        return supervise(
            RayStart(spec, stop_grace_s=args.stop_timeout),
            Rejoin(policy, MonotonicClock()),
            stop,
            joining=f"{spec.address} as device {spec.device}",
            note=_stamped(say),
            warn=_stamped(err),
        )
