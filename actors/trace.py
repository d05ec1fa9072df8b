"""The node trace: one JSON line per request a node settles, opt-in.

With ``node_defaults.trace_dir`` set, every node process appends to its own file in
that folder, ``trace-{node}-{pid}.jsonl``: a node Ray restarts (a new process) starts a
new file, so executions can be counted per request id across node processes, killed
ones included. Each line is written and flushed on its own, so a process that is
killed loses at most the line it was writing; a reader skips a last line that does not
parse. Tracing never breaks serving: a line that cannot be written is dropped and
counted (:attr:`NodeTrace.errors`), and a folder that cannot be opened turns tracing
off for the process. Off (the default), the node pays one ``None`` check per request.

One line, one settled request (keys in this order; numbers are JSON numbers)::

    t          unix time the node settled it (float seconds)
    node       the node's name
    pid        the node's process id
    id         the request id (a retry, or a re-placement after a node loss, keeps it)
    kind       "infer" or "generate"
    model      the model name
    priority   0-10, higher runs first
    state      the terminal state: completed, failed, rejected, evicted, superseded,
               expired or cancelled (edgefleet.request.RequestState values)
    ran        true when the engine ran it to completion on this node: an inference
               that produced outputs, a generation that finished (stop, length, budget)
    rows       rows on the batch axis (1 for a generation)
    queue_s    arrival on the node to the start of the call that last ran it (0 when
               it never started)
    service_s  engine seconds: of the call that settled it (inference), over every
               resumption on this node (generation); 0 when it never ran
    tokens     tokens generated on this node (0 for an inference)

For example::

    {"t": 1767268800.123, "node": "edge-1", "pid": 4242, "id": "9f3c...", "kind": "infer",
     "model": "classifier", "priority": 10, "state": "completed", "ran": true, "rows": 1,
     "queue_s": 0.0012, "service_s": 0.0004, "tokens": 0}

Requests refused before admission (invalid inputs, an unknown model) and retries
answered from the node's memory of recent answers settle nothing and write no line.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import IO, Any

from edgefleet.request import Request, RequestState

log = logging.getLogger(__name__)

FIELDS = (
    "t",
    "node",
    "pid",
    "id",
    "kind",
    "model",
    "priority",
    "state",
    "ran",
    "rows",
    "queue_s",
    "service_s",
    "tokens",
)


def trace_path(directory: Path, node: str, pid: int) -> Path:
    """The file of one node process."""
    return directory / f"trace-{node}-{pid}.jsonl"


class NodeTrace:
    """Writes one node process's trace. Called on the node's event loop only."""

    def __init__(self, directory: Path, node: str) -> None:
        self.node = node
        self.pid = os.getpid()
        self.path = trace_path(directory, node, self.pid)
        self.errors = 0  # lines that could not be written and were dropped
        self._file: IO[str] | None = None
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        except OSError:
            self.errors += 1
            log.warning("node %s: no trace (cannot open %s)", node, self.path, exc_info=True)

    def settled(
        self,
        request: Request,
        state: RequestState,
        *,
        ran: bool,
        service_s: float,
        tokens: int = 0,
    ) -> None:
        """``request`` reached its terminal ``state``."""
        if self._file is None:
            return
        try:
            started = request.started
            line = {
                "t": time.time(),
                "node": self.node,
                "pid": self.pid,
                "id": request.id,
                "kind": "generate" if request.pausable else "infer",
                "model": request.model,
                "priority": request.priority,
                "state": state.value,
                "ran": ran,
                "rows": request.rows,
                "queue_s": round(max(0.0, started - request.arrival), 6)
                if started is not None
                else 0.0,
                "service_s": round(service_s, 6),
                "tokens": tokens,
            }
            self._file.write(json.dumps(line) + "\n")  # line-buffered: flushed now
        except Exception:
            self.errors += 1
            if self.errors == 1:  # once: a broken trace must not flood the log either
                log.warning("node %s: dropping a trace line", self.node, exc_info=True)

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                self.errors += 1
            self._file = None


def read_trace(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The lines of one trace file, and how many could not be parsed (a line cut short
    by a killed process)."""
    lines: list[dict[str, Any]] = []
    bad = 0
    with open(path, encoding="utf-8") as f:
        for raw in f:
            try:
                item = json.loads(raw)
            except ValueError:
                bad += 1
                continue
            if isinstance(item, dict):
                lines.append(item)
            else:
                bad += 1
    return lines, bad


def read_traces(directory: Path) -> tuple[list[dict[str, Any]], int]:
    """Every line of every node trace in ``directory``, ordered by time, and the count
    of lines that could not be parsed."""
    out: list[dict[str, Any]] = []
    bad = 0
    for path in sorted(directory.glob("trace-*.jsonl")):
        lines, n = read_trace(path)
        out += lines
        bad += n
    out.sort(key=lambda line: float(line.get("t", 0.0)))
    return out, bad
