"""The chaos soak's bookkeeping (bench/chaos.py) flags every broken promise it is
meant to catch: on made-up records and traces, without a cluster."""

from __future__ import annotations

import json
from pathlib import Path

from bench.chaos import (
    ANSWER_SLACK_S,
    Answer,
    Event,
    Figures,
    Ledger,
    Options,
    References,
    Sample,
    analyse,
    token_problem,
)


def trace(directory: Path, node: str, pid: int, lines: list[dict]) -> None:
    directory.mkdir(exist_ok=True)
    with open(directory / f"trace-{node}-{pid}.jsonl", "a") as f:
        for line in lines:
            f.write(json.dumps({"node": node, "pid": pid, "state": "completed", **line}) + "\n")


def test_token_problems():
    assert token_problem([1, 2, 3], [1, 2, 3], full=True) == ""
    assert token_problem([1, 2], [1, 2, 3], full=False) == ""
    assert "first difference at 2" in token_problem([1, 2], [1, 2, 3], full=True)
    assert "first difference at 1" in token_problem([1, 1, 2], [1, 2, 3], full=False)  # a dupe
    assert "first difference at 1" in token_problem([1, 3], [1, 2, 3], full=False)  # a gap


def test_every_broken_promise_is_counted(tmp_path):
    ledger = Ledger()
    refs = References({}, {}, {(0, 0): ((1, 2), [7, 8, 9, 10])}, [])
    t = 1000.0

    def sent(api="submit", answers=(), **kw):
        s = ledger.new(api, "m" if api != "generate" else "lm", 3, kw.pop("ref", ("m", 0)), **kw)
        s.at = t
        for a in answers:
            ledger.answer(s, a)
        return s

    ok = Answer(t + 1, "ok", "completed", "a")
    fine = sent(answers=[ok])
    sent()  # no answer
    twice = sent(answers=[ok, ok])
    sent(answers=[Answer(t + 1, "untyped", "RuntimeError")])
    wrong = sent(answers=[ok])
    wrong.wrong = "logits differ"
    unexplained = sent(answers=[ok])
    # Ran again after its node died: explained, yet a broken promise for at_most_once.
    explained = sent(answers=[Answer(t + 9, "ok", "completed", "b")], at_most_once=True)
    sent(answers=[ok])  # a success nothing ran
    elsewhere = sent(answers=[Answer(t + 1, "ok", "completed", "b")])  # ran on a only
    gen = dict(api="generate", ref=("chat", 0, 0), max_new_tokens=4)
    exact = sent(answers=[Answer(t + 1, "ok", "length", "a")], **gen)
    exact.tokens = [7, 8, 9, 10]
    dupe = sent(answers=[Answer(t + 1, "ok", "length", "a")], **gen)
    dupe.tokens = [7, 8, 8, 9]
    cut = sent(answers=[Answer(t + 1, "typed", "NodeLost")], at_most_once=True, **gen)
    cut.tokens = [7, 9]

    traces = tmp_path / "trace"
    trace(
        traces,
        "a",
        1,
        [
            {"t": t + 0.5, "id": i, "ran": True}
            for i in (fine.id, twice.id, wrong.id, elsewhere.id, exact.id, dupe.id)
        ]
        + [
            {"t": t + 0.5, "id": unexplained.id, "ran": True},
            {"t": t + 0.6, "id": unexplained.id, "ran": True},  # twice, no kill
            {"t": t + 0.5, "id": explained.id, "ran": True},  # then pid 1 was killed
            {"t": t + 0.5, "id": "stranger", "ran": True},
        ],
    )
    trace(traces, "b", 2, [{"t": t + 8, "id": explained.id, "ran": True}])
    with (traces / "trace-b-2.jsonl").open("a") as f:
        f.write('{"t": 3, "id": "cut sh')  # a writer killed mid-line
    figures = Figures(Options(), events=[Event(t + 5, "node", "a", (1,))])
    samples = [Sample(t + i, "a", 1, 100.0 + i) for i in range(0, 40, 2)]
    analyse(figures, ledger, refs, traces, samples, t, t + 40)

    assert figures.sent == 12
    assert (figures.no_answer, figures.two_answers) == (1, 1)
    assert dict(figures.untyped) == {"RuntimeError": 1}
    assert figures.wrong_outputs == 1
    assert (figures.ran_more, figures.reran_after_kill, figures.reran_unexplained) == (2, 1, 1)
    assert (figures.at_most_once_sent, figures.at_most_once_lost) == (2, 1)
    assert figures.reran_at_most_once == 1
    assert figures.success_without_run == 1 and figures.wrong_node == 1
    assert (figures.unknown_ids, figures.truncated_lines) == (1, 1)
    assert (figures.gen_exact, figures.gen_token_errors, figures.gen_partial_errors) == (1, 1, 1)
    ((role, pid, _, first, warm, last, growth),) = figures.memory
    assert (role, pid, first, last) == ("a", 1, 100.0, 138.0)
    assert growth is not None and abs(growth - 100 * (138 - warm) / warm) < 1e-9
    assert not figures.passed
    assert not figures.covered  # one kind of kill only
    failed = {what for what, _, holds in figures.invariants() if not holds}
    assert "requests without an answer" in failed and len(failed) >= 9


def test_a_request_answered_after_its_limit_and_the_slack_is_late(tmp_path):
    """The limit is max(deadline_s, timeout_s); an answer more than ANSWER_SLACK_S
    after it fails the answer-time invariant, whatever the answer was."""
    ledger = Ledger()
    t = 1000.0

    def answered(after_s, timeout_s, deadline_s=None, what="completed"):
        s = ledger.new("submit", "m", 3, ("m", 0), timeout_s=timeout_s, deadline_s=deadline_s)
        s.at = t
        ledger.answer(s, Answer(t + after_s, "ok" if what == "completed" else "typed", what))
        return s

    ok = [answered(2.9, timeout_s=2.0)]  # within the slack
    ok.append(answered(4.5, timeout_s=2.0, deadline_s=4.0))  # the deadline is the later
    late = answered(3.5, timeout_s=2.0, what="TimedOut")  # 1.5 s past its timeout
    trace(tmp_path, "a", 1, [{"t": t + 1, "id": s.id, "ran": True} for s in ok])
    figures = Figures(Options())
    analyse(figures, ledger, References({}, {}, {}, []), tmp_path, [], t, t + 10)

    assert (figures.late, figures.timed_out_late) == (1, 1)
    assert abs(figures.worst_late_s - 1.5) < 1e-9
    assert any(late.id in e for e in figures.examples)
    failed = {what for what, _, holds in figures.invariants() if not holds}
    assert failed == {
        f"requests answered later than max(deadline_s, timeout_s) + {ANSWER_SLACK_S:g} s"
    }


def test_reruns_after_a_freeze_or_a_loss_are_explained_and_others_are_not(tmp_path):
    ledger = Ledger()
    t = 1000.0

    def sent():
        s = ledger.new("submit", "m", 3, ("m", 0))
        s.at = t
        ledger.answer(s, Answer(t + 9, "ok", "completed", "b"))
        return s

    frozen, lost, neither = sent(), sent(), sent()
    trace(tmp_path, "a", 1, [{"t": t + 8, "id": frozen.id, "ran": True}])  # on its SIGCONT
    trace(tmp_path, "b", 2, [{"t": t + 4, "id": s.id, "ran": True} for s in ledger.sent.values()])
    trace(tmp_path, "c", 3, [{"t": t + 1, "id": lost.id, "ran": True}])
    trace(tmp_path, "d", 4, [{"t": t + 1, "id": neither.id, "ran": True}])
    figures = Figures(
        Options(),
        events=[Event(t + 0.5, "node-freeze", "a", (1,), back_at=t + 7.5)],
        losses={"c": [(t + 2, t + 6)], "d": [(t + 5, t + 6)]},  # d: only after the rerun
    )
    analyse(figures, ledger, References({}, {}, {}, []), tmp_path, [], t, t + 10)

    assert figures.ran_more == 3
    assert (figures.reran_after_freeze, figures.reran_after_loss) == (1, 1)
    assert figures.reran_unexplained == 1 and any(neither.id in e for e in figures.examples)
