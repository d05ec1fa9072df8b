"""`edgefleet drive`: a simulator workload sent open loop to a live fleet, and a report in
the simulator's format, to put beside what `edgefleet simulate` predicts for it.

The arrivals are the ones `edgefleet simulate CONFIG --workload W.yaml` generates (the
same workload, seed and node count: CONFIG's nodes), each sent at its time whatever the
answers do (``cluster.traffic.OpenLoop``). Each request's latency runs from its
arrival (when it was due, so a driver that falls behind does not hide a slow fleet) to
its answer, as the simulator measures it. A generation is streamed to its end (its
prompt: ``cluster.traffic.prompt_ids``, in its chat session when it has one) and counts
as answered at its last token.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.cli.common import RawHelpFormatter, Subparsers, connect, err, say
from cluster.cli.interrupts import StopAtOnce
from edgefleet.errors import ConfigError, EdgeFleetError

if TYPE_CHECKING:
    import concurrent.futures as cf

    import numpy as np

    from cluster.client import FleetClient
    from cluster.traffic import Answer
    from edgefleet.config import FleetConfig
    from edgefleet.messages import Reply
    from sim.report import RunResult
    from sim.workload import Arrival, Workload

REQUEST_TIMEOUT_S = 60.0  # a request not answered by then is answered TimedOut
DRAIN_S = 5.0  # after Ctrl-C, the answers already out may take this long to come
FINISH_MARGIN_S = 30.0  # past the last request's timeout: stop waiting whatever happens
STATUS_EVERY_S = 1.0  # queue samples for the report
STATUS_TIMEOUT_S = 5.0
INTERRUPTED_STOP_S = 20.0  # after Ctrl-C and the report, stopping the fleet may take this
CONTROL_TIMEOUT_S = 30.0  # a call on the traffic loop (start, stop) that must not hang
GENERATION_THREADS = 64  # generations streamed at once (each holds a thread to its end)


def add_parser(sub: Subparsers) -> None:
    drive = sub.add_parser(
        "drive",
        help="send a simulator workload to a live fleet, open loop, and report as the "
        "simulator does",
        description="Send the arrivals `edgefleet simulate CONFIG --workload W.yaml` would\n"
        "simulate (the same workload, seed and node count) to a live fleet, each at its\n"
        "time, and report per priority class as the simulator does: compare the two side\n"
        "by side. Without --fleet or --address it starts CONFIG's fleet on an embedded\n"
        "Ray on 127.0.0.1 and stops it at the end. A generation (a class with generate:)\n"
        "is streamed to its last token: its latency runs to its end. Ctrl-C stops\n"
        "sending, waits a few seconds for the answers already out and reports what it\n"
        "has (exit status 130).",
        epilog="examples:\n"
        "  edgefleet drive configs/local.yaml --workload configs/sim/steady.yaml "
        "--requests 2000\n"
        "  edgefleet drive configs/local.yaml --workload configs/sim/bursts.yaml "
        "--fleet local --record calls/ --out live-report\n"
        "  edgefleet simulate configs/local.yaml --workload configs/sim/bursts.yaml "
        "--costs calls/ --out sim-report",
        formatter_class=RawHelpFormatter,
    )
    drive.add_argument(
        "config",
        metavar="CONFIG",
        help="fleet YAML: the embedded fleet to start, and the node count the arrivals "
        "are generated for (as `simulate` without --nodes)",
    )
    drive.add_argument("--workload", required=True, help="workload YAML (see configs/sim/)")
    drive.add_argument(
        "--fleet",
        metavar="NAME",
        help="drive this running fleet (default: start CONFIG's fleet on an embedded Ray, "
        "and stop it at the end)",
    )
    drive.add_argument(
        "--address",
        help="Ray cluster address of the running fleet (--fleet, default CONFIG's "
        "fleet.name; default address: the one `up` started)",
    )
    drive.add_argument(
        "--record",
        metavar="DIR",
        help="keep the call record of this run in DIR (router.record_dir), for "
        "`edgefleet simulate ... --costs DIR` (default: none)",
    )
    drive.add_argument("--requests", type=_positive, help="stop after this many arrivals")
    drive.add_argument("--seed", type=int, help="default: the workload's")
    drive.add_argument(
        "--out",
        metavar="DIR",
        help="also write the report there as `simulate` does: report.md and its plots "
        "(default: print it only)",
    )
    drive.set_defaults(func=cmd_drive)


def _positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def cmd_drive(args: argparse.Namespace) -> int:
    from edgefleet.config import load_config
    from sim.workload import load_workload

    config = _one_line(load_config, args.config)
    workload = _one_line(load_workload, args.workload)
    for note in _ignored(workload):
        err(f"note: {note}")
    record = None if args.record is None else Path(args.record).resolve()
    if args.fleet is None and args.address is None:
        return _on_embedded_fleet(args, config, workload, record)
    return _on_running_fleet(args, config, workload, record)


# ------------------------------------------------------------------ the fleet to drive


def _on_embedded_fleet(
    args: argparse.Namespace, config: FleetConfig, workload: Workload, record: Path | None
) -> int:
    """Start CONFIG's fleet on an embedded Ray (nothing starts when the workload does
    not fit it), drive it, stop it."""
    from cluster.client import FleetClient
    from edgefleet.modelgen import make_missing_models

    config = _recording(config, record)
    plan = _plan(args, config, config, workload)  # before anything starts
    make_missing_models(config, err)
    plan.build_inputs(config)
    with StopAtOnce():  # starting Ray: Ctrl-C stops what it started, at once
        client = FleetClient.local(config, progress=err)
    return _drive_and_close(args, client, plan, record, owns_fleet=True)


def _on_running_fleet(
    args: argparse.Namespace, config: FleetConfig, workload: Workload, record: Path | None
) -> int:
    """Drive the running fleet ``--fleet`` (default: CONFIG's name) with a client of its
    own: closing it leaves the fleet running."""
    from cluster.client import FleetClient
    from cluster.deploy import find_fleet, node_handles

    name = args.fleet or config.fleet.name
    # FleetNotRunning at once when nothing answers; CONFIG says how its cluster
    # authenticates (a cluster Ray finds by itself is spoken to that way, as `up` does)
    connect(args.address, name, token_auth=config.ray.auth == "token")
    router, deployed = find_fleet(name)  # bounded: FleetNotRunning past CONTROL_TIMEOUT_S
    plan = _plan(args, config, deployed, workload)
    plan.build_inputs(deployed)
    client = FleetClient(_recording(deployed, record), router, node_handles(deployed))
    return _drive_and_close(args, client, plan, record, owns_fleet=False)


def _recording(config: FleetConfig, record: Path | None) -> FleetConfig:
    """``config`` with its callers keeping a call record in ``record`` (if given)."""
    if record is None:
        return config
    router = config.router.model_copy(update={"record_dir": record})
    return config.model_copy(update={"router": router})


# ---------------------------------------------------------------------- the arrivals


@dataclass
class _Plan:
    """What to send: the arrivals and the inputs of each (model, rows)."""

    arrivals: list[Arrival]
    priorities: dict[str, int]
    nodes: int  # the node count the arrivals were generated for
    seed: int
    inputs: dict[tuple[str, int], Mapping[str, np.ndarray]] = field(default_factory=dict)

    def build_inputs(self, config: FleetConfig) -> None:
        inferences = {(a.model, a.rows) for a in self.arrivals if a.prompt_tokens == 0}
        for model, rows in sorted(inferences):
            self.inputs[(model, rows)] = _inputs(config, model, rows)

    def inputs_of(self, arrival: Arrival) -> Mapping[str, np.ndarray]:
        return self.inputs[(arrival.model, arrival.rows)]


def _plan(
    args: argparse.Namespace, config: FleetConfig, fleet: FleetConfig, workload: Workload
) -> _Plan:
    """The arrivals `simulate` would generate for CONFIG (``config``), resolved against
    the fleet to drive (``fleet``); ConfigError on one line when the workload asks for a
    model or priority class the fleet does not have."""
    served = sorted(fleet.served_models())
    _one_line(workload.check, fleet.priorities, served, served)
    for i, c in enumerate(workload.mix or []):
        decoder = fleet.models[c.model].kind == "decoder"
        if decoder != (c.generate is not None):
            field = f"mix.{i}.generate" if c.generate is not None else f"mix.{i}.model"
            raise ConfigError(
                f"workload {args.workload}: {field}{_line(workload, field)}: {c.model!r} is "
                + (
                    "a decoder: its class of traffic needs generate: {prompt_tokens: N, "
                    "max_new_tokens: M}"
                    if decoder
                    else "not a decoder: it takes inferences, not generations"
                )
            )
    seed = workload.seed if args.seed is None else args.seed
    nodes = len(config.node_specs())
    arrivals = _one_line(
        lambda: list(
            workload.arrivals(
                random.Random(seed),
                nodes=nodes,
                requests=args.requests,
                priorities=fleet.priorities,
            )
        )
    )
    return _Plan(arrivals, dict(fleet.priorities), nodes, seed)


def _ignored(workload: Workload) -> Iterator[str]:
    """What of the workload a live run leaves out: what happens to the nodes."""
    events = workload.fleet_events
    if events.node_failures is not None or events.lifecycle or workload.churn is not None:
        yield (
            "the workload's events: and churn: are for the simulator; nothing is done to "
            "the live fleet's nodes"
        )


def _line(workload: Workload, path: str) -> str:
    from edgefleet.config import _where

    return _where(workload._lines, path)


def _inputs(config: FleetConfig, model: str, rows: int) -> Mapping[str, np.ndarray]:
    """Inputs of ``rows`` rows for ``model``: a built-in model's own, else those its node
    measures its costs with at warm-up (``synthetic_inputs``: shaped as its file says)."""
    import numpy as np

    from actors.models import synthetic_inputs
    from cluster.modelfiles import model_signature
    from edgefleet.modelgen import builtin_model

    spec = config.models[model]
    builtin = builtin_model(spec.path)
    try:
        if builtin is not None:
            return builtin.inputs(np.random.default_rng(0), rows, 32, 32)
        sig = model_signature(model, spec)
    except (ValueError, EdgeFleetError) as exc:
        raise ConfigError(
            f"cannot make inputs of {rows} row(s) for model {model!r}: {exc}"
        ) from None
    if rows > 1 and not sig.batchable:
        raise ConfigError(
            f"the workload sends {rows}-row requests to model {model!r}, which takes one row"
        )
    return synthetic_inputs(sig, rows)


def _one_line(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its ConfigError on one line (each problem after the first line
    joined with "; ")."""
    try:
        return fn(*args)
    except ConfigError as exc:
        head, *rest = (part.strip() for part in str(exc).splitlines() if part.strip())
        text = head + (" " + "; ".join(rest) if rest else "")
        raise ConfigError(text) from None


# ----------------------------------------------------------------------- the driving


class _Timed:
    """The driver's client: every request bounded by ``timeout_s`` (answered
    ``TimedOut`` past it, cancelled where it was), every cancel too. A generation is
    streamed to its end on a thread of a pool (at most ``GENERATION_THREADS`` at once;
    more wait for one) and answered as one Reply: its node, its error, its queue and
    engine time."""

    def __init__(self, client: FleetClient, timeout_s: float) -> None:
        import concurrent.futures as cf

        self._client = client
        self._timeout_s = timeout_s
        self._pool = cf.ThreadPoolExecutor(GENERATION_THREADS, "edgefleet-drive-generation")

    def submit(self, model: str, inputs: Any, **kw: Any) -> cf.Future[Reply]:
        return self._client.submit(model, inputs, timeout_s=self._timeout_s, **kw)

    def submit_generation(
        self, model: str, prompt_ids: tuple[int, ...], **kw: Any
    ) -> cf.Future[Reply]:
        return self._pool.submit(self._generate, model, prompt_ids, kw)

    def _generate(self, model: str, prompt_ids: tuple[int, ...], kw: dict[str, Any]) -> Reply:
        from edgefleet.errors import Cancelled
        from edgefleet.messages import Reply

        rid, stream = kw["request_id"], None
        try:
            stream = self._client.generate(model, prompt_ids, timeout_s=self._timeout_s, **kw)
            stream.collect()
        except EdgeFleetError as exc:  # typed: an answer like any other
            return Reply(rid, (stream.node if stream is not None else None) or "", error=exc)
        result = stream.result
        assert result is not None  # a stream that ends without one raises NodeLost
        error = result.error
        if error is None and result.finish_reason == "cancelled":  # by the driver's stop
            error = Cancelled(f"generation {rid} cancelled after {len(result.tokens)} tokens")
        return Reply(
            rid,
            result.node,
            error=error,
            queue_s=result.queue_s,
            service_s=result.engine_s,
            batch_size=1,
        )

    def close(self) -> None:
        """Stop the generation threads (those still streaming end with their
        generations, each bounded by ``timeout_s``)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    def cancel(self, request_id: str, timeout_s: float = 10.0) -> bool:
        try:
            return self._client.cancel(request_id, min(timeout_s, self._timeout_s))
        except EdgeFleetError:  # the fleet did not answer in time: nothing more to do
            return False


class _Tally:
    """The answers as they come (on the traffic loop's thread), and queue samples."""

    def __init__(self) -> None:
        self.answers: list[Answer] = []
        self.errors = 0
        self.samples: list[tuple[float, int, int]] = []  # (s into the run, queued, in flight)
        self.sent = 0  # requests sent, once sending has ended

    def add(self, answer: Answer) -> None:
        self.answers.append(answer)
        if answer.reply.error is not None:
            self.errors += 1


class _Sampler(threading.Thread):
    """Every ``STATUS_EVERY_S``, the requests queued on the fleet's nodes (a status call,
    bounded) and in flight from this driver, for the report's queue figures."""

    def __init__(self, client: FleetClient, in_flight: Callable[[], int], tally: _Tally):
        super().__init__(name="edgefleet-drive-status", daemon=True)
        self._client, self._in_flight, self._tally = client, in_flight, tally
        self._halt = threading.Event()
        self.start_at = time.perf_counter()

    def run(self) -> None:
        self.start_at = time.perf_counter()  # the traffic's start, near enough
        while not self._halt.wait(STATUS_EVERY_S):
            try:
                status = self._client.status(timeout_s=STATUS_TIMEOUT_S)
            except Exception:  # the fleet busy or going away: no sample this time
                continue
            queued = sum(n.queue_length for n in status.nodes)
            at = time.perf_counter() - self.start_at
            self._tally.samples.append((at, queued, self._in_flight()))

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(STATUS_TIMEOUT_S + 1.0)


def _drive_and_close(
    args: argparse.Namespace,
    client: FleetClient,
    plan: _Plan,
    record: Path | None,
    *,
    owns_fleet: bool,
) -> int:
    """Drive ``client``'s fleet, report, close the client (stopping the fleet when it
    started it): 0, 130 after Ctrl-C, 1 when the driver failed."""
    interrupted = False
    try:
        tally = _Tally()
        failure: str | None = None
        started = time.perf_counter()
        try:
            failure = _drive(client, plan, tally)
        except KeyboardInterrupt:
            interrupted = True
        elapsed = time.perf_counter() - started
        counters = client.counters()
        result = _result(tally, plan, client.config, counters, elapsed, interrupted)
        _report(args, result, plan, client.config, owns_fleet)
        if failure is not None:
            err(f"error: {failure}")
    finally:
        if interrupted and owns_fleet:  # the report is out: stopping the fleet is bounded
            _bound_the_stop()
        client.close()  # its call record is written out here
    if record is not None:
        same = "".join(
            f" --{name} {value}"
            for name, value in (("requests", args.requests), ("seed", args.seed))
            if value is not None
        )
        err(
            f"call record: {record} (`edgefleet simulate {args.config} --workload "
            f"{args.workload}{same} --costs {record}` replays its engine times)"
        )
    if interrupted:
        return 130
    return 1 if failure is not None else 0


def _drive(client: FleetClient, plan: _Plan, tally: _Tally) -> str | None:
    """Send every arrival at its time and wait for the answers (each bounded by
    ``REQUEST_TIMEOUT_S``), with a progress bar on stderr. On Ctrl-C: stop sending, wait
    at most ``DRAIN_S`` for the answers already out (a second Ctrl-C: not at all), and
    raise KeyboardInterrupt. Returns why the driver failed, None when it did not."""
    from tqdm import tqdm

    from cluster.traffic import LoopThread, OpenLoop, TrafficError

    total = len(plan.arrivals)
    last_due = plan.arrivals[-1].at if plan.arrivals else 0.0
    timed = _Timed(client, REQUEST_TIMEOUT_S)
    driver = OpenLoop(timed, plan.arrivals, plan.inputs_of, on_answer=tally.add)
    bar = tqdm(total=total, unit="req", desc="driving", file=sys.stderr, leave=False)
    sampler = _Sampler(client, lambda: driver.in_flight, tally)
    traffic: LoopThread | None = None
    try:
        traffic = LoopThread("edgefleet-drive")
        traffic.run(driver.start(), CONTROL_TIMEOUT_S)
        sampler.start()
        give_up = time.monotonic() + last_due + REQUEST_TIMEOUT_S + FINISH_MARGIN_S
        done = traffic.spawn(driver.wait())
        while not done.done() and time.monotonic() < give_up:
            _show(bar, tally, driver.counts.submitted)
            time.sleep(0.1)
        _show(bar, tally, driver.counts.submitted)
        if not done.done():  # every request is bounded: only a stuck driver gets here
            traffic.run(driver.stop(DRAIN_S), CONTROL_TIMEOUT_S)
            late = REQUEST_TIMEOUT_S + FINISH_MARGIN_S
            return f"answers still out {late:g} s after the last arrival"
        try:
            done.result()
        except TrafficError as exc:
            return str(exc)
        return None
    except KeyboardInterrupt:
        bar.close()
        err(
            f"interrupted: stopped sending; waiting up to {DRAIN_S:g} s for the "
            f"{driver.in_flight} answers still out"
        )
        if traffic is not None:
            with contextlib.suppress(KeyboardInterrupt, TrafficError):  # again: report now
                traffic.run(driver.stop(DRAIN_S, drain=True), DRAIN_S + CONTROL_TIMEOUT_S)
        raise
    finally:
        tally.sent = driver.counts.submitted
        bar.close()
        sampler.stop()
        if traffic is not None:
            traffic.close()
        timed.close()


def _show(bar: Any, tally: _Tally, sent: int) -> None:
    bar.update(len(tally.answers) - bar.n)
    bar.set_postfix_str(f"sent {sent}, not served {tally.errors}", refresh=False)


def _bound_the_stop() -> None:
    """After Ctrl-C, stopping the embedded fleet may take at most ``INTERRUPTED_STOP_S``:
    past that the processes this one started are stopped, and it exits as interrupted."""
    from cluster.head import stop_children

    def give_up() -> None:
        err(f"stopping the fleet took over {INTERRUPTED_STOP_S:.0f} s: stopping its processes")
        stop_children(grace_s=0)
        os._exit(130)

    timer = threading.Timer(INTERRUPTED_STOP_S, give_up)
    timer.daemon = True
    timer.start()


# ------------------------------------------------------------------------ the report


def _result(
    tally: _Tally,
    plan: _Plan,
    config: FleetConfig,
    counters: Mapping[str, int],
    elapsed_s: float,
    interrupted: bool,
) -> RunResult:
    """The run as the simulator's report reads one: each answer's priority, outcome,
    latency from its arrival and node; engine time per node; queue samples; the
    client's spills, sheds and re-placements, and the errors the outcomes lump as
    failed, by type."""
    from sim.report import Recorder, RunResult
    from sim.run import outcome

    answers = list(tally.answers)
    nodes = [s.name for s in config.node_specs()]
    nodes += sorted({a.reply.node for a in answers if a.reply.node} - set(nodes))
    index = {name: i for i, name in enumerate(nodes)}
    recorder = Recorder(nodes, plan.priorities)
    failed: Counter[str] = Counter()
    for a in answers:
        assert a.arrival is not None and a.due is not None
        reply = a.reply
        node = index.get(reply.node, -1)
        kind = outcome(reply.error)
        recorder.answer(a.arrival.priority, kind, a.done - a.due, node)
        if kind == "failed":
            failed[type(reply.error).__name__] += 1
        elif kind == "completed" and node >= 0:
            recorder.busy(node, reply.service_s / max(1, reply.batch_size))
    for at, queued, in_flight in list(tally.samples):
        recorder.sample(at, queued, in_flight)
    for name in ("spilled", "shed", "replaced"):
        if counters.get(name):
            recorder.counter(name, counters[name])
    for name, n in sorted(failed.items()):
        recorder.counter(f"failed: {name}", n)
    if interrupted:  # what the report leaves out
        sent = tally.sent
        if len(plan.arrivals) > sent:
            recorder.counter("not sent (interrupted)", len(plan.arrivals) - sent)
        if sent > len(answers):
            recorder.counter("sent, not answered (interrupted)", sent - len(answers))
    if answers:  # the run: from the traffic's start to its last answer
        first = answers[0]
        assert first.arrival is not None and first.due is not None
        elapsed_s = max(a.done for a in answers) - (first.due - first.arrival.at)
    return RunResult(
        "live",
        recorder,
        simulated_s=elapsed_s,
        wall_s=elapsed_s,
        events=len(answers),
        interrupted=interrupted,
        live=True,
    )


def _report(
    args: argparse.Namespace,
    result: RunResult,
    plan: _Plan,
    config: FleetConfig,
    embedded: bool,
) -> None:
    """The report on stdout; with ``--out`` also written as `simulate` writes its own."""
    from sim.report import report_markdown, write_report

    where = "an embedded fleet" if embedded else f"the running fleet {config.fleet.name!r}"
    description = [
        f"Fleet: {where}, {len(config.node_specs())} nodes; workload: {args.workload}, "
        f"arrivals generated for {plan.nodes} nodes ({args.config})",
        f"Seed: {plan.seed}",
        f"{len(plan.arrivals):,} arrivals; latency from each arrival's time to its answer",
    ]
    title = "Live fleet"
    say(report_markdown([result], title=title, description=description).rstrip("\n"))
    if args.out is not None:
        path = write_report(args.out, [result], title=title, description=description)
        say(f"report: {path}")


__all__: Sequence[str] = ("add_parser", "cmd_drive")
