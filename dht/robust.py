"""Byzantine-robust aggregation of one tensor part: what an all-reduce round's reducer computes instead of a mean.

A plain weighted mean lets one peer move everyone's model anywhere: a NaN, an update scaled by -100, or an
inflated weight reaches every member. `robust_mean` bounds what any one peer can do:
- parts with NaN or Inf are dropped (and their senders named);
- each weight is capped at twice the median weight, so no peer buys a majority by claiming more samples;
- centered clipping (Karimireddy, He and Jaggi, "Learning from History for Byzantine Robust Optimization",
  ICML 2021): start from the coordinate-wise median and repeat v <- v + sum_i w_i (x_i - v) min(1, tau / |x_i - v|).
  A peer's pull on the result is at most its weight times tau, however far it sits. tau is `TAU_FACTOR` times the
  median distance of the parts from the median, so it follows the honest peers' own spread;
- a sender whose part ends further than `OUTLIER_FACTOR` x tau from the result is named as an outlier, and only
  when that is also far in absolute terms (`NAME_FLOOR` of the parts' median norm): when most senders agree
  exactly (a layer whose gradients are all zero), tau is about 0 and any honest difference would look infinite.
With two senders or fewer nothing can be told apart: their weighted mean is returned (non-finite parts still go).

Pure torch, no hivemind: `dht.hivemind_adapter.RobustPartReducer` runs it inside hivemind's all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ITERATIONS = 8
TAU_FACTOR = 2.0
OUTLIER_FACTOR = 8.0
NAME_FLOOR = 0.05
WEIGHT_CAP = 2.0  # times the median weight


@dataclass
class Aggregate:
    value: torch.Tensor
    outliers: dict[int, str] = field(default_factory=dict)  # sender index: why it was left out or clipped


def robust_mean(parts: list[torch.Tensor], weights: list[float]) -> Aggregate:
    """The robust average of one part from each sender (same shape), with the senders that misbehaved."""
    outliers = {i: "sent NaN or Inf" for i, p in enumerate(parts) if not bool(torch.isfinite(p).all())}
    good = [i for i in range(len(parts)) if i not in outliers]
    if not good:
        return Aggregate(torch.zeros_like(parts[0]), outliers)
    xs = torch.stack([parts[i].float().reshape(-1) for i in good])
    w = torch.tensor([max(0.0, float(weights[i])) if weights[i] == weights[i] else 0.0 for i in good])
    w = torch.minimum(w, WEIGHT_CAP * w.median()) if len(good) > 2 else w
    w = w / w.sum() if float(w.sum()) > 0 else torch.full_like(w, 1.0 / len(good))
    if len(good) <= 2:
        value = (w[:, None] * xs).sum(0)
    else:
        value = xs.median(dim=0).values
        tau = TAU_FACTOR * float((xs - value).norm(dim=1).median())
        if tau > 0:
            for _ in range(ITERATIONS):
                delta = xs - value
                scale = (tau / delta.norm(dim=1).clamp_min(1e-30)).clamp(max=1.0)
                value = value + (w[:, None] * delta * scale[:, None]).sum(0)
        distances = (xs - value).norm(dim=1)
        threshold = OUTLIER_FACTOR * max(tau, NAME_FLOOR * float(xs.norm(dim=1).median()))
        if threshold > 0:
            for k, i in enumerate(good):
                far = float(distances[k])
                if far > threshold:
                    outliers[i] = f"{far:.3g} from the robust mean, {far / threshold:.0f} x the outlier threshold"
    return Aggregate(value.reshape(parts[0].shape).to(parts[0].dtype), outliers)
