"""Priorities and their classes: the range, the class of a priority, and the rule that
the source spells them out only in edgefleet/priorities.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from edgefleet.errors import InvalidInput
from edgefleet.priorities import (
    DEFAULT_CLASSES,
    DEFAULT_PRIORITIES,
    MAX_PRIORITY,
    MIN_PRIORITY,
    PRIORITIES,
    check_priority,
    class_name,
    class_of,
    resolve_priority,
)

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("edgefleet", "actors", "cluster", "policies", "sim")
HOME = REPO / "edgefleet" / "priorities.py"


@pytest.mark.parametrize(
    "priority, label",
    [(10, "foreground"), (9, "inline"), (7, "inline"), (5, "background"), (3, "background")]
    + [(2, "offline"), (0, "offline")],
)
def test_priorities_are_named_by_their_class(priority, label):
    assert class_name(priority, DEFAULT_PRIORITIES) == label


def test_a_priority_below_every_class_takes_the_lowest():
    assert class_name(1, {"high": 8, "low": 4}) == "low"
    assert class_of(1, (3, 10)) == 3


def test_classes_of_priorities():
    assert [class_of(p, DEFAULT_CLASSES) for p in (0, 2, 3, 6, 7, 9, 10)] == [0, 0, 3, 3, 7, 7, 10]
    assert class_of(5, ()) is None and class_name(5, {}) == "5"


def test_two_names_for_one_class():
    classes = {"b": 3, "a": 3, "top": 10}
    assert class_name(4, classes) == "b"  # at or below: the last name
    assert class_name(1, classes) == "a"  # below every class: the first name


def test_the_range():
    assert (MIN_PRIORITY, MAX_PRIORITY) == (0, 10) and list(PRIORITIES) == list(range(11))
    assert DEFAULT_CLASSES == (0, 3, 7, 10)
    assert check_priority(10) == 10
    with pytest.raises(InvalidInput, match="priority must be 0-10, got 11"):
        check_priority(11)
    with pytest.raises(InvalidInput, match="between 0 and 10, got -1"):
        resolve_priority(-1)
    assert resolve_priority("inline") == 7


# ------------------------------------------------------------ one place in the source

CLASS_NAMES = frozenset(DEFAULT_PRIORITIES)
# A node's lifecycle states share two names with the default classes: a tuple of only
# these is the lifecycle, not the classes.
LIFECYCLE_NAMES = frozenset({"foreground", "background"})
ENDS = frozenset({MIN_PRIORITY, MAX_PRIORITY})


def _int(node: ast.AST) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


def _about_priorities(node: ast.AST) -> bool:
    return "priorit" in ast.unparse(node).lower()


def spelled_out(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, source) of every priority range, class list or class tuple written out."""
    found = []
    for node in ast.walk(tree):
        hit = False
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            args = [_int(a) for a in node.args]
            if node.func.id == "range" and args in ([MAX_PRIORITY + 1], [0, MAX_PRIORITY + 1]):
                hit = True  # every priority
            # e.g. max(spec.priorities.values(), default=10)
            hit |= _about_priorities(node) and any(
                k.arg == "default" and _int(k.value) == MAX_PRIORITY for k in node.keywords
            )
        elif isinstance(node, ast.Compare):
            # e.g. 0 <= priority <= 10, priority > 10
            sides = [node.left, *node.comparators]
            hit = any(_int(s) in ENDS for s in sides) and any(
                _int(s) is None and _about_priorities(s) for s in sides
            )
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            ints = tuple(_int(e) for e in node.elts)
            if ints == DEFAULT_CLASSES:
                hit = True  # the default classes' priorities
            names = {e.value for e in node.elts if isinstance(e, ast.Constant)}
            if (
                len(node.elts) >= 2
                and names == {getattr(e, "value", None) for e in node.elts}
                and names <= CLASS_NAMES
                and not names <= LIFECYCLE_NAMES
            ):
                hit = True  # the default classes' names
        if hit:
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_priorities_are_spelled_out_only_in_their_module():
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if path == HOME:
                continue
            for line, text in spelled_out(ast.parse(path.read_text())):
                found.append(f"{path.relative_to(REPO)}:{line}: {text}")
    assert not found, "use edgefleet.priorities instead:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source",
    [
        "ok = 0 <= request.priority <= 10",
        "ok = priority > 10",
        "every = range(11)",
        "every = range(0, 11)",
        "classes = (0, 3, 7, 10)",
        'names = ("foreground", "inline", "background", "offline")',
        'names = ["background", "offline"]',
        "top = max(spec.priorities.values(), default=10)",
    ],
)
def test_the_source_check_sees_the_usual_forms(source):
    assert spelled_out(ast.parse(source))


@pytest.mark.parametrize(
    "source",
    [
        "ok = is_priority(priority)",
        "every = range(10)",
        "n = len(queue) <= 10",
        'states = ("foreground", "background")',
        'job = ("heavy", "background")',
    ],
)
def test_the_source_check_lets_other_code_be(source):
    assert not spelled_out(ast.parse(source))
