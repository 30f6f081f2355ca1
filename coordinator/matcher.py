"""The matcher: a pure function from (jobs, nodes, now) to new assignments.

It owns the marketplace rules and nothing else: no I/O, no clock of its own (the caller passes `now`), no database
types. The coordinator builds the views from its tables, calls `match` and records what it returns.

Rules
- Liveness: a node is a candidate only while `now - last_seen <= liveness`.
- Capacity: a GPU node offers `resources.gpu_count` GPUs, a CPU-only node one slot. A node may host several jobs at
  once, but the GPUs (slots) held by its active assignments (`gpus_in_use`) plus those handed out in this pass
  never exceed its capacity. A job takes `spec.gpus_per_node` GPUs on each node it gets, and a node at most once.
- Requirements: every GPU of the node has at least `min_gpu_memory_gb` and, when `gpu_models` is set, is one of
  those models (case-insensitive). "Every", not "any": GPUs in use are counted per node, not per GPU, so a node's
  GPUs must be interchangeable for the job. A CPU-only node takes only jobs that allow CPU, need no GPU memory or
  model, and take one slot per node (`gpus_per_node == 1`). A `verified_only` job gets only nodes that passed the
  GPU challenge (`verified`), CPU nodes included. A job that runs its owner's own code (`spec.custom_code`) gets
  only nodes whose operator opted in to running such code (`resources.custom_code`); built-in workloads run on any.
  A federated job (`spec.local_dataset`) gets only nodes that hold that dataset (`resources.datasets`).
- Price: the node's ask (`price_per_gpu_hour`; per slot-hour for a CPU node) is at most the job's bid
  (`max_price_per_gpu_hour`; None takes any ask). A match clears at the node's ask: a pay-as-bid reverse auction,
  where each node is paid what it asked and the job never pays more than its bid.
- Budget: an unfunded job (`funded=False`, the owner cannot cover its budget) takes no node: a pending one does not
  start, and a running one neither grows nor replaces lost members until it is funded again.
- Fairness: open jobs (pending or running) are served one at a time, priced bids first, the highest bid first, then
  jobs without a bid (None ranks below every priced bid, as proto.models.JobSpec documents); within one bid, first
  come first served (`created_at`, then job id). A job takes all it wants (up to max_nodes) before the next job
  sees what is left, so a lower bid only gets a node that every higher bid eligible for it passed over: that job
  was full, or was pending and could not reach min_nodes even with that node.
- Elasticity and backfill: a pending job starts only when at least min_nodes candidates are free at once, and then
  takes up to max_nodes of them; otherwise it holds nothing, and later jobs may use the free nodes. A running job
  grows towards max_nodes and replaces lost members, whatever its count, with the lowest unused shard indexes.
  `num_shards` is always max_nodes.
- Ranking: a job takes its best candidates by the score below; equal scores go to the smaller node id.

Score (higher is better; natural-log scale, so +0.69 weighs as much as halving the ask):

    score = ln((bid + c) / (ask + c))                             c = PRICE_FLOOR = 0.1
          + W_REPUTATION * (reputation - 0.5)                     W_REPUTATION = 1.0
          + W_THROUGHPUT * clip(ln(throughput / median), ±ln 4)   W_THROUGHPUT = 0.5; unknown: 0
          + W_RTT * clip(ln(RTT_REF_MS / mean RTT), ±ln 4)        W_RTT = 0.5, RTT_REF_MS = 50; unknown: 0

- Price: how far the ask is below the job's bid, on a log scale; c keeps a free node from scoring infinitely. On a
  log scale the bid (for a job without one, any constant) shifts every candidate of a job by the same amount, so
  it never changes their order: that is what lets the matcher sort the nodes once per pass instead of once per
  job. `node_score` leaves the bid out for that reason.
- Reputation (0..1): reputation 1 beats reputation 0 unless the latter asks e (2.7) times less.
- Throughput (GFLOP/s from the challenge) is taken relative to the median of the live nodes' measurements; an
  unknown one counts as the median. It counts half: twice the median is worth an ask 1.41 times lower, because
  the challenge measures matrix products while training over the mesh is bound by bandwidth as much as compute.
- RTT: the mean of the known round-trip times between the candidate and the job's current members (either side's
  measurement). A job without members, or a candidate with no known RTT to them, gets 0. Nodes picked in the same
  pass do not count as members yet. The term is bounded by ±0.69 (MAX_RTT_BONUS): a close node beats one of
  unknown RTT at up to twice the ask (plus c), and a far one at up to four times, no more.

Cost: nodes with spare capacity are grouped by capability (CPU, or GPU models, smallest GPU memory; verified;
custom code allowed; datasets) and each group is sorted once by `node_score`, and once by ask. A job looks only at
the groups that meet its requirements and walks each from its best node, skipping nodes without room for its GPUs per
node (a union-find "next node with room" pointer per group and GPU count), until it has what it wants. When the bid
rules out most of the nodes a walk meets (late in a pass the cheap nodes are full), the walk falls back after a few
steps to the group's nodes sorted by ask, scanning only those within the bid. For a job with members, the few
candidates with a known RTT to them are found through the members' own RTT maps and an index of the candidates'
measurements to members, by member (built in one pass over the candidates' maps, for the members of the jobs that
want nodes), and scored apart; every other candidate's RTT term is 0, so the walks stay exact. A pass costs about
O(N log N) plus, per job, the groups and the nodes it looks at, instead of O(jobs x nodes). scripts/bench/market.py
measures it.
"""

from __future__ import annotations

import gc
import heapq
import math
import statistics
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from gpuswarm.proto.models import JobSpec, JobState, Requirements, Resources

PRICE_FLOOR = 0.1
W_REPUTATION = 1.0
W_THROUGHPUT = 0.5
W_RTT = 0.5
RTT_REF_MS = 50.0
_CLIP = math.log(4)
MAX_RTT_BONUS = W_RTT * _CLIP

OPEN_STATES = frozenset({JobState.PENDING, JobState.RUNNING})


@dataclass(frozen=True)
class NodeView:
    id: str
    resources: Resources
    price_per_gpu_hour: float  # the node's ask
    last_seen: float
    gpus_in_use: int = 0  # GPUs (for a CPU node, slots) already held by active assignments
    verified: bool = False  # passed the GPU challenge
    reputation: float = 0.5  # 0..1
    throughput: float | None = None  # GFLOP/s measured by the challenge; None: unknown
    rtt_ms: Mapping[str, float] = field(default_factory=dict)  # measured RTT to other node ids

    @property
    def capacity(self) -> int:
        return capacity(self.resources)


@dataclass(frozen=True)
class JobView:
    id: str
    spec: JobSpec
    state: JobState
    created_at: float
    members: frozenset[str] = frozenset()  # node ids with an active assignment in this job
    active_shards: frozenset[int] = frozenset()
    funded: bool = True  # False: the owner cannot cover the budget, so the job takes no node
    excluded: frozenset[str] = frozenset()  # node ids this job never takes again (banned from it)


@dataclass(frozen=True)
class Match:
    job_id: str
    node_id: str
    shard_index: int
    num_shards: int
    gpus: int = 1  # GPUs (slots) this assignment takes on the node
    price_per_gpu_hour: float = 0.0  # the clearing price: the node's ask (pay-as-bid reverse auction)


def _new_match(job_id: str, node_id: str, shard_index: int, num_shards: int, gpus: int, price: float) -> Match:
    """`Match(...)`, the same instance (the same fields in the same order), without the frozen dataclass's
    `__init__`: its six object.__setattr__ calls made a twentieth of a pass at 100,000 nodes."""
    match = object.__new__(Match)
    vars(match).update(job_id=job_id, node_id=node_id, shard_index=shard_index, num_shards=num_shards, gpus=gpus,
                       price_per_gpu_hour=price)
    return match


def capacity(resources: Resources) -> int:
    """GPUs a node offers; a CPU-only node offers one slot."""
    return resources.gpu_count or 1


def meets_requirements(resources: Resources, req: Requirements, gpus_per_node: int = 1) -> bool:
    if not resources.gpus:
        return req.allow_cpu and gpus_per_node == 1 and req.min_gpu_memory_gb == 0 and not req.gpu_models
    if resources.gpu_count < gpus_per_node:
        return False
    if min(g.memory_gb for g in resources.gpus) < req.min_gpu_memory_gb:
        return False
    if req.gpu_models:
        allowed = {m.casefold() for m in req.gpu_models}
        return all(g.model.casefold() in allowed for g in resources.gpus)
    return True


def eligible(node: NodeView, spec: JobSpec) -> bool:
    """Whether the node may ever serve the job: requirements, verification and price (not liveness or load)."""
    if spec.requirements.verified_only and not node.verified:
        return False
    if spec.custom_code and not node.resources.custom_code:
        return False
    if spec.local_dataset is not None and spec.local_dataset not in node.resources.datasets:
        return False
    bid = spec.max_price_per_gpu_hour
    if bid is not None and not node.price_per_gpu_hour <= bid:
        return False
    return meets_requirements(node.resources, spec.requirements, spec.gpus_per_node)


def job_priority(job: JobView) -> tuple:
    """Sort key: priced bids first, highest first; then no bid; FIFO within a bid, then by id."""
    bid = job.spec.max_price_per_gpu_hour
    return (bid is None, -(bid or 0.0), job.created_at, job.id)


def median_throughput(nodes: Iterable[NodeView]) -> float | None:
    known = [n.throughput for n in nodes if n.throughput is not None and n.throughput > 0]
    return statistics.median(known) if known else None


def _clip(x: float) -> float:
    return -_CLIP if x < -_CLIP else _CLIP if x > _CLIP else x


def node_score(node: NodeView, median: float | None) -> float:
    """The job-independent part of the score: ask, reputation and throughput (the bid term left out)."""
    # max(ask, 0.0) and min(max(reputation, 0.0), 1.0) without the calls (twice as fast, once per node and pass)
    ask, reputation = node.price_per_gpu_hour, node.reputation
    score = -math.log((0.0 if ask < 0.0 else ask) + PRICE_FLOOR)
    score += W_REPUTATION * ((0.0 if reputation < 0.0 else 1.0 if reputation > 1.0 else reputation) - 0.5)
    t = node.throughput
    if t is not None and t > 0 and median:
        score += W_THROUGHPUT * _clip(math.log(t / median))
    return score


def mean_rtt_ms(node: NodeView, members: Iterable[str], nodes_by_id: Mapping[str, NodeView]) -> float | None:
    """Mean of the known RTTs between `node` and `members`, from either side's measurement; None if none known."""
    total, count = 0.0, 0
    for m in members:
        rtt = node.rtt_ms.get(m)
        if rtt is None and (other := nodes_by_id.get(m)) is not None:
            rtt = other.rtt_ms.get(node.id)
        if rtt is not None and rtt >= 0:  # NaN and negative values count as unknown
            total += rtt
            count += 1
    return total / count if count else None


def rtt_bonus(mean_rtt: float | None) -> float:
    if mean_rtt is None:
        return 0.0
    return W_RTT * _clip(math.log(RTT_REF_MS / (1e-3 if mean_rtt < 1e-3 else mean_rtt)))  # max() without the call


class _Room:
    """The positions in a group's order whose node has at least `gpus` free: a union-find "next such position"."""

    __slots__ = ("parent", "count")

    def __init__(self, order: list[int], free: list[int], gpus: int):
        # A position without room points at the next one; the last position is a sentinel.
        self.parent = [pos if free[i] >= gpus else pos + 1 for pos, i in enumerate(order)]
        self.parent.append(len(order))
        self.count = sum(1 for i in order if free[i] >= gpus)

    def next(self, j: int) -> int:
        parent = self.parent
        while parent[j] != j:  # path halving: each position passed points two further on
            parent[j] = j = parent[parent[j]]
        return j

    def close(self, pos: int) -> None:
        self.parent[pos] = pos + 1
        self.count -= 1


class _Group:
    """Nodes of one capability, best `node_score` first, with a `_Room` per number of GPUs that jobs ask for."""

    __slots__ = ("order", "asks", "by_ask", "rooms", "is_cpu", "verified", "models", "min_memory", "custom_code",
                 "datasets", "head")

    def __init__(self, key: tuple, members: list[int], base: list[float], ask: list[float], plain: bool = False):
        """`members` in ascending order; `plain`: no NaN in `base` and `ask`, so one-float keys sort the same."""
        self.is_cpu, self.verified, self.models, self.min_memory, self.custom_code, self.datasets = key
        if plain:  # stable sorts: equal scores (asks) stay in ascending i
            self.order = sorted(members, key=base.__getitem__, reverse=True)
            self.by_ask = sorted(members, key=ask.__getitem__)
        else:
            self.order = sorted(members, key=lambda i: (-base[i], i))  # i is the node's rank by id
            self.by_ask = sorted(members, key=lambda i: (ask[i], i))
        self.asks = [ask[i] for i in self.by_ask]
        self.head = -base[self.order[0]]  # minus the best score in the group, room or not
        self.rooms: dict[int, _Room] = {}

    def serves(self, allow_cpu_slot: bool, min_memory: float, allowed: frozenset[str] | None,
               verified_only: bool, custom_code: bool, dataset: str | None) -> bool:
        if verified_only and not self.verified:
            return False
        if custom_code and not self.custom_code:
            return False
        if dataset is not None and dataset not in self.datasets:
            return False
        if self.is_cpu:
            return allow_cpu_slot
        return self.min_memory >= min_memory and (allowed is None or self.models <= allowed)

    def room(self, gpus: int, free: list[int]) -> _Room:
        if (room := self.rooms.get(gpus)) is None:
            room = self.rooms[gpus] = _Room(self.order, free, gpus)
        return room


def _capability(node: NodeView) -> tuple:
    gpus, custom, datasets = node.resources.gpus, node.resources.custom_code, _datasets(node.resources)
    if not gpus:
        return (True, node.verified, frozenset(), 0.0, custom, datasets)
    return (False, node.verified, frozenset(g.model.casefold() for g in gpus), min(g.memory_gb for g in gpus),
            custom, datasets)


_NO_DATASETS: frozenset[str] = frozenset()
_NO_RTTS: Mapping = {}


def _datasets(resources) -> frozenset[str]:
    return frozenset(resources.datasets) if resources.datasets else _NO_DATASETS


def _free_gpus(node: NodeView) -> int:
    """`node.capacity - node.gpus_in_use`, without the property calls (once per node and pass, 100,000 nodes)."""
    gpus = node.resources.gpus
    if not gpus:
        return 1 - node.gpus_in_use
    return ((gpus[0].count if len(gpus) == 1 else sum(g.count for g in gpus)) or 1) - node.gpus_in_use


def match(jobs: Iterable[JobView], nodes: Sequence[NodeView], now: float, *, liveness: float) -> list[Match]:
    # A pass allocates a few hundred thousand small objects and makes no reference cycles; with the collector on,
    # those allocations set off full collections over the caller's whole heap (at 100,000 node views, up to half a
    # second each). Reference counting frees everything the pass drops, so the collector waits until it returns.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _match(jobs, nodes, now, liveness)
    finally:
        if collecting:
            gc.enable()


def wants_nodes(job: JobView) -> bool:
    """Whether `match` would look for nodes for this job at all: it is open, funded, and short of members."""
    return job.state in OPEN_STATES and job.funded and _wanted(job)[1] > 0


def _wanted(job: JobView) -> tuple[list[int], int]:
    """The job's spare shards, and how many more nodes it can take."""
    spec = job.spec
    spare = [s for s in range(spec.max_nodes) if s not in job.active_shards]
    return spare, min(spec.max_nodes - max(len(job.members), len(job.active_shards)), len(spare))


def _match(jobs: Iterable[JobView], nodes: Sequence[NodeView], now: float, liveness: float) -> list[Match]:
    open_jobs = sorted((j for j in jobs if j.state in OPEN_STATES and j.funded), key=job_priority)
    wanting: list[tuple[JobView, list[int], int, int]] = []  # (job, spare shards, want, need), in priority order
    for job in open_jobs:
        spare, want = _wanted(job)
        if want > 0:
            current = max(len(job.members), len(job.active_shards))
            need = max(job.spec.min_nodes - current, 1) if job.state == JobState.PENDING else 1
            wanting.append((job, spare, want, need))
    if not wanting:
        return []
    market = _Market(nodes, now, liveness, [job for job, *_ in wanting])
    out: list[Match] = []
    for job, spare, want, need in wanting:
        spec = job.spec
        found = market.best(job, want, need)
        if len(found) < need:
            continue  # a pending job below min_nodes holds nothing (backfill)
        gpus, num_shards = spec.gpus_per_node, spec.max_nodes
        for i, shard in zip(found, spare, strict=False):
            market.take(i, gpus)
            out.append(_new_match(job.id, market.ids[i], shard, num_shards, gpus, market.ask[i]))
    return out


class _Market:
    """One pass's view of the nodes with capacity left, indexed by their rank by id (which breaks score ties)."""

    def __init__(self, nodes: Sequence[NodeView], now: float, liveness: float, wanting: list[JobView]):
        live = [n for n in nodes if now - n.last_seen <= liveness]
        median = median_throughput(live)
        # One loop over the live nodes, in the caller's order (the order they lie in memory: at 100,000 nodes,
        # visiting them by id costs cache misses), then every list put in id order at once. Most nodes have one
        # kind of GPU: the same capability key as _capability's, without building a set per node.
        found: list[NodeView] = []
        free: list[int] = []
        keys: list[tuple] = []
        one_model: dict[str, frozenset[str]] = {}
        for n in live:
            resources = n.resources
            gpus = resources.gpus
            if len(gpus) == 1:
                gpu = gpus[0]
                if (room := (gpu.count or 1) - n.gpus_in_use) <= 0:
                    continue
                if (models := one_model.get(gpu.model)) is None:
                    models = one_model[gpu.model] = frozenset((gpu.model.casefold(),))
                keys.append((False, n.verified, models, gpu.memory_gb, resources.custom_code,
                             _datasets(resources)))
            else:
                if (room := _free_gpus(n)) <= 0:
                    continue
                keys.append(_capability(n))
            found.append(n)
            free.append(room)
        ids = [n.id for n in found]
        asks = [n.price_per_gpu_hour for n in found]
        scores = [node_score(n, median) for n in found]
        by_id = sorted(range(len(found)), key=ids.__getitem__)  # ids are unique: no ties
        rank = [0] * len(found)  # rank[j]: the index of found[j] in id order
        for i, j in enumerate(by_id):
            rank[j] = i
        self.ids = ids = [ids[j] for j in by_id]
        self.free = [free[j] for j in by_id]
        self.ask = ask = [asks[j] for j in by_id]
        self.base = base = [scores[j] for j in by_id]
        self.index_of = dict(zip(ids, range(len(ids)), strict=True))
        by_capability: dict[tuple, list[int]] = {}
        for i, j in enumerate(by_id):
            if (members := by_capability.get(keys[j])) is None:
                by_capability[keys[j]] = [i]
            else:
                members.append(i)
        # A stable sort by one float keeps equal keys in index (id) order: the (key, id) order without tuples. NaN
        # breaks that equivalence (it compares false both ways), so a market with one sorts by the tuples.
        self.plain = plain = not any(map(math.isnan, base)) and not any(map(math.isnan, ask))
        self.neg = [-x for x in base]  # candidates rank by (-score, i): best first, ties to the smaller id
        self.groups = [_Group(key, idx, base, ask, plain) for key, idx in by_capability.items()]
        self.group_of = group_of = [0] * len(ids)
        self.position = position = [0] * len(ids)
        self.group_number = {id(grp): g for g, grp in enumerate(self.groups)}
        for g, grp in enumerate(self.groups):
            for pos, i in enumerate(grp.order):
                group_of[i] = g
                position[i] = pos
        self.serving: dict[tuple, tuple[list[tuple[_Group, _Room]], frozenset[int]]] = {}  # by (requirements, GPUs)
        # The RTTs measured to a member of a job that wants nodes, by member id: measured_to[m][i] is candidate i's
        # own measurement. Only the candidates in here or in a member's own map can have an RTT term; every other
        # candidate's term is 0.
        wanted = set().union(*(j.members for j in wanting))
        self.members_by_id = {n.id: n for n in nodes if n.id in wanted} if wanted else {}
        self.measured_to: defaultdict[str, dict[int, float]] = defaultdict(dict)
        if wanted:
            measured_to = self.measured_to
            for i, n in zip(rank, found, strict=True):
                rtt = n.rtt_ms
                for m in wanted.intersection(rtt):
                    measured_to[m][i] = rtt[m]

    def take(self, i: int, gpus: int) -> None:
        before = self.free[i]
        self.free[i] = after = before - gpus
        grp, pos = self.groups[self.group_of[i]], self.position[i]
        for needs, room in grp.rooms.items():
            if after < needs <= before:  # the node no longer has room for jobs that need this many GPUs
                room.close(pos)

    def best(self, job: JobView, want: int, need: int) -> list[int]:
        """The job's best `want` candidates, best first; fewer if there are not enough, and none if fewer than
        `need`. Exact, not a heuristic."""
        spec = job.spec
        req, gpus = spec.requirements, spec.gpus_per_node
        allowed = frozenset(m.casefold() for m in req.gpu_models) if req.gpu_models else None
        allow_cpu_slot = req.allow_cpu and gpus == 1 and req.min_gpu_memory_gb == 0 and allowed is None
        key = (allow_cpu_slot, req.min_gpu_memory_gb, allowed, req.verified_only, spec.custom_code,
               spec.local_dataset)
        if (serving := self.serving.get((key, gpus))) is None:
            groups = [grp for grp in self.groups if grp.serves(*key)]
            if self.plain:
                groups.sort(key=attrgetter("head"))  # the group with the best node first (see below)
            serving = self.serving[key, gpus] = ([(grp, grp.room(gpus, self.free)) for grp in groups],
                                                 frozenset(self.group_number[id(grp)] for grp in groups))
        groups, group_numbers = serving
        if sum(room.count for _, room in groups) < need:
            return []  # not enough nodes with room, whatever their price
        bid = math.inf if spec.max_price_per_gpu_hour is None else spec.max_price_per_gpu_hour
        found: list[tuple[float, int]] = []  # (-score, i): ascending is best first
        # Candidates with a known RTT to a member (`near`) score apart; the walks take every other candidate at its
        # base score. Once `want` candidates are found, the worst of them is a floor: a node scoring below it cannot
        # be among the best (one scoring the same still can, with a smaller id). Each group is sorted by score and
        # the groups by their best node, so the walks stop at the floor, and the first group whose best is below
        # it ends them all. (NaN scores compare false both ways: a market with one is walked whole.)
        skip = {i for m in job.members | job.excluded if (i := self.index_of.get(m)) is not None}
        near: set[int] = set()
        rtts: list[tuple[Mapping[int, float], Mapping[str, float]]] = []  # per member: (own, theirs), see below
        if job.members:
            index_get = self.index_of.get
            heard: list[Iterable[int | None]] = []
            for m in job.members:
                own = self.measured_to.get(m, _NO_RTTS)  # the candidates' measurements to m, by candidate
                theirs = member.rtt_ms if (member := self.members_by_id.get(m)) is not None else _NO_RTTS  # m's
                rtts.append((own, theirs))
                heard += (map(index_get, theirs), own)  # None: not a candidate
            near = set().union(*heard)
            near.discard(None)
            near -= skip
            skip |= near
        floor = math.inf
        for grp, room in groups:
            if grp.head > floor:
                break
            if got := self._walk(grp, room, want, gpus, bid, skip, floor):
                found += got
                found.sort()
                del found[want:]
                if len(found) == want and self.plain:
                    floor = found[-1][0]
        if near:
            # The RTT term adds at most MAX_RTT_BONUS: a near candidate whose base is further than that below the
            # floor cannot reach it, and only the others need their mean RTT (the slack: rounding never leaves out
            # one that reaches it). Without a floor (a market with a NaN has none) nothing is out of reach, and "not
            # above" keeps a NaN. A set, iterated in the order that ranks NaN scores as before.
            group_of, free, ask, neg, base, ids = self.group_of, self.free, self.ask, self.neg, self.base, self.ids
            reach = floor + MAX_RTT_BONUS + 1e-9
            able = {i for i in near
                    if group_of[i] in group_numbers and free[i] >= gpus and ask[i] <= bid and not neg[i] > reach}
            for i in able:
                # mean_rtt_ms: the candidate's own measurement first, over the members in the same order: same float
                total, count, node_id = 0.0, 0, ids[i]
                for own, theirs in rtts:
                    rtt = own[i] if i in own else theirs[node_id] if node_id in theirs else None
                    if rtt is not None and rtt >= 0:  # NaN and negative values count as unknown
                        total += rtt
                        count += 1
                found.append((-(base[i] + rtt_bonus(total / count if count else None)), i))
            found.sort()
            del found[want:]
        return [i for _, i in found]

    def _walk(self, grp: _Group, room: _Room, want: int, gpus: int, bid: float, skip: set[int],
              floor: float) -> list[tuple[float, int]]:
        """The group's first `want` candidates in score order that have room, are within the bid and not skipped,
        as (-score, i), none of them with -score above `floor`."""
        order, size = grp.order, len(grp.order)
        within_bid = size if bid == math.inf else bisect_right(grp.asks, bid)
        if within_bid == 0 or room.count == 0:
            return []
        ask, neg = self.ask, self.neg
        # Walking in score order wastes steps on nodes above the bid (late in a pass, when the cheap nodes are full,
        # most of those it meets); past `within_bid // 8` steps (a step costs about 8 times a scanned node), scanning
        # the nodes within the bid, sorted by ask, is cheaper, and the walk switches to it. (In a market with a NaN
        # the two can rank differently: it switches where it always did, at `within_bid`.)
        budget = (within_bid // 8 if self.plain else within_bid) if within_bid < size else size + 1
        steps = 0
        got: list[tuple[float, int]] = []
        parent = room.parent
        j = room.next(0)
        while j < size:
            i = order[j]
            if neg[i] > floor:
                return got
            if ask[i] <= bid and i not in skip:
                got.append((neg[i], i))
                if len(got) == want:
                    return got
            steps += 1
            if steps > budget:
                return _scan_within_bid(grp, within_bid, want, gpus, skip, self.free, neg)
            j += 1
            while parent[j] != j:  # room.next(j) inline (a call per node without room costs more than the loop)
                parent[j] = j = parent[parent[j]]
        return got


def _scan_within_bid(grp: _Group, within_bid: int, want: int, gpus: int, skip: set[int], free: list[int],
                     neg: list[float]) -> list[tuple[float, int]]:
    return heapq.nsmallest(want, [(neg[i], i) for i in grp.by_ask[:within_bid] if free[i] >= gpus and i not in skip])
