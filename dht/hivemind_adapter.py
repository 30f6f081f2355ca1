"""The one place gpuswarm reaches past hivemind's public API. Written against hivemind 1.1.12 (`PINNED_VERSION`);
tests/dht/test_hivemind_adapter.py pins that version and runs every function here against a real local DHT, so an
upgrade that moves any of these fails there, loudly, instead of in an operator's `gpuswarm dht` output.

What is used, and why:
- `hivemind.dht.routing.DHTID.generate(source=key).to_bytes()` (`key_id`): the 20-byte hash a key is stored
  under. Record validators receive only that hash (`DHTRecord.key`), and a local peer's records are keyed by it.
- `hivemind.utils.MSGPackSerializer` (`pack`, `unpack`): how hivemind encodes subkeys and values inside raw
  records. A validator receives raw bytes, and the signature checks of `gpuswarm dht get` need them too.
- `DHTNode.protocol.cache` / `.storage` (DHTLocalStorage) and `hivemind.dht.storage.DictionaryDHTValue`
  (`cached_record`, `local_records`): the raw records a lookup left in the local peer. `DHT.get` returns values
  with their RSA signatures stripped, so signature checks must read the records from here.
- `DHTNode.protocol.routing_table.peer_id_to_uid` (`routing_peers`) and `DHTNode.protocol.call_ping` (`ping`):
  the peers a DHT node routes through, and a single timed ping, for `gpuswarm dht peers`.
- `RSASignatureValidator`'s record layout (`rsa_owner`, `check_rsa_record`): an "[owner:<RSA public key>]" marker
  in the key or subkey makes a record protected, and its value carries the signature; hivemind's ProgressTracker
  publishes its records this way. The validator's `validate` and `strip_value` are its public interface; the
  record they take is rebuilt here from the raw parts.
- The key names hivemind derives from a run id (`HIVEMIND_RUN_KEY_SUFFIXES`): hivemind.Optimizer's progress key,
  and its gradient and state averagers' matchmaking (`<prefix>.0b`: the Optimizer's averagers start with empty
  group bits and keep them) and state-download (`<prefix>.all_averagers`) keys. A DHT cannot list its keys, so
  `gpuswarm dht ls` must name them.

- `hivemind.compression.serialization._BASE_COMPRESSION_TYPES` (`fix_8bit_codecs`): the codec a received tensor is
  decoded with, by compression type. hivemind 1.1.12's 8-bit codecs read their codebook size with `int()` of a
  one-element array, which NumPy 2.x refuses (TypeError): every 8-bit round then ends with half its parts missing
  ("Reducer: received 50.0% of input tensors"). The fix registers the same codecs with that one read corrected.
- `hivemind.Optimizer._maybe_schedule_gradient_averaging` and `_maybe_schedule_state_averaging` (`optimizer_class`):
  the Optimizer starts matchmaking ahead of a round it expects soon, even when no other peer is in the run. A lone
  member then spends the matchmaking time (seconds of CPU in its averager, DHT and p2pd) looking for a group that
  cannot exist; the subclass schedules ahead only while the tracker sees other peers, and gradient rounds never
  when the worker asks it not to (local updates).
- `hivemind.Optimizer._begin_averaging_gradients` (`optimizer_class`): it skips a round's averaging when the last
  round's control is still in `scheduled_grads`; the subclass drops that control first.
- `Optimizer.scheduled_grads`, `StepControl.stage` and `.scheduled_time`, and the tracker's
  `global_progress.eta_next_epoch` (`optimizer_class`: `schedule_round_now`, `due_if_group_full`,
  `drop_round_looking`): a local-updates round is scheduled by the worker, and begun as soon as its group is full.
- `hivemind.Optimizer._make_gradient_averager` (`optimizer_class`): it drops the Optimizer's `averager_opts`; the
  subclass passes them on, so the gradient averager gets the settings the state averager gets, and offers no
  state for download (`Optimizer.load_state_from_peers` downloads it and throws it away).
- `hivemind.averaging.key_manager.GroupKeyManager.get_averagers` (`throttle_matchmaking`): matchmaking re-reads
  its group key back to back while it sees no better leader than itself; the wrapper spaces the reads.
- `DecentralizedAverager`'s keyword arguments (`averager_options`) and hivemind's compressions
  (`averager_compression`): the settings every averaging round of gpuswarm runs with, in one place
  (docs/decisions/0018-allreduce-where-the-time-goes.md says what was measured and why these values).

Every function that takes `node` runs inside the DHT's own process (`DHT.run_coroutine`), where `node` is its
DHTNode. This module imports hivemind lazily, so importing it costs nothing; it must not grow anything that is
reachable through hivemind's public API (`hivemind.DHT`, `DHTNode.get`, `DHTNode.p2p`, record validators). The
one exception is the averaging settings: they are tied to the 8-bit fix and to this version's defaults, so they
live beside them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

PINNED_VERSION = "1.1.12"
HIVEMIND_RUN_KEY_SUFFIXES = ("_progress", "_grad_averager.0b", "_state_averager.0b", "_grad_averager.all_averagers",
                             "_state_averager.all_averagers")
OWNER_RE = re.compile(rb"\[owner:(.+?)\]")  # RSASignatureValidator.PUBLIC_KEY_FORMAT, b"[owner:_key_]"
# hivemind's own default (averaging/partition.py DEFAULT_PART_SIZE_BYTES), pinned: 128 KiB, 2 MiB and 8 MiB parts
# measured the same as 512 KiB to within the lab's noise (decision 0018), so an upgrade that moves the default
# should not move ours unnoticed.
AVERAGING_PART_SIZE_BYTES = 2**19
AVERAGING_COMPRESSIONS = ("none", "fp16", "8bit")
# Tensors smaller than this are averaged in fp16 under "8bit": a 256-entry codebook (1 KiB) and 8-bit rounding
# buy nothing on a bias or a norm's scale. hivemind's own examples use the same split.
EIGHT_BIT_MIN_NUMEL = 2**16
# The least time between two reads of an averager's group key (`throttle_matchmaking`): a group forms at most this
# much later, against rounds of seconds.
MATCHMAKING_POLL_SECONDS = 0.2


def key_id(key: str) -> bytes:
    """The DHT id (hash) a key is stored under, as the bytes a `DHTRecord.key` holds."""
    from hivemind.dht.routing import DHTID

    return DHTID.generate(source=key).to_bytes()


def pack(value: Any) -> bytes:
    """A subkey or value as hivemind stores it in a raw record."""
    from hivemind.utils import MSGPackSerializer

    return MSGPackSerializer.dumps(value)


def unpack(raw: bytes) -> Any:
    """The inverse of `pack`. Raises (msgpack's own exceptions, ValueError, TypeError) on bytes it cannot decode."""
    from hivemind.utils import MSGPackSerializer

    return MSGPackSerializer.loads(raw)


def rsa_owner(data: bytes) -> bytes | None:
    """The RSA public key a key or subkey names as its record's owner, or None for an unprotected one."""
    found = OWNER_RE.search(data)
    return found.group(1) if found else None


def check_rsa_record(record_key_id: bytes, subkey: Any, raw: bytes, expiration: float) -> tuple[bool, bytes]:
    """Check an RSA-protected record's signature as hivemind's own validator does: (whether it verifies, the raw
    value with its signature stripped). `subkey` is the decoded subkey (None for a plain value)."""
    from hivemind.dht.crypto import RSASignatureValidator
    from hivemind.dht.validation import DHTRecord

    validator = RSASignatureValidator()
    record = DHTRecord(record_key_id, pack(subkey) if subkey is not None else b"", raw, expiration)
    return validator.validate(record), validator.strip_value(record)


@dataclass(frozen=True)
class RawRecord:
    """A record as the local peer holds it: either `subkeys` ({subkey: (raw value, expiration)}) or `value`."""

    subkeys: dict[Any, tuple[bytes, float]] | None = None
    value: bytes | None = None


def cached_record(node, key: str) -> RawRecord | None:
    """The raw record under `key` that the local peer holds (a lookup leaves it in the cache; a stored one is in
    storage), signatures still attached; None when it holds none."""
    from hivemind.dht.storage import DictionaryDHTValue

    kid = _dhtid(key)
    raw = node.protocol.cache.get(kid) or node.protocol.storage.get(kid)
    if raw is not None and isinstance(raw.value, DictionaryDHTValue):
        return RawRecord(subkeys={subkey: (item.value, item.expiration_time) for subkey, item in raw.value.items()})
    if raw is not None and isinstance(raw.value, bytes):
        return RawRecord(value=raw.value)
    return None


def local_records(node) -> list[dict]:
    """Every record the local peer holds (storage and lookup cache), by key hash: names cannot be recovered."""
    from hivemind.dht.storage import DictionaryDHTValue

    out = []
    for where, timed in (("storage", node.protocol.storage), ("cache", node.protocol.cache)):
        for kid, item in timed.items():
            subkeys = len(item.value) if isinstance(item.value, DictionaryDHTValue) else None
            out.append({"key_id": kid.to_bytes().hex(), "where": where, "subkeys": subkeys,
                        "expiration": item.expiration_time})
    return out


def routing_peers(node) -> dict:
    """The peers in the node's routing table: {PeerID: their DHT id as bytes}."""
    return {peer_id: dht_id.to_bytes() for peer_id, dht_id in node.protocol.routing_table.peer_id_to_uid.items()}


async def ping(node, peer_id) -> bool:
    """One DHT ping of `peer_id` (a PeerID), without adding it to the routing table: whether it answered."""
    return await node.protocol.call_ping(peer_id, validate=False) is not None


def _dhtid(key: str):
    from hivemind.dht.routing import DHTID

    return DHTID.generate(source=key)


def fix_8bit_codecs() -> None:
    """Make hivemind's 8-bit compressions (uniform and quantile) decode under NumPy 2.x; idempotent. Call it in
    every process that averages with them (the codec a peer decodes with is its own registry's)."""
    import numpy as np
    import torch
    from hivemind.compression import serialization
    from hivemind.compression.quantization import Quantile8BitQuantization, Uniform8BitQuantization

    def extract(self, serialized_tensor):
        buffer = serialized_tensor.buffer
        codebook_size = int(np.frombuffer(buffer, count=1, dtype=np.int64)[0])
        codebook = np.frombuffer(buffer, offset=8, count=codebook_size, dtype=self.codebook_dtype)
        quantized = np.frombuffer(buffer, offset=8 + codebook.nbytes, dtype=self.indices_dtype)
        quantized = torch.as_tensor(quantized, dtype=torch.int64).reshape(tuple(serialized_tensor.size))
        codebook = torch.as_tensor(codebook).to(dtype=getattr(torch, serialized_tensor.dtype))
        return codebook[quantized].requires_grad_(serialized_tensor.requires_grad)

    for name, base in (("UNIFORM_8BIT", Uniform8BitQuantization), ("QUANTILE_8BIT", Quantile8BitQuantization)):
        if getattr(type(serialization._BASE_COMPRESSION_TYPES[name]), "_gpuswarm_fixed", False):
            continue
        fixed = type(base.__name__, (base,), {"extract": extract, "_gpuswarm_fixed": True})
        serialization._BASE_COMPRESSION_TYPES[name] = fixed()


def averager_options(bandwidth_mbit: float | None = None, group_size: int | None = None) -> dict[str, Any]:
    """Keyword arguments for hivemind's averagers: `DecentralizedAverager(..., **averager_options())`, or
    `hivemind.Optimizer(averager_opts={**averager_options(), ...})`, which passes them to its gradient and state
    averagers. Compression is not among them (the Optimizer takes it as `grad_compression=` and
    `state_averaging_compression=`; see `averager_compression`).

    `bandwidth_mbit`, this node's measured link speed, is declared to the group: hivemind gives each peer a share of
    the vector to reduce in proportion to the bandwidths declared, so a slow link reduces less (every peer declaring
    None means equal shares). Raises ValueError for a negative or non-finite bandwidth (hivemind asserts instead).

    `group_size`, the most peers a round can have (a job's max_nodes), becomes hivemind's `target_group_size`: a
    leader starts the round as soon as that many have joined it. Without it a leader always waits out its
    matchmaking time, seconds of every round, even when every member joined at once (members of a DiLoCo round
    finish their inner steps together). A group that is not full still waits it out and then runs with the peers it
    has (at least `min_group_size`), as before. A size of 1 or None sets nothing: a lone node never matchmakes.
    """
    options: dict[str, Any] = {"part_size_bytes": AVERAGING_PART_SIZE_BYTES}
    if group_size is not None and group_size > 1:
        options["target_group_size"] = int(group_size)
    if bandwidth_mbit is not None:
        if not isinstance(bandwidth_mbit, int | float) or not math.isfinite(bandwidth_mbit) or bandwidth_mbit < 0:
            raise ValueError(f"bandwidth_mbit must be a finite number >= 0, not {bandwidth_mbit!r}")
        options["bandwidth"] = float(bandwidth_mbit)
    return options


def chunk_timeout(matchmaking_time: float, averaging_timeout: float) -> float:
    """Seconds an all-reduce waits for a peer's next part before it drops that peer from the round (hivemind's
    `next_chunk_timeout`: a sender gets this long, a reducer twice as long), for `hivemind.Optimizer`.

    Left unset, hivemind.Optimizer 1.1.12 takes the matchmaking time for it (optim/optimizer.py:210), 3 s by
    default, which has nothing to do with how long a part takes to arrive. Under the lab's 0.4 CPU per node a fp16
    part of 512 KiB often took longer, so its peer was dropped and the round finished with a share of the model
    unaveraged ("Averaging: received 81.2% results"): 25 of 80 member-rounds of three 4-node tinylm runs (decision
    0038). Half the averaging timeout, and never less than the matchmaking time, gives a part that long while a peer
    that is gone is still dropped well inside the round's own timeout (a dropped peer costs its share of the round;
    a round past `averaging_timeout` costs all of it)."""
    return max(float(matchmaking_time), averaging_timeout / 2)


def averager_compression(name: str):
    """The hivemind compression for averaging rounds, by name: "none", "fp16" (half the bytes, no codec cost worth
    measuring) or "8bit" (uniform 8-bit for tensors of `EIGHT_BIT_MIN_NUMEL` elements or more, fp16 below: a
    quarter of the bytes). "8bit" installs `fix_8bit_codecs` in this process first; every peer of the round must
    have it (the codec a part is decoded with is the receiver's), which holds for peers that get their
    compression here."""
    from hivemind.compression import Float16Compression, NoCompression, SizeAdaptiveCompression, Uniform8BitQuantization

    if name == "none":
        return NoCompression()
    if name == "fp16":
        return Float16Compression()
    if name == "8bit":
        fix_8bit_codecs()
        return SizeAdaptiveCompression(EIGHT_BIT_MIN_NUMEL, less=Float16Compression(),
                                       greater_equal=Uniform8BitQuantization())
    raise ValueError(f"unknown averaging compression {name!r}; one of {', '.join(AVERAGING_COMPRESSIONS)}")


def optimizer_class():
    """`hivemind.Optimizer`, with seven differences.

    - `averager_opts` reach its gradient averager too. hivemind 1.1.12 documents them as "forwarded to both
      GradientAverager and TrainingStateAverager" but hands them to the state averager alone
      (`Optimizer._make_gradient_averager`), so every gradient round ran with hivemind's defaults: no
      `target_group_size` (a leader waited out the whole matchmaking time with its group already full), a 3 s
      `request_timeout`, no declared bandwidth. Seen in the lab's worker logs: four members joined a leader within
      0.4 s and it assembled the group 3.0 s after it began, every round.
    - It schedules matchmaking ahead of a round (gradients or state) only while its tracker sees other peers in the
      run. hivemind schedules it whenever its estimate says the round is near, alone or not; a lone member then
      spent about 10 s of every few rounds matchmaking for nobody, at a third of its CPU (the averager, the DHT and
      p2pd; seen under a 0.4 CPU quota in `scripts/bench/run scaling`). A round with peers but no group scheduled
      ahead still matchmakes when it starts, as hivemind does.
    - Its gradient averager offers no state for download. `Optimizer.load_state_from_peers` downloads the state
      averager's state (parameters and optimizer statistics), then the gradient averager's (its accumulated
      gradients, the parameters' size again), and discards the latter: DecentralizedAverager.load_state_from_peers
      returns what it downloaded and GradientAverager applies nothing. Seen in the lab: 5.0 s of a 2-node tinylm
      member's 12 s state load over the emulated WAN. With nobody offering it, the second download finds no peer
      in the DHT and ends at once.
    - `schedule_gradient_rounds=False` never schedules a gradient round ahead from hivemind's estimate: each starts
      its matchmaking at the step that triggers it, unless the caller scheduled it (`schedule_round_now` below).
      The worker asks for this with local updates: a round scheduled from hivemind's estimate of the round's end
      found its group early; a member that then dropped or replaced it left the group's leader with half the
      tensors (docs/decisions/0042).
    - A round never finds the last round's control in its place. hivemind keeps that control in `scheduled_grads`
      until it schedules the next, and a round that finds a control already triggered or finished there skips its
      averaging altogether ("Not using pre-scheduled group ... already used elsewhere"): without scheduling ahead
      that was every other round (seen in the lab: rounds 1, 3, 5, 7 of 2-node tinylm runs, each member alone).
      The subclass drops such a control before the round begins.
    - A round that was not scheduled ahead has a deadline: `averaging_timeout` seconds to find its group, as
      hivemind gives the rounds it schedules itself. hivemind begins such a round with `grad_averager.step()` and no
      timeout, so a round whose group never formed went on looking for one after the optimizer had given up on it
      (`averaging_timeout`), for good: it held the averager's matchmaking lock, so every later round of that member
      waited behind it ("Another look_for_group is already in progress") and failed in turn, and
      `load_state_from_peers` waited another `averaging_timeout` tagging along with it. Seen in the lab after a
      member joined a 2-node run late: rounds of 10-40 s for minutes, none averaged (decision 0047).
    - `schedule_round_now(within)` begins a gradient round's matchmaking when the caller says so, with a declared
      expiration `within` seconds away: a local-updates member calls it when its share of a round is done, so the
      group assembles while the last members compute (a leader starts as soon as its group is full), and the step
      that ends the round triggers the all-reduce at once. Members that call it later declare later expirations,
      so they join the first one's group (hivemind's leaders accept followers that expire after them).
      `due_if_group_full()` marks such a round due once its group is full, so the next step begins it;
      `drop_round_looking()` gives up one that cannot fill (decision 0043)."""
    global _OPTIMIZER
    if _OPTIMIZER is None:
        import hivemind

        class Optimizer(hivemind.Optimizer):
            def __init__(self, *args, averager_opts: dict | None = None, schedule_gradient_rounds: bool = True,
                         **kwargs):
                self._gradient_averager_opts = dict(averager_opts or {})
                self._schedule_gradient_rounds = schedule_gradient_rounds
                super().__init__(*args, averager_opts=averager_opts, **kwargs)

            def _make_gradient_averager(self, factory, **kwargs):
                return super()._make_gradient_averager(
                    factory, **{**self._gradient_averager_opts, **kwargs, "allow_state_sharing": False})

            def _maybe_schedule_gradient_averaging(self) -> None:
                if self._schedule_gradient_rounds and self.tracker.global_progress.num_peers > 1:
                    super()._maybe_schedule_gradient_averaging()

            def _pending_round(self):
                """The gradient round scheduled and not yet triggered, or None."""
                control = self.scheduled_grads
                return control if control is not None and not (control.triggered or control.done()) else None

            def _begin_averaging_gradients(self, grad_scaler) -> bool:
                if self._pending_round() is None:
                    self.scheduled_grads = None  # the last round's, if any: not one scheduled for this round
                    if self.tracker.global_progress.num_peers > 1:
                        # With a deadline, as hivemind's own scheduling gives one (see the docstring).
                        self.scheduled_grads = self.grad_averager.schedule_step(timeout=self.averaging_timeout)
                return super()._begin_averaging_gradients(grad_scaler)

            def _maybe_schedule_state_averaging(self) -> None:
                if self.tracker.global_progress.num_peers > 1:
                    super()._maybe_schedule_state_averaging()

            def schedule_round_now(self, within: float):
                """Begin the next gradient round's matchmaking now, declaring that its all-reduce starts at the
                latest in `within` seconds; the step that ends the round triggers it. Does nothing while a round is
                scheduled and not yet triggered. The control, or None when none was scheduled."""
                from hivemind.utils import get_dht_time

                if self._pending_round() is not None:
                    return None
                self.scheduled_grads = self.grad_averager.schedule_step(
                    scheduled_time=get_dht_time() + within, timeout=within + self.averaging_timeout)
                return self.scheduled_grads

            def drop_round_looking(self) -> bool:
                """Cancel the round scheduled by `schedule_round_now` while it still looks for its group: a member
                left, so the group cannot fill before the time it declared (up to ROUND_WAIT away). The step that
                begins the round then matchmakes afresh, as without scheduling. Whether one was cancelled."""
                from hivemind.averaging.control import AveragingStage

                control = self._pending_round()
                if control is None or control.stage != AveragingStage.LOOKING_FOR_GROUP:
                    return False
                control.cancel()
                self.scheduled_grads = None
                return True

            def due_if_group_full(self) -> bool:
                """If the round scheduled by `schedule_round_now` has its group, assembled before the time it
                declared (a leader starts that early only with a full group, and every member schedules only once
                its share is done), mark the round due: the tracker's estimate of its end becomes now, so the next
                step begins it without waiting to read the swarm's samples from the DHT. Whether it did."""
                from hivemind.averaging.control import AveragingStage
                from hivemind.utils import get_dht_time

                control, now = self._pending_round(), get_dht_time()
                if control is None or control.stage != AveragingStage.AWAITING_TRIGGER \
                        or now >= control.scheduled_time - 1.0:
                    return False
                self.tracker.global_progress.eta_next_epoch = now
                return True

        _OPTIMIZER = Optimizer
    return _OPTIMIZER


_OPTIMIZER = None


def throttle_matchmaking() -> None:
    """Make the averagers of this process (and of averager processes forked after this call) read their group key
    from the DHT at most once every `MATCHMAKING_POLL_SECONDS`. Idempotent.

    While an averager looks for a group and sees no better leader than itself, hivemind 1.1.12's matchmaking
    (`PotentialLeaders.pop_next_leader`) triggers a new `GroupKeyManager.get_averagers` as soon as the last one
    returns: DHT lookups back to back, each a pass through the DHT's process, p2pd and every peer it asks. In a
    2-node digits job (rounds of about a second) a member's DHT process validated 99 group-key records a second,
    60% of all it validated; with the throttle 18, and the node's processes other than the trainer used 3.2 s of
    CPU in 20 s instead of 4.9 (the DHT's process 1.3 s instead of 2.3-2.6), at the same training pace. The cost
    is latency: a peer that declares itself is seen up to that long later."""
    import asyncio
    import time

    from hivemind.averaging.key_manager import GroupKeyManager

    original = GroupKeyManager.get_averagers
    if getattr(original, "_gpuswarm_throttled", False):
        return

    async def get_averagers(self, group_key, only_active):
        wait = getattr(self, "_gpuswarm_next_poll", 0.0) - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self._gpuswarm_next_poll = time.monotonic() + MATCHMAKING_POLL_SECONDS
        return await original(self, group_key, only_active)

    get_averagers._gpuswarm_throttled = True
    GroupKeyManager.get_averagers = get_averagers


def install_robust_reducer(outlier_log: str | None = None) -> None:
    """Make every all-reduce round of this process (and of averager processes forked after this call) reduce with
    `dht.robust.robust_mean` instead of hivemind's weighted mean: NaN and Inf parts are dropped, each peer's pull
    is clipped (centered clipping), and senders far from the result are logged as outliers, one JSON line each
    in `outlier_log` when given ({"peer_id", "part", "reason", "at"}). Idempotent.

    Reaches past the public API twice: it replaces `hivemind.averaging.allreduce.TensorPartReducer` (the class
    `AllReduceRunner` builds its reducer from) and wraps `AllReduceRunner.__init__` to hand the reducer its senders'
    peer ids. tests/dht/test_robust_averaging.py runs it in real averaging rounds."""
    from hivemind.averaging import allreduce

    global _OUTLIER_LOG
    _OUTLIER_LOG = outlier_log
    if getattr(allreduce.AllReduceRunner.__init__, "_gpuswarm_robust", False):
        return
    allreduce.TensorPartReducer = _robust_reducer_class()
    original = allreduce.AllReduceRunner.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.tensor_part_reducer.sender_peer_ids = list(self.sender_peer_ids)

    init._gpuswarm_robust = True
    allreduce.AllReduceRunner.__init__ = init


_OUTLIER_LOG: str | None = None
_ROBUST_REDUCER = None


def _robust_reducer_class():
    """hivemind's TensorPartReducer, keeping every sender's part of the current slot and reducing them together
    once all have arrived (the mean needs only a running sum; a robust mean needs all of them)."""
    global _ROBUST_REDUCER
    if _ROBUST_REDUCER is not None:
        return _ROBUST_REDUCER
    import asyncio
    import json
    import logging
    import time

    from gpuswarm.dht.robust import robust_mean
    from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer

    log = logging.getLogger(__name__)

    class RobustPartReducer(TensorPartReducer):
        sender_peer_ids: list = []

        def reset_accumulators(self):
            self.received: dict[int, tuple] = {}
            super().reset_accumulators()

        async def accumulate_part(self, sender_index, part_index, tensor_part, weight=1.0):
            assert 0 <= sender_index < self.num_senders, "invalid sender index"
            assert 0 <= part_index < self.num_parts, "invalid part index"
            self.num_parts_received[sender_index] += 1
            while part_index > self.current_part_index:
                await asyncio.wait({self.current_part_future, asyncio.create_task(self.finished.wait())},
                                   return_when=asyncio.FIRST_COMPLETED)
                if self.finished.is_set():
                    raise AllreduceException(f"attempted to aggregate part in a finalized {type(self).__name__}")
            if self.sender_failed_after[sender_index] != float("inf"):
                raise BannedException(f"sender {sender_index} was banned in background")
            assert part_index == self.current_part_index
            future = self.current_part_future
            if part_index < self.sender_failed_after[sender_index]:
                self.received[sender_index] = (tensor_part, float(weight))
                self.current_part_accumulated_from += 1
                self.check_current_part_finished()
            return await future

        def check_current_part_finished(self):
            assert self.current_part_accumulated_from <= self.num_current_senders
            if self.current_part_accumulated_from != self.num_current_senders:
                return
            senders = sorted(self.received)
            if senders:
                result = robust_mean([self.received[s][0] for s in senders], [self.received[s][1] for s in senders])
                for k, why in result.outliers.items():
                    self._report(senders[k], why)
                value = result.value
            else:
                value = self.accumulator
            self.current_part_future.set_result(value)
            self.reset_accumulators()

        def _report(self, sender_index: int, why: str) -> None:
            ids = self.sender_peer_ids
            peer = str(ids[sender_index]) if sender_index < len(ids) else f"sender {sender_index}"
            log.warning("averaging: peer %s clipped in part %d: %s", peer, self.current_part_index, why)
            if _OUTLIER_LOG:
                with open(_OUTLIER_LOG, "a") as f:
                    f.write(json.dumps({"peer_id": peer, "part": self.current_part_index, "reason": why,
                                        "at": time.time()}) + "\n")

    _ROBUST_REDUCER = RobustPartReducer
    return RobustPartReducer
