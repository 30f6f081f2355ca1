"""Local updates with an outer optimizer (DiLoCo) on top of hivemind's averaging: the job mode "diloco".

Owns, for one training process: the worker's view of this node's inner parameters (the sandboxed trainer takes the
inner steps with the workload's own optimizer, on the job's device, and hands the parameters back every few seconds
of them: `INNER_CHUNK_SECONDS`), the pseudo-gradient handed to `hivemind.Optimizer` (which holds the anchor, i.e.
the swarm's parameters, and steps it with the outer SGD on the swarm's average), the choice of how many inner
steps a round takes, and the count of the swarm's samples that a stop rule's `max_epochs` reads
(`swarm_samples_after`, which mode "sync" uses too).

How the pseudo-gradient reaches hivemind 1.1.12 unchanged: its gradient averager sums what `.grad` holds at each
`step(batch_size=b)` call, scaled by b / (the epoch's first b) (optim/grad_averager.py:146-148), and divides the
sum by the number of calls when the round starts (load_accumulators_into_averager_). The worker calls it once per
chunk of inner steps, with the chunk's samples. Nobody knows in advance which call ends the epoch (the swarm's
sample count decides), so the k-th call of an epoch gets
k·δ_k − (k−1)·δ_{k−1} (δ_k = anchor − inner after the k-th chunk), rescaled by the inverse of hivemind's factor:
the sum telescopes to K·δ_K and hivemind's division leaves exactly δ_K, whichever call K ends the epoch. The
averaged δ (weighted by samples, as hivemind weighs peers) is the outer optimizer's gradient.

Every member of a round takes the same number of inner steps and then waits for the others (DiLoCo as published):
the members' claims then match, whatever their pace, and the ledger's throughput cap compares like with like. A
member that stepped on while its peers waited (in the lab, three nodes on two cores differ in pace by up to ten
times) claimed a multiple of their samples and was flagged as a liar. So that the members agree on the count
without another message, `group_pace` reads the pace from what every member of a round holds alike: the group's
signed claims.

`choose_inner_steps` is a pure function: a round's compute should be about three times its averaging, within
bounds, so that averaging costs about a quarter of the wall time whatever the link and the model, and a round of
several members is at most MAX_ROUND_PASSES passes over a member's share of the data (`round_steps_cap`). More
local steps per round would waste less time on the network but learn less per sample (scripts/bench/scaling.py
measured it: with a 10% share, rounds of 60 s made 2 nodes slower to the target than one). A job's only member
averages nothing and takes the longest rounds (`lone_inner_steps`), its last one cut short where the line through
its last two evaluations meets the stop rule's target (`steps_to_target`), and short ones from then on
(`lone_round_steps`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Mapping
from typing import Any

COMM_SHARE = 0.25  # the share of a round's wall time that averaging may take
MIN_INNER_STEPS = 4
MAX_INNER_STEPS = 1000
# Seconds: every round ends with an evaluation and hivemind's epoch bookkeeping, which must stay a small share
# however cheap the averaging.
MIN_ROUND_COMPUTE = 10.0
MAX_ROUND_COMPUTE = 30.0  # seconds: more local steps than this learn less per sample; metrics at least this often
# Passes over a member's share of the data that one round of several members may take (`round_steps_cap`): past
# that, each member fits its own shard and their average learns less per sample, however cheap the steps.
MAX_ROUND_PASSES = 8
# The most a round's compute may grow over the last one's (`group_pace`): one round slowed by a failure (an
# all-reduce's timeout, a state download) must not set the next round's length; a link that is slow for good
# reaches its rounds' length in a few rounds.
MAX_ROUND_GROWTH = 1.5
ASSUMED_MBIT = 50.0  # the link assumed before the first round is measured
# Seconds of inner steps per request to the trainer. Between requests the worker checks the stop flag and the
# job's wall-time limit, and tells hivemind's tracker how far it got (the swarm's round is due when the members'
# samples add up); each request costs one copy of the parameters out of the trainer (on a GPU, over PCIe).
INNER_CHUNK_SECONDS = 5.0
# Rounds between hivemind's background rounds that average the members' parameters themselves. After a whole round
# every member holds the same parameters (up to the compression's rounding of its peers' parts), so these only mend
# drift: a partial round (a peer lost mid-round), or rounding adding up. Each one sends the parameters uncompressed
# while the next round's inner steps run, and the next round waits for it to end; after every round (hivemind's
# default) they cost more of the link than the rounds themselves, and most found no group (seen in the lab).
STATE_AVERAGING_EVERY = 10


def lands_on_inner(outer) -> bool:
    """Whether the outer optimizer (a `proto.trainer.OptimizerSpec`) steps the anchor onto the inner parameters
    when the pseudo-gradient is this member's own: SGD at rate 1 without momentum or weight decay, the default of
    mode "diloco" and always that of "fedavg"."""
    return outer.name == "sgd" and outer.lr == 1.0 and outer.momentum == 0.0 and outer.weight_decay == 0.0


def first_round_estimate(parameter_count: int, matchmaking_time: float, members: int) -> float:
    """Seconds a round is expected to take before any is measured: matchmaking, then a butterfly all-reduce of
    the fp32 parameters at ASSUMED_MBIT."""
    members = max(members, 1)
    transfer = 2 * (members - 1) / members * parameter_count * 4 * 8 / (ASSUMED_MBIT * 1e6)
    return matchmaking_time + transfer


def choose_inner_steps(step_seconds: float, round_seconds: float, fixed: int | None = None,
                       share: float = COMM_SHARE) -> int:
    """Inner steps per round: `fixed` when the job says so; otherwise enough steps that the round's compute is
    (1 - share) / share times `round_seconds`, the round's time outside its inner steps (its averaging), bounded by
    MIN/MAX_ROUND_COMPUTE seconds and MIN/MAX_INNER_STEPS."""
    if fixed is not None:
        return fixed
    if not (step_seconds > 0 and math.isfinite(step_seconds)):
        return MIN_INNER_STEPS
    round_seconds = round_seconds if math.isfinite(round_seconds) and round_seconds > 0 else 0.0
    compute = round_seconds * (1 - share) / share
    return _steps_for(min(max(compute, MIN_ROUND_COMPUTE), MAX_ROUND_COMPUTE), step_seconds)


def lone_inner_steps(step_seconds: float) -> int:
    """Inner steps per round for a job's only member: MAX_ROUND_COMPUTE of them. Its rounds average nothing, so
    all a round buys is an evaluation (the stop rule's check, the owner's progress), and each costs the job's
    evaluation and hivemind's bookkeeping. Rounds of MIN_ROUND_COMPUTE made tinylm's lone member evaluate every 8
    steps under 0.4 CPU, where the plain loop it is compared with evaluates every 20 (docs/benchmarks.md)."""
    if not (step_seconds > 0 and math.isfinite(step_seconds)):
        return MIN_INNER_STEPS
    return _steps_for(MAX_ROUND_COMPUTE, step_seconds)


Evaluation = tuple[int, Mapping[str, float]]  # (samples this member had trained when it evaluated, the metrics)


def steps_to_target(targets: Iterable[tuple[str, str, float]], before: Evaluation | None, now: Evaluation,
                    batch_size: int) -> int | None:
    """Inner steps until the first of the stop rule's metric `targets` (name, "<=" or ">=", threshold) is met, on
    the straight line through the last two evaluations; None where no target's metric moved towards it.

    A lone member's rounds are long (`lone_inner_steps`), and a job stops only at a round's evaluation: the last
    round trained up to its whole length past the target (tinylm under 0.4 CPU: 31 steps, 20 s, that the owner paid
    for). Its last round is cut to this estimate instead. Learning slows as it goes, so the line is optimistic:
    a round cut short that misses the target is followed by another estimate, which costs an evaluation, not a
    round."""
    if before is None or now[0] <= before[0] or batch_size <= 0:
        return None
    estimates = []
    for name, op, threshold in targets:
        a, b = before[1].get(name), now[1].get(name)
        if a is None or b is None or not all(math.isfinite(v) for v in (a, b, threshold)):
            continue
        gain, left = (a - b, b - threshold) if op == "<=" else (b - a, threshold - b)
        if gain > 0 and left > 0:
            estimate = left / gain * (now[0] - before[0]) / batch_size
            if math.isfinite(estimate):  # a gain that is a subnormal float overflows to inf: no estimate
                estimates.append(estimate)
    return math.ceil(min(estimates)) if estimates else None


def lone_round_steps(full: int, estimate: int | None, near: bool, step_seconds: float) -> int:
    """A lone member's next round after an evaluation: `full` (its `lone_inner_steps`), cut to the `estimate` of
    `steps_to_target` when that is shorter. `near`: a round has been cut already, so the target is within about a
    round, and from then on no round is longer than MIN_ROUND_COMPUTE seconds of steps. Near the target the line is
    unreliable: tinylm's val_bpb stalls for tens of steps just above it (no line, or one that points far again).
    Without the bound, scripts/bench/scaling.py saw a member cut a round to 12 steps, then train a whole 54-step
    round (26 s of a 175-s run) past the target; in another run, cut to 15, then follow a line to 45."""
    steps = max(estimate, MIN_INNER_STEPS) if estimate is not None and estimate < full else full
    if near and step_seconds > 0 and math.isfinite(step_seconds):
        return min(steps, _steps_for(MIN_ROUND_COMPUTE, step_seconds))
    return steps


def _steps_for(compute: float, step_seconds: float) -> int:
    return max(MIN_INNER_STEPS, min(MAX_INNER_STEPS, math.ceil(compute / step_seconds)))


def round_steps_cap(train_size: int | None, batch_size: int, max_nodes: int) -> int | None:
    """The most inner steps a round of a job that may have several members takes: MAX_ROUND_PASSES passes over a
    member's share of the training set when the job is full (train_size / max_nodes), never below MIN_INNER_STEPS.
    None for a job of one node, or a workload that does not say its train_size. It reads only the job's spec and
    the workload, so every member sets the same cap (a count of members can differ between them for a moment).

    Why: the digits demo's steps take a few milliseconds, so rounds of MIN_ROUND_COMPUTE were MAX_INNER_STEPS long:
    67 passes over each member's 479 images. Averaged in one process (3 members, the job's outer SGD), such a round
    after a first one of 10 steps reached 0.9556 test accuracy after 67.5 data epochs; rounds of 120 steps (8
    passes) reached 0.9611 after 16.7, and a single round of 1000 steps 0.9472 after 66.8, short of the demo's
    0.95 within its max_epochs 60."""
    if not train_size or max_nodes < 2 or batch_size < 1:
        return None
    return max(MIN_INNER_STEPS, math.ceil(MAX_ROUND_PASSES * train_size / max_nodes / batch_size))


def next_inner_steps(fixed: int | None, group: tuple[float, float] | None, own: tuple[float, float],
                     whole: bool, last_whole: int | None, agreed: Callable[[], int | None],
                     most: int | None = None) -> int:
    """Inner steps for the next round, after a round whose group had `group` pace (`group_pace`; None when this
    node was alone) and held every live member (`whole`) or not.

    `own`: this node's seconds per inner step, and its rounds' seconds outside them (the optimizer step with any
    averaging, the evaluation, a checkpoint).
    - `fixed`: the job's count.
    - A whole group: `choose_inner_steps` from its pace (alike on every member). A lone member (the job's only
      one): `lone_inner_steps` from its `own` step time, as its rounds average nothing.
    - A group without every member (the swarm met in two groups, or this node missed the round): what the other
      members published for the next round (`agreed()`), else `last_whole`, the count chosen after the last whole
      round, which every member that took part in it holds alike. The groups then finish their next shares
      together and meet again; a count of their own, from each group's pace, would keep them apart for good (seen
      in the lab: four nodes that met in two pairs at one round stayed two pairs of diverging models to the end).
      The published count comes first because the members need not agree on whether a round was whole: a follower
      whose join timed out takes the round alone while its leader counts the group it assembled as whole, sets a
      new count from that group's pace and publishes it (seen in the lab with two nodes: 22 against 18 inner
      steps, and four rounds apart).
    - None of these (this node never took part in a whole round, and nobody published): the group's pace, else its
      own timing.
    Every count but the job's own and a lone member's is at most `most` (`round_steps_cap`)."""
    if fixed is not None:
        return fixed
    if whole and not group:
        return lone_inner_steps(own[0])
    steps = choose_inner_steps(*group) if whole else agreed() or last_whole or choose_inner_steps(*(group or own))
    return steps if most is None else min(steps, most)


def group_samples(claims: Iterable[Mapping[str, Any]]) -> int:
    """The samples a round's group trained on: the sum of its members' claimed samples (claim payloads)."""
    return sum(n for claim in claims if isinstance(n := claim.get("samples"), int) and not isinstance(n, bool)
               and n > 0)


def swarm_samples_after(before: int, epochs: int, target: int, averaged: int | None = None,
                        published: int | None = None) -> int:
    """The samples the swarm has trained on once this member's epoch moved on by `epochs` from a count of
    `before` (the data passes a stop rule's max_epochs counts).

    A member that loaded the swarm's state from a peer takes what the others published on reaching that epoch
    (`published`), never less than it had. Counting the epochs it skipped at its own round target would count them
    at its inner steps, not theirs: seen in the demo, a member that had set 1000 inner steps while the others took
    62 counted 96,000 samples for one skipped round, passed max_epochs and stopped the job short of its accuracy
    target. Otherwise: the averaged round's samples (`averaged`, its group's claims; `target` for a round this
    member took alone), and `target` for each further epoch."""
    if published is not None:
        return max(before, published)
    return before + (target if averaged is None else averaged) + target * (epochs - 1)


def group_pace(claims: Iterable[Mapping[str, Any]]) -> tuple[float, float] | None:
    """(step seconds, averaging seconds) of a round's group, from its members' claim payloads (what every member
    holds alike, so every member computes the same pace): the median member's seconds per step, and the least time
    any member spent outside its compute (the slowest member's share of its window: the round's averaging). None
    without a claim that took a step. One lying member moves the step time no further than an honest member's, and
    can shorten the averaging it reads to none: rounds then take MIN_ROUND_COMPUTE of compute, no less.

    The averaging read is at most what makes the next round's compute MAX_ROUND_GROWTH times the median member's
    in this one. A claim's window reaches back to the member's last claim, so after a failed round it holds that
    round's timeout and any state download too: seen in the lab, 11.8 s of "averaging" after a failed 2-node round
    (1-3 s before it) made the next round 85 inner steps instead of about 30, past the stop rule's target."""
    steps, computes, idle = [], [], []
    for claim in claims:
        n, compute = claim.get("steps", 0), claim.get("compute_seconds", 0.0)
        window = claim.get("window_end", 0.0) - claim.get("window_start", 0.0)
        if isinstance(n, int) and n > 0 and all(isinstance(v, int | float) and math.isfinite(v)
                                                for v in (compute, window)) and compute > 0:
            steps.append(compute / n)
            computes.append(compute)
            idle.append(max(0.0, window - compute))
    if not steps:
        return None
    most = MAX_ROUND_GROWTH * statistics.median(computes) * COMM_SHARE / (1 - COMM_SHARE)
    return statistics.median(steps), min(min(idle), most)


class LocalUpdates:
    """The worker's side of DiLoCo's inner loop. `anchor` are the parameters hivemind's optimizer owns (and
    averages); `params` the inner copy (views of one flat tensor, `flat`), which the trainer's inner steps move.
    After each chunk of them, `advance` leaves this call's share of the pseudo-gradient in the anchor's `.grad`;
    `restart` follows the anchor after it moved (an outer step, or state loaded from a peer)."""

    def __init__(self, anchor) -> None:
        import torch

        self.anchor = list(anchor)
        self.flat = torch.cat([p.detach().reshape(-1) for p in self.anchor])
        self.params = [chunk.view(p.shape) for chunk, p in
                       zip(self.flat.split([p.numel() for p in self.anchor]), self.anchor, strict=True)]
        self.scaled_previous = [torch.zeros_like(p) for p in self.anchor]  # (k-1)·δ_{k-1}
        for param in self.anchor:
            param.grad = torch.zeros_like(param)
        self.calls = 0
        self.first_batch: int | None = None

    def advance(self, batch_size: int) -> None:
        """The inner parameters moved by a chunk of `batch_size` samples: k·δ_k − (k−1)·δ_{k−1}, rescaled for
        hivemind's batch weighting, into the anchor's `.grad` (see the module docstring)."""
        import torch

        self.calls += 1
        if self.first_batch is None:
            self.first_batch = batch_size
        k, rescale = self.calls, self.first_batch / batch_size
        with torch.no_grad():
            for anchor, inner, previous in zip(self.anchor, self.params, self.scaled_previous, strict=True):
                scaled = torch.sub(anchor, inner).mul_(k)
                torch.sub(scaled, previous, out=anchor.grad).mul_(rescale)
                previous.copy_(scaled)

    def land_on_inner(self) -> None:
        """After a round this member took alone, with an outer step that is anchor − 1·(anchor − inner) (see
        `lands_on_inner`): the anchor takes the inner parameters bit for bit. The telescoped pseudo-gradient and
        hivemind's division leave the outer step's result off by float rounding (1.5e-8 in a unit test), and the
        trainer, which takes the anchor after every round, would then start each round from parameters a rounding
        away from its own: enough to make a lone member's run a different run from the plain loop's on the same
        data, seed and optimizer (tinylm after 264 steps: parameters up to 0.5 apart; decision 0044)."""
        import torch

        with torch.no_grad():
            for anchor, inner in zip(self.anchor, self.params, strict=True):
                anchor.copy_(inner)

    def restart(self) -> None:
        """The anchor moved: the inner parameters start again from it (the trainer's optimizer keeps its state)."""
        import torch

        with torch.no_grad():
            for anchor, inner, previous in zip(self.anchor, self.params, self.scaled_previous, strict=True):
                inner.copy_(anchor)
                previous.zero_()
        self.calls, self.first_batch = 0, None
