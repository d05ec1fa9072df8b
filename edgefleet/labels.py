"""Ray node labels and label selectors, read and matched without Ray.

A pool selects Ray nodes by their labels (``ray start --labels device=camera``) with
Ray's own selector syntax, one condition per label key:

- ``camera``: the label is ``camera``;
- ``in(a, b)``: the label is ``a`` or ``b``;
- ``!camera`` / ``!in(a, b)``: the label is none of them, or the node has no such label.

The config checks a selector here when the YAML loads; the router matches Ray's node
table against it (it starts each pool member pinned to its Ray node by node id, so the
match is its own, and must agree with Ray's).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

DEVICE_LABEL = "edgefleet.io/device"
"""The Ray node label naming the device (``ray start --labels edgefleet.io/device=cam-7``):
a pool member is ``POOL/DEVICE``, and keeps that name when the device comes back as a
new Ray node. A Ray node without it is named by the start of its Ray node id."""

NODE_ID_CHARS = 12  # of a Ray node id, naming a device without the label

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?"  # a label value or key name
_PREFIX = rf"{_NAME}(?:\.{_NAME})*"  # a key's DNS-like prefix (``edgefleet.io``)
_KEY = re.compile(rf"(?:{_PREFIX}/)?{_NAME}")
_VALUE = re.compile(_NAME)
_CONDITION = re.compile(rf"(!)?(?:in\(\s*({_NAME}(?:\s*,\s*{_NAME})*)\s*\)|({_NAME}))")


@dataclass(frozen=True)
class Condition:
    """One label key's condition: its value is (or, ``negated``, is not) one of ``values``."""

    key: str
    values: frozenset[str]
    negated: bool = False

    def holds(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        if self.negated:
            return value not in self.values
        return value in self.values


@dataclass(frozen=True)
class Selector:
    """All of its conditions hold. Parse one with :func:`parse_selector`."""

    conditions: tuple[Condition, ...]

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(condition.holds(labels) for condition in self.conditions)


def parse_selector(selector: Mapping[str, str]) -> Selector:
    """A selector from its YAML form (``{device: camera, site: "in(s1, s2)"}``);
    ValueError naming the first key or value no syntax allows, and what would be."""
    if not selector:
        raise ValueError("an empty selector would take every Ray node; name at least one label")
    conditions = []
    for key, text in selector.items():
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(
                f"label key {key!r} is not a Ray label key ([prefix/]name: letters, digits, "
                "'-', '_', '.', at most 63 characters, starting and ending alphanumeric)"
            )
        found = _CONDITION.fullmatch(text.strip()) if isinstance(text, str) else None
        if found is None:
            raise ValueError(
                f"{key}: {text!r} is no Ray label selector; allowed: a value (camera), "
                "in(a, b), !value or !in(a, b), values of letters, digits, '-', '_', '.'"
            )
        negated, listed, single = found.groups()
        values = [v.strip() for v in listed.split(",")] if listed else [single]
        conditions.append(Condition(key, frozenset(values), negated is not None))
    return Selector(tuple(conditions))


def device_name(labels: Mapping[str, str], node_id: str) -> str:
    """The name of the device a Ray node is: its ``edgefleet.io/device`` label, else the
    first NODE_ID_CHARS characters of its Ray node id (then it is a new device each
    time it joins)."""
    name = labels.get(DEVICE_LABEL)
    if name and _VALUE.fullmatch(name):
        return name
    return node_id[:NODE_ID_CHARS]
