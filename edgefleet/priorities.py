"""Priorities and priority classes, written down once.

A priority is an int from ``MIN_PRIORITY`` to ``MAX_PRIORITY``; higher runs first. A
fleet names some of them as classes (``priorities:`` in the YAML, by default
``DEFAULT_PRIORITIES``). Every priority belongs to one class: the highest class at or
below it, or the lowest class for a priority below all of them (:func:`class_of`).

No Ray and no I/O: the node, the callers, the policies and the simulator all use it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from edgefleet.errors import InvalidInput

MIN_PRIORITY = 0
MAX_PRIORITY = 10
PRIORITIES = range(MIN_PRIORITY, MAX_PRIORITY + 1)  # every priority, lowest first
PRIORITY_RANGE = f"{MIN_PRIORITY}-{MAX_PRIORITY}"  # as messages and help texts write it

DEFAULT_PRIORITIES: Mapping[str, int] = {
    "foreground": 10,
    "inline": 7,
    "background": 3,
    "offline": 0,
}
# The class priorities of DEFAULT_PRIORITIES, lowest first.
DEFAULT_CLASSES: tuple[int, ...] = tuple(sorted(set(DEFAULT_PRIORITIES.values())))


def is_priority(value: int) -> bool:
    """True when the int ``value`` is a priority (within the range)."""
    return MIN_PRIORITY <= value <= MAX_PRIORITY


def check_priority(priority: int) -> int:
    """``priority`` if it is within the range, else InvalidInput."""
    if not is_priority(priority):
        raise InvalidInput(f"priority must be {PRIORITY_RANGE}, got {priority}")
    return priority


def resolve_priority(priority: str | int, classes: Mapping[str, int] = DEFAULT_PRIORITIES) -> int:
    """Map a class name or an int 0-10 onto the integer priority (higher runs first)."""
    wrong = f"priority must be a class name or an int {PRIORITY_RANGE}, got {priority!r}"
    if isinstance(priority, bool):  # bool is an int subclass; True is not a priority
        raise InvalidInput(wrong)
    if isinstance(priority, int | np.integer):
        value = int(priority)
        if is_priority(value):
            return value
        raise InvalidInput(
            f"priority must be between {MIN_PRIORITY} and {MAX_PRIORITY}, got {value}"
        )
    if isinstance(priority, str):
        if priority in classes:
            return classes[priority]
        names = ", ".join(f"{k} ({v})" for k, v in classes.items())
        raise InvalidInput(
            f"unknown priority class {priority!r}; use one of {names} or {PRIORITY_RANGE}"
        )
    raise InvalidInput(wrong)


def class_of(priority: int, classes: Iterable[int]) -> int | None:
    """The class (of the class priorities ``classes``) that ``priority`` belongs to: the
    highest at or below it, else the lowest. None when there are no classes."""
    below = None
    lowest = None
    for c in classes:
        if c <= priority and (below is None or c > below):
            below = c
        if lowest is None or c < lowest:
            lowest = c
    return lowest if below is None else below


def class_name(priority: int, classes: Mapping[str, int]) -> str:
    """The name of the class ``priority`` belongs to (see :func:`class_of`), or the
    number itself when there are no classes. Of two names for one class priority: the
    last in alphabetical order, or the first for a priority below every class."""
    owner = class_of(priority, classes.values())
    if owner is None:
        return str(priority)
    names = [name for name, value in classes.items() if value == owner]
    return max(names) if owner <= priority else min(names)


def priority_name(priority: int, classes: Mapping[str, int] = DEFAULT_PRIORITIES) -> str:
    """The class name of an integer priority, or the number itself when no class has it."""
    for name, value in classes.items():
        if value == priority:
            return name
    return str(priority)
