"""The node daemon's state machine: the next state as a pure function of observed facts.

`NodeDaemon.enter_state` holds the side effects (logging, the advert's state); this module holds only the rules,
so that the exact sequence of states is unit-tested without processes or a network.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuswarm.proto.models import NodeState


@dataclass(frozen=True)
class Facts:
    stop_requested: bool = False
    registered: bool = False
    coordinator_reachable: bool = True
    training: bool = False  # a job's training process is running


def next_state(current: NodeState, facts: Facts) -> NodeState:
    if current is NodeState.OFFLINE:
        return NodeState.OFFLINE  # final: a stopped daemon does not come back
    if facts.stop_requested:
        # Drain first: training processes are stopped and claims flushed before the node says goodbye.
        return NodeState.STOPPING if facts.training else NodeState.OFFLINE
    if not facts.registered:
        # Not yet known to the coordinator (or it forgot us): register before anything else.
        return NodeState.REGISTERING
    if facts.training:
        # Training goes on whether or not the coordinator answers; reports wait in the outbox.
        return NodeState.TRAINING
    if not facts.coordinator_reachable:
        return NodeState.DISCONNECTED
    return NodeState.IDLE
