"""Byzantine-robust averaging: `dht.robust.robust_mean` alone, then inside real hivemind all-reduce rounds.

The rounds are four real DecentralizedAverager processes on a local DHT; one of them is the attacker, sending
its tensor scaled by -100 (a sign-flipped, huge update) or NaN. With `install_robust_reducer` every honest peer
ends within a small distance of the honest mean (a plain mean would put it 25 times the spread away, or at NaN),
and the reducers log the attacker's peer id.
"""

from __future__ import annotations

import json
import threading

import hivemind
import pytest
import torch
from gpuswarm.dht import hivemind_adapter as adapter
from gpuswarm.dht.robust import robust_mean
from hypothesis import given, settings
from hypothesis import strategies as st


def honest(n: int, numel: int = 512, spread: float = 0.01, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    center = torch.randn(numel, generator=g)
    return [center + spread * torch.randn(numel, generator=g) for _ in range(n)]


def test_honest_parts_average_to_about_their_mean():
    parts = honest(4)
    result = robust_mean(parts, [1.0] * 4)
    assert torch.allclose(result.value, torch.stack(parts).mean(0), atol=5e-3) and result.outliers == {}


@pytest.mark.parametrize("attack", ["scaled", "nan", "inf", "weight"])
def test_one_attacker_among_four_moves_the_result_by_at_most_its_clipped_share(attack):
    parts = honest(4)
    mean = torch.stack(parts[:3]).mean(0)
    weights = [1.0] * 4
    if attack == "scaled":
        parts[3] = -100 * parts[3]
    elif attack == "nan":
        parts[3] = parts[3].clone()
        parts[3][7] = float("nan")
    elif attack == "inf":
        parts[3] = torch.full_like(parts[3], float("inf"))
    else:  # an honest-looking tensor far away, with a weight that would buy a majority
        parts[3], weights[3] = parts[3] + 5.0, 1000.0
    result = robust_mean(parts, weights)
    spread = max(float((p - mean).norm()) for p in parts[:3])
    assert float((result.value - mean).norm()) < 2 * spread, "the attacker moved the result too far"
    assert set(result.outliers) == {3}


@settings(max_examples=60, deadline=None)
@given(st.integers(3, 8), st.floats(1.0, 1e6), st.integers(0, 10_000))
def test_a_single_attacker_is_bounded_however_far_it_goes(n, scale, seed):
    parts = honest(n, numel=64, seed=seed)
    mean = torch.stack(parts[1:]).mean(0)
    parts[0] = parts[0] * -scale
    result = robust_mean(parts, [1.0] * n)
    spread = max(float((p - mean).norm()) for p in parts[1:])
    assert torch.isfinite(result.value).all()
    assert float((result.value - mean).norm()) < 3 * spread


def test_an_honest_difference_is_no_outlier_when_the_others_agree_exactly():
    same = torch.zeros(64)
    result = robust_mean([same, same.clone(), same + 0.01, torch.full((64,), 0.02)], [1.0] * 4)
    assert result.outliers == {}


def test_two_senders_get_their_weighted_mean_less_any_non_finite_part():
    a, b = torch.ones(4), 3 * torch.ones(4)
    assert torch.allclose(robust_mean([a, b], [1.0, 3.0]).value, 2.5 * torch.ones(4))
    result = robust_mean([a, torch.full((4,), float("nan"))], [1.0, 1.0])
    assert torch.equal(result.value, a) and set(result.outliers) == {1}


# ---------------------------------------------------------------------------------------------------- real rounds


@pytest.mark.parametrize("attack", ["scaled", "nan"])
def test_a_real_round_of_four_with_one_attacker_stays_near_the_honest_mean(tmp_path, attack):
    log = tmp_path / "outliers.jsonl"
    adapter.install_robust_reducer(str(log))
    parts = honest(4, numel=20_000, spread=0.05)
    sent = [p.clone() for p in parts]
    if attack == "scaled":
        sent[3] = -100 * sent[3]
    else:
        sent[3][::3] = float("nan")
    first = hivemind.DHT(start=True)
    dhts = [first] + [hivemind.DHT(initial_peers=first.get_visible_maddrs(), start=True) for _ in range(3)]
    averagers = [hivemind.averaging.DecentralizedAverager(
        averaged_tensors=[t], dht=d, prefix="robust", target_group_size=4, min_group_size=4,
        min_matchmaking_time=2.0, request_timeout=1.0, start=True, **adapter.averager_options())
        for t, d in zip(sent, dhts, strict=True)]
    try:
        controls = [a.step(wait=False, timeout=60) for a in averagers]
        groups = [c.result(timeout=90) for c in controls]
        assert all(g is not None and len(g) == 4 for g in groups), groups
        honest_mean = torch.stack(parts[:3]).mean(0)
        spread = max(float((p - honest_mean).norm()) for p in parts[:3])
        for a in averagers[:3]:
            with a.get_tensors() as (tensor,):
                assert torch.isfinite(tensor).all()
                assert float((tensor - honest_mean).norm()) < 2 * spread
        attacker = str(dhts[3].peer_id)
        named = {json.loads(line)["peer_id"] for line in log.read_text().splitlines()}
        assert named == {attacker}, (named, attacker)
    finally:
        for a in averagers:
            threading.Thread(target=a.shutdown, daemon=True).start()
        for d in dhts:
            d.shutdown()
