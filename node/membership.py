"""A run's membership as one training worker sees it (`gpuswarm.node.worker`): this member's signed record in the
run's membership key and its place (hence its data shard) among the live members, the proof that lets its
records through every peer's validators, and the waits that keep members in step: the rendezvous of `min_nodes`,
hivemind's progress tracker seeing them, and a local-updates member holding after its share of a round. The record
also carries the inner steps the member takes in its current round, so that a member that was not in the group's
last round (it joined late, or its round failed) takes as many as the others (`agreed_steps`), and tells a member
whose round failed whether any other has reached its epoch (`level_with`) and, once it loaded that state, how many
samples the swarm had trained on by then (`published_samples`).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import logging
import statistics
import threading
import time
from collections.abc import Callable

from gpuswarm.proto.dht import MEMBERS_SUFFIX

RENDEZVOUS_TIMEOUT = 60.0
MEMBER_TTL = 20.0  # a member's record in the run's membership key lives this long unless refreshed
MEMBER_REFRESH = 5.0
ROUND_WAIT = 60.0  # seconds a member that took its round's share of steps waits at most for the others
# How often hivemind's progress tracker reads the swarm's progress from the DHT, at most: while a member waits (for
# the others' shares of a round, or for its peers at the start), every second, so it starts the round within a
# second of the last share; while it computes its own share nothing waits on the read, so hivemind's default of
# 10 s (it reads sooner as its estimate of the round's end nears). Each read is DHT requests across the mesh: in a
# 2-node tinylm run, reading every second cost each node 3.5 CPU-s per 30 s in wireguard-go, p2pd and the worker's
# DHT, against 2.5 s at 10 s (a tenth of its 0.4 CPU quota; decision 0036).
REFRESH_WAITING = 1.0
REFRESH_COMPUTING = 10.0
logger = logging.getLogger("gpuswarm.worker")


class RecordProofs:
    """This training process's proof for the run's DHT records (`gpuswarm.proto.dht`): a session key of its own,
    bound by the daemon (which holds the node's key and the coordinator's newest run ticket) to the subkeys this
    process writes under: the node id (members), the DHT's peer id (averagers) and hivemind's RSA key (progress).
    `refresh` asks the daemon again and hands a renewed proof to the DHT's process when one is due; without a
    proof, no peer accepts this process's records. `daemon` is the worker's `DaemonSigner`."""

    def __init__(self, dht, daemon, authority: str, node_id: str):
        from gpuswarm.dht import hivemind_adapter
        from gpuswarm.dht.validators import new_session_key
        from hivemind.dht.crypto import RSASignatureValidator

        self.dht, self.daemon, self.authority = dht, daemon, authority
        self.session = new_session_key()
        self.subkeys = [hivemind_adapter.pack(s) for s in (node_id, dht.peer_id.to_bytes(),
                                                           RSASignatureValidator().local_public_key)]
        self.proof = None

    def refresh(self) -> None:
        from gpuswarm.dht.validators import SwarmRecordValidator, WriterProof, renewal_due
        from gpuswarm.proto.signing import SignedEnvelope

        answer = self.daemon.request("bind", session_key=self.session[1],
                                     subkeys=[base64.b64encode(s).decode() for s in self.subkeys])
        cert = SignedEnvelope.model_validate(answer["cert"])
        if renewal_due(self.proof, cert):
            self.proof = WriterProof(cert, SignedEnvelope.model_validate(answer["binding"]), self.session[0])
            self.dht.add_validators([SwarmRecordValidator(self.authority, self.proof)])


class Membership:
    """This member's record in the run's membership key, and its place among the run's live members.

    Each member refreshes its own record (a short TTL), so a member that died drops out within `MEMBER_TTL`. The
    sorted live node ids give every member its place, hence its data shard; the shards change when members come
    and go. After the rendezvous a helper thread does the DHT calls and keeps the place current, so the training
    thread never waits on the DHT for it (a slow lookup would hold this member back in every round)."""

    def __init__(self, dht, run_id: str, node_id: str, proofs: RecordProofs | None = None, share: int | None = None):
        self.dht, self.key, self.node_id, self.proofs = dht, run_id + MEMBERS_SUFFIX, node_id, proofs
        # Mode "fedavg": the samples of this member's round (its own data's passes), published with its record so
        # that every member sets the round's total alike although the members' data differ in size.
        self.share = share
        # (epoch, inner steps, the swarm's samples by then as this member counts them) of its current round
        self.pace: tuple[int, int, int | None] | None = None
        self._place, self._shares, self._paces = (0, 1), {}, {}
        self._wake = threading.Event()

    def refresh(self) -> None:
        from hivemind.utils import get_dht_time

        value = time.time() if self.share is None and self.pace is None else [time.time(), self.share,
                                                                                *(self.pace or ())]
        self.dht.store(self.key, subkey=self.node_id, value=value, expiration_time=get_dht_time() + MEMBER_TTL)

    def members(self) -> dict[str, tuple[int | None, tuple[int, int, int | None] | None]]:
        """The live members' ids, with the share and the (epoch, inner steps, swarm samples) each published (None:
        none)."""
        found = self.dht.get(self.key, latest=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        members = {}
        for subkey, entry in entries.items():
            value = getattr(entry, "value", None)
            # [time, share] or [time, share, epoch, steps, swarm samples]; [time, share, epoch, steps] from an
            # earlier version, which counted no samples.
            value = value if isinstance(value, list | tuple) and len(value) in (2, 4, 5) else [None, None]
            share = value[1] if _whole(value[1], 2**40) else None
            counted = value[4] if len(value) == 5 and _whole(value[4], 2**62, least=0) else None
            pace = (value[2], value[3], counted) if len(value) >= 4 and _whole(value[2], 2**62, least=0) and \
                _whole(value[3], 10**6) else None
            members[str(subkey)] = share, pace
        members[self.node_id] = self.share, self.pace
        return dict(sorted(members.items()))

    def look(self) -> tuple[int, int]:
        members = self.members()
        self._place = list(members).index(self.node_id), len(members)
        self._shares = {node: share for node, (share, _) in members.items()}
        self._paces = {node: pace for node, (_, pace) in members.items() if pace is not None and node != self.node_id}
        return self._place

    def publish_pace(self, epoch: int, inner_steps: int, swarm_samples: int | None = None) -> None:
        """Tell the others, with this member's record (refreshed now, from the helper thread), how many inner steps
        it takes in the round of `epoch`, and how many samples the swarm had trained on when it reached that epoch
        (what a member that loads this state counts on from: `published_samples`)."""
        self.pace = epoch, inner_steps, swarm_samples
        self._wake.set()

    def agreed_steps(self, epoch: int) -> int | None:
        """The inner steps the other members published for the round of `epoch` (looked up now; the most common
        count, the larger on a tie), or None when none did."""
        self.look()
        counts = collections.Counter(steps for e, steps, _ in self._paces.values() if e == epoch)
        return max(counts, key=lambda steps: (counts[steps], steps)) if counts else None

    def published_samples(self, epoch: int) -> int | None:
        """The swarm's samples the other members counted on reaching `epoch` (looked up now; the lower median, so
        among three or more that publish, one that lies cannot move it past the honest ones), or None when none
        published that epoch."""
        self.look()
        found = [n for e, _, n in self._paces.values() if e == epoch and n is not None]
        return int(statistics.median_low(found)) if found else None

    def level_with(self, epoch: int) -> bool:
        """Whether another member has published a round of `epoch` or later (looked up now): its state is as new as
        this member's, so a download from it is not refused as behind."""
        self.look()
        return any(e >= epoch for e, _, _ in self._paces.values())

    def round_samples(self, share: int) -> int:
        """The samples of a round across the live members, as last seen: the shares they published (`share`, this
        member's, for any that published none)."""
        return sum(s or share for s in self._shares.values()) if self._shares else share

    def place(self) -> tuple[int, int]:
        """(index, count): this member's place among the live members, as last seen."""
        return self._place

    def wait_for(self, min_nodes: int, stop: threading.Event) -> int | None:
        """Hold training until `min_nodes` members have checked in, so a fast first node does not finish the job
        alone before its peers arrive; the members then counted (None: they did not arrive in time). A node joining
        a run in progress finds the others and goes straight on (and then loads the current state from a peer)."""
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT
        refreshed, count = 0.0, 0
        while not stop.is_set() and time.monotonic() < deadline:
            if time.monotonic() - refreshed >= MEMBER_REFRESH:
                self.refresh()
                refreshed = time.monotonic()
            count = self.look()[1]
            if count >= min_nodes:
                return count
            time.sleep(0.5)
        logger.warning("only %d of %d members arrived within %.0fs; training anyway", count, min_nodes,
                       RENDEZVOUS_TIMEOUT)
        return None

    def keep_fresh(self, stop: threading.Event) -> threading.Thread:
        """Refresh this member's record and its place from a thread until `stop`."""
        def loop() -> None:
            while not stop.is_set():
                due = time.monotonic() + MEMBER_REFRESH
                while not (stop.wait(0.1) or self._wake.is_set()) and time.monotonic() < due:
                    pass
                self._wake.clear()
                if stop.is_set():
                    return
                try:
                    if self.proofs is not None:
                        self.proofs.refresh()
                    self.refresh()
                    self.look()
                except Exception as e:  # noqa: BLE001 - a DHT hiccup; the next round tries again
                    logger.debug("membership refresh failed: %r", e)

        thread = threading.Thread(target=loop, name="membership", daemon=True)
        thread.start()
        return thread


def _whole(value, most: int, least: int = 1) -> bool:
    """An int (not a bool) in [least, most]: what a member's record may carry, whatever another member wrote."""
    return isinstance(value, int) and not isinstance(value, bool) and least <= value <= most


def wait_for_tracker(optimizer, min_nodes: int, stop: threading.Event) -> None:
    """After the first local step, hold training until hivemind's progress tracker sees `min_nodes` peers.

    A node that trains before its tracker has seen the others believes it is alone and races through epochs on
    its own, scheduling and cancelling averaging rounds in quick succession; in hivemind 1.1.12 that can leave the
    matchmaker wedged ("another look_for_group is already in progress"), and every later round then fails. The
    tracker publishes a peer only once it has accumulated samples, hence one step first.

    A job that may run with one member (`min_nodes` 1) waits only for the tracker's next read of the swarm's
    progress, whatever it finds: that read shows the peers already in the run, if any. Waiting to see a peer there
    meant waiting for this node's own record (a store and another read: 3.2 s of a lone digits job's 22 s under the
    scaling bench's 0.4 CPU), which tells it nothing about the others."""
    tracker, deadline = optimizer.tracker, time.monotonic() + RENDEZVOUS_TIMEOUT
    with reading_often(tracker):
        last_read = tracker.global_progress  # each read of the swarm's progress replaces it
        while not stop.is_set() and time.monotonic() < deadline:
            progress = tracker.global_progress
            if progress.num_peers >= min_nodes or (min_nodes <= 1 and progress is not last_read):
                return
            time.sleep(0.05)
    logger.warning("the progress tracker saw %d of %d peers; training anyway", tracker.global_progress.num_peers,
                   min_nodes)


def wait_for_round(optimizer, stop: threading.Event, target: Callable[[], int] | None = None,
                   limit: float = ROUND_WAIT) -> None:
    """Local updates: this member has taken its share of the round's steps. Hold it until every live member's
    share is in (the swarm's samples reached the round's `target()`, re-read as members come and go), a round
    elsewhere moved the swarm's epoch on, or `limit` seconds passed. A member that stepped on would claim a
    multiple of its waiting peers' samples, which the ledger's throughput cap cannot tell from a liar's; one that
    started the round before the others were done would find no group, and take that round alone.

    hivemind's own trigger (`ready_to_update_epoch`) also fires at its estimate of the round's end, extrapolated
    from each peer's last reported rate: with inner steps in bursts of a few seconds that estimate ran ahead of the
    members' real progress. So this waits for the samples themselves, or for what says they are in sooner: the round
    this member scheduled when its share was done found its whole group (`optimizer.due_if_group_full()`: every
    member schedules only then; hivemind_adapter.optimizer_class, decision 0043). The step after the wait begins the
    round."""
    tracker, deadline = optimizer.tracker, time.monotonic() + limit
    with adding_nothing(tracker), reading_often(tracker):
        while not stop.is_set() and time.monotonic() < deadline:
            if target is not None:
                tracker.target_batch_size = target()
            if tracker.global_progress.samples_accumulated >= tracker.target_batch_size \
                    or tracker.global_epoch > optimizer.local_epoch or optimizer.due_if_group_full():
                return
            time.sleep(0.05)


@contextlib.contextmanager
def reading_often(tracker):
    """While a member waits, its tracker reads the swarm's progress every REFRESH_WAITING seconds, starting now (its
    last read may be up to REFRESH_COMPUTING old); afterwards as often as before."""
    from hivemind.utils import get_dht_time

    before, tracker.max_refresh_period = tracker.max_refresh_period, REFRESH_WAITING
    # The tracker's fetcher sleeps until the next read it planned, or until this event: it then re-reads the time
    # of that read, which is now.
    tracker.global_progress.next_fetch_time = get_dht_time()
    tracker.global_state_updated.set()
    try:
        yield
    finally:
        tracker.max_refresh_period = before


def leave_last_record(tracker) -> None:
    """A finished run's member puts its last progress record back in the DHT after hivemind's tracker shut down,
    which replaced it with None. The coordinator's ledger reads the epoch a run reached from these records every
    5 s, and the members of a run that meets its stop rule right after a round all shut down within a second or
    two of it: without the records, the last epochs were never seen, and honest claims for them were flagged at
    settlement as attested for epochs the swarm never reached (the CI run of 2026-12-02: a job that completed at
    step 1 settled with the DHT's epoch at 0). The record expires as hivemind's do (`metadata_expiration`); only
    a member whose run is over leaves it, since a live run's trackers would count it as a peer."""
    from hivemind.utils import get_dht_time

    try:
        # Later than the None's expiration, so it replaces it wherever the None arrived first.
        tracker.dht.store(tracker.training_progress_key, subkey=tracker._local_public_key,
                          value=tracker.local_progress.dict(),
                          expiration_time=get_dht_time() + tracker.metadata_expiration, return_future=True
                          ).result(timeout=5.0)
    except Exception as e:  # noqa: BLE001 - the run is over either way; the ledger then has the epochs it read
        logger.warning("could not leave this member's last progress record in the DHT: %s", e)


@contextlib.contextmanager
def adding_nothing(tracker):
    """While a member waits for its round, it tells the swarm that it adds no samples: hivemind's tracker
    extrapolates every peer's samples at the rate the peer last reported, and a member whose inner steps run in a
    few bursts reports a high one, so the others' trackers would take the round as due while they are still on
    their share, and schedule their matchmaking too early."""
    ema = tracker.performance_ema
    rate = ema.samples_per_second
    ema.samples_per_second = ema.eps
    progress = tracker.local_progress
    tracker.report_local_progress(progress.epoch, progress.samples_accumulated)
    try:
        yield
    finally:
        ema.samples_per_second = rate
        ema.reset_timer()  # the wait is no part of the next batch's time

