"""When a node owes a GPU challenge: at registration, then at random times after each one ends.

Owns the scheduling columns of `db.Node` (`next_challenge_at`, and `verified` going back to False when a node
re-registers with other resources). Pure functions over a Node row and the config; no queries. It is apart from
`coordinator.challenge` (the endpoints) so that `views.nodes` can call it without an import cycle.

`next_challenge_at` is None while a challenge is open: the node is not asked again until that one ends.
"""

from __future__ import annotations

import random

from gpuswarm.coordinator.config import CoordinatorConfig
from gpuswarm.coordinator.db import Node

# Unpredictable gaps: a node that could foresee its next challenge could rent a GPU just for it.
_random = random.SystemRandom()


def next_challenge_time(config: CoordinatorConfig, now: float) -> float:
    """Exponential gaps (a Poisson process) with the configured mean, never shorter than the minimum."""
    gap = _random.expovariate(1.0 / config.challenge_mean_interval) if config.challenge_mean_interval > 0 else 0.0
    return now + max(config.challenge_min_interval, gap)


def after_registration(node: Node, resources_changed: bool, config: CoordinatorConfig, now: float) -> None:
    """A registration asks for a challenge (no sooner than the minimum gap after the last one). A node that now
    claims other resources is unverified until it passes a challenge for them."""
    if resources_changed:
        node.verified = False
    last = node.last_challenge_at
    earliest = now if last is None else max(now, last + config.challenge_min_interval)
    node.next_challenge_at = earliest if node.next_challenge_at is None else min(node.next_challenge_at, earliest)


def challenge_due(node: Node, now: float, *, busy: bool) -> bool:
    """Ask the node (in its heartbeat answer) to start a challenge? Never while it works on a job: the challenge
    would slow the job and the job would fail the challenge. The coordinator, not the node's reported state, says
    whether it is busy, so a node cannot dodge challenges by claiming to train."""
    return not busy and node.next_challenge_at is not None and now >= node.next_challenge_at
