"""A node's service states: the table of allowed moves, and the node keeping to it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import pickle

import pytest

from actors.node import NodeRuntime
from edgefleet.messages import NODE_MOVES, NodeState
from edgefleet.request import IllegalTransition
from tests.fakes import FakeLoader, fake_spec


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_every_state_is_reachable_from_starting_and_every_state_can_stop():
    assert set(NODE_MOVES) == set(NodeState)
    reached = {NodeState.STARTING}
    frontier = [NodeState.STARTING]
    while frontier:
        for nxt in NODE_MOVES[frontier.pop()] - reached:
            reached.add(nxt)
            frontier.append(nxt)
    assert reached == set(NodeState)
    for state in set(NodeState) - {NodeState.STOPPED}:
        assert NodeState.STOPPED in NODE_MOVES[state], state
    assert not NODE_MOVES[NodeState.STOPPED]  # the end


def test_an_illegal_move_raises_and_leaves_the_state_as_it_was():
    async def main():
        node = NodeRuntime(fake_spec(), loader=FakeLoader())
        with pytest.raises(IllegalTransition, match="STARTING -> DRAINED"):
            node._move(NodeState.DRAINED)
        await node.start()
        with pytest.raises(IllegalTransition, match="SERVING -> STARTING"):
            node._move(NodeState.STARTING)
        assert node.status().state is NodeState.SERVING
        await node.drain()
        await node.drain()  # drained already: nothing to do, no illegal move
        assert node.status().state is NodeState.DRAINED
        await node.stop()
        await node.stop()  # idempotent
        assert node.status().state is NodeState.STOPPED

    run(main())


def test_a_state_reads_pickles_and_serialises_as_the_bare_string_it_replaced():
    async def main():
        node = NodeRuntime(fake_spec(), loader=FakeLoader())
        await node.start()
        status = node.status()
        await node.stop()
        return status

    status = run(main())
    assert status.state == "serving" and f"{status.state:<8}|" == "serving |"
    assert pickle.loads(pickle.dumps(status)).state is NodeState.SERVING
    assert json.loads(json.dumps(dataclasses.asdict(status)))["state"] == "serving"
