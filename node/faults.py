"""Test-only fault injection for the training worker (`gpuswarm.node.worker`): each function reads one
environment variable, logs a loud warning when it is set, and tells the worker how to misbehave.

- GPUSWARM_FAULT_INFLATE_CLAIMS=<factor> multiplies the samples and compute seconds in this node's OWN claims (those
  it shares and those it reports), to play a lying node in end-to-end tests of the ledger.
- GPUSWARM_FAULT_BYZANTINE=<factor>|nan plays a Byzantine peer: every part this node sends to the other reducers of
  an averaging round is multiplied by the factor (e.g. -100: sign-flipped and huge; nan: NaN), on the wire only
  (`poison_outgoing_parts`). Its own tensors stay honest, so it goes on training and attacks every round, as a
  real attacker would (scaling its own gradients instead made a NaN node break its own model and drop out after
  one round, before enough reducers had seen it).
- GPUSWARM_FAULT_LAZY=1 claims every batch without computing it (zero gradients): the evidence it keeps then fails
  a referee's replay (`gpuswarm.node.evidence`).

Never set them in production.
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque

FAULT_INFLATE_ENV = "GPUSWARM_FAULT_INFLATE_CLAIMS"
FAULT_BYZANTINE_ENV = "GPUSWARM_FAULT_BYZANTINE"
FAULT_LAZY_ENV = "GPUSWARM_FAULT_LAZY"
logger = logging.getLogger("gpuswarm.worker")


def byzantine_fault() -> float | None:
    """The test-only Byzantine gradient factor (GPUSWARM_FAULT_BYZANTINE; "nan" is NaN); None when unset."""
    raw = os.environ.get(FAULT_BYZANTINE_ENV, "").strip().lower()
    if not raw:
        return None
    try:
        factor = float(raw)
    except ValueError:
        raise SystemExit(f"{FAULT_BYZANTINE_ENV} must be a number or nan, not {raw!r}") from None
    logger.warning("FAULT INJECTION (tests only): this node shares its gradients times %s", raw)
    return factor


def lazy_fault() -> bool:
    """Test-only fault injection (GPUSWARM_FAULT_LAZY=1): this node claims its batches without computing them
    (zero gradients), to play the lazy half of a colluding pair in end-to-end tests of refereed re-execution."""
    lazy = os.environ.get(FAULT_LAZY_ENV, "").strip() == "1"
    if lazy:
        logger.warning("FAULT INJECTION (tests only): this node claims batches it never computes")
    return lazy


def claim_inflation() -> float:
    """The test-only fault injection factor (GPUSWARM_FAULT_INFLATE_CLAIMS); 1.0 when unset."""
    raw = os.environ.get(FAULT_INFLATE_ENV, "").strip()
    if not raw:
        return 1.0
    try:
        factor = float(raw)
    except ValueError:
        factor = math.nan
    if not (math.isfinite(factor) and factor > 0):
        raise SystemExit(f"{FAULT_INFLATE_ENV} must be a positive number, not {raw!r}")
    logger.warning("FAULT INJECTION (tests only): this node inflates its own claims by %g", factor)
    return factor



def poison_outgoing_parts(factor: float) -> None:
    """Test-only (GPUSWARM_FAULT_BYZANTINE): from now on, in this process and the averager processes it forks, the
    tensor parts sent to other reducers in every all-reduce round are multiplied by `factor`; the part this node
    reduces itself and its local tensors are untouched, and it drops the non-finite results the others send back
    (their average minus its NaN part), so it keeps a finite model. Patches hivemind's `TensorPartContainer`."""
    import torch
    from hivemind.averaging import partition

    container = partition.TensorPartContainer
    send, take = container.iterate_input_parts_for, container.register_processed_part

    def poisoned(self, peer_index: int):
        parts = self._input_parts_by_peer[peer_index]
        self._input_parts_by_peer[peer_index] = deque((part * factor, info) for part, info in parts)
        return send(self, peer_index)

    def finite(self, peer_index: int, part_index: int, part):
        return take(self, peer_index, part_index, part if torch.isfinite(part).all() else torch.zeros_like(part))

    container.iterate_input_parts_for, container.register_processed_part = poisoned, finite
