"""The GPU challenge: a timed matrix product that shows a node has the compute its claimed device promises.

Owns the wire models of the challenge endpoints, the matrices both sides derive from a seed, the Merkle commitment
to the product's rows, the exact Freivalds checks, and the device-class table with its time bound. Pure (numpy,
hashlib and pydantic): no I/O and no clock. The node multiplies (torch, `gpuswarm.node.challenge`); the
coordinator keeps the state and the time (`gpuswarm.coordinator.challenge`). Why it is built this way, and what it
does not prove: docs/decisions/0006-gpu-challenge.md.

1. start: the coordinator issues (challenge_id, seed, n, time_limit) and starts its clock.
2. The node derives A and B (n x n, entries in {-1, 0, 1}) from the seed and computes C = A @ B in float32. That
   is exact on any device and in any summation order, because every partial sum is an integer of magnitude at most
   n <= 2^14 < 2^24. It commits to C's rows (int16, little-endian) with a Merkle root, within `time_limit`.
3. The coordinator reveals r (integers in [-2^20, 2^20), from `r_seed`) and OPENED_ROWS random row indexes; the
   node answers C·r and the opened rows with their Merkle proofs.
4. The coordinator checks, exactly (float64 holds every value, all below 2^53): each proof against the root; each
   opened row against A_i·(B·r) (Freivalds on a row the node fixed before it knew r) and against (C·r)_i; and the
   whole C·r against A·(B·r) (Freivalds on the full product, which catches faulty hardware anywhere in C).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import math
import re
from dataclasses import dataclass
from typing import Annotated

import numpy as np
from gpuswarm.proto.models import NodeId, NonNegFloat, Resources, ShortText, WireModel
from pydantic import Field, StringConstraints, field_validator

START_KIND = "challenge_start"
COMMIT_KIND = "challenge_commit"
PROOF_KIND = "challenge_proof"

MIN_N = 256
MAX_N = 16384  # |C_ij| <= n must fit int16 (the committed row format) and float32's exact integers
GEN_BLOCK = 256  # rows per generator stream: any block of A or B can be made alone, so nobody holds all of it
OPENED_ROWS = 16  # a node that computed a fraction f of the rows survives the openings with probability f^16
R_BOUND = 2**20  # r_j in [-R_BOUND, R_BOUND): a wrong committed row passes its check with probability <= 2^-21
MATRIX_A, MATRIX_B, VECTOR_R = 0, 1, 2  # spawn keys: one generator family per object
ROW_DTYPE = np.dtype("<i2")
VECTOR_DTYPE = np.dtype("<i8")
MAX_PROOF_DEPTH = int(math.log2(MAX_N))


def _b64_length(raw_bytes: int) -> int:
    return 4 * ((raw_bytes + 2) // 3)


MAX_ROW_B64 = _b64_length(MAX_N * ROW_DTYPE.itemsize)
MAX_VECTOR_B64 = _b64_length(MAX_N * VECTOR_DTYPE.itemsize)
# A proof body: C·r, the opened rows and their paths, inside a signed envelope. Routes that take it cap bodies here.
MAX_PROOF_BYTES = 2 * 1024 * 1024

ChallengeId = Annotated[str, StringConstraints(pattern=r"^c-[0-9a-f]{16}$")]
Seed = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]  # 128 bits, hex
Digest = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]  # SHA-256, hex


# ---------------------------------------------------------------------------------------------------- wire models


class ChallengeStart(WireModel):
    """Signed by the node (kind `challenge_start`) when the coordinator says a challenge is due."""

    node_id: NodeId


class ChallengeIssue(WireModel):
    """The coordinator's challenge. Its clock runs from issuing until the commitment arrives."""

    challenge_id: ChallengeId
    node_id: NodeId
    seed: Seed
    n: Annotated[int, Field(ge=MIN_N, le=MAX_N)]
    device_class: ShortText
    time_limit: Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)]
    issued_at: NonNegFloat  # the coordinator's clock
    deadline: NonNegFloat  # issued_at + time_limit, the coordinator's clock

    @field_validator("n")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError("n must be a power of two")
        return value


class ChallengeCommit(WireModel):
    """Signed by the node (kind `challenge_commit`): the Merkle root of C's rows."""

    challenge_id: ChallengeId
    node_id: NodeId
    root: Digest
    compute_seconds: Annotated[float, Field(ge=0, le=86_400, allow_inf_nan=False)] | None = None  # node's own clock


class ChallengeReveal(WireModel):
    """What the node must open, known only once its commitment is in."""

    challenge_id: ChallengeId
    r_seed: Seed
    rows: list[Annotated[int, Field(ge=0, lt=MAX_N)]] = Field(min_length=1, max_length=OPENED_ROWS)
    proof_deadline: NonNegFloat  # the coordinator's clock


class OpenedRow(WireModel):
    index: Annotated[int, Field(ge=0, lt=MAX_N)]
    values: Annotated[str, StringConstraints(max_length=MAX_ROW_B64)]  # base64 of n little-endian int16
    path: list[Digest] = Field(max_length=MAX_PROOF_DEPTH)  # sibling hashes, leaf level first


class ChallengeProof(WireModel):
    """Signed by the node (kind `challenge_proof`): C·r and the opened rows."""

    challenge_id: ChallengeId
    node_id: NodeId
    product: Annotated[str, StringConstraints(max_length=MAX_VECTOR_B64)]  # base64 of n little-endian int64
    rows: list[OpenedRow] = Field(max_length=OPENED_ROWS)


class ChallengeResult(WireModel):
    challenge_id: ChallengeId
    node_id: NodeId
    passed: bool
    reason: Annotated[str, StringConstraints(max_length=2000)]
    device_class: ShortText
    n: Annotated[int, Field(ge=1)]
    seconds: NonNegFloat | None = None  # issue to commitment, the coordinator's clock; None: never committed
    time_limit: NonNegFloat
    measured_gflops: NonNegFloat | None = None  # 2n^3 / seconds: a lower bound, overheads included
    verified: bool  # the node's standing after this result


class CommitAnswer(WireModel):
    """The answer to a commitment: the reveal, or (a late commitment) the final result."""

    challenge_id: ChallengeId
    reveal: ChallengeReveal | None = None
    result: ChallengeResult | None = None


# ---------------------------------------------------------------------------------------------------- matrices


def raw_block(seed: str, which: int, block: int, n: int) -> np.ndarray:
    """Rows [block*GEN_BLOCK, (block+1)*GEN_BLOCK) of matrix `which`, as raw bytes (uint8, GEN_BLOCK x n).

    Only SeedSequence and PCG64's raw output are used: NumPy keeps both stable across versions (Generator methods
    may change their streams), so nodes and the coordinator agree whatever NumPy each has."""
    bits = np.random.PCG64(np.random.SeedSequence(int(seed, 16), spawn_key=(which, block)))
    words = np.asarray(bits.random_raw(GEN_BLOCK * n // 8), dtype="<u8")  # byte order fixed on any host
    return words.view(np.uint8).reshape(GEN_BLOCK, n)


def entries(raw: np.ndarray) -> np.ndarray:
    """Raw bytes to matrix entries in {-1, 0, 1} (int8). Nodes may do the same arithmetic on their device."""
    return (raw % 3).astype(np.int8) - 1


def matrix_rows(seed: str, which: int, n: int, start: int, stop: int) -> np.ndarray:
    """Rows [start, stop) of matrix `which` (int8), made from the blocks that cover them."""
    check_size(n)
    if not 0 <= start <= stop <= n:
        raise ValueError(f"rows {start}:{stop} outside 0:{n}")
    first, last = start // GEN_BLOCK, (stop + GEN_BLOCK - 1) // GEN_BLOCK
    blocks = [entries(raw_block(seed, which, b, n)) for b in range(first, last)]
    stacked = np.concatenate(blocks) if blocks else np.empty((0, n), np.int8)
    return stacked[start - first * GEN_BLOCK:stop - first * GEN_BLOCK]


def matrix(seed: str, which: int, n: int) -> np.ndarray:
    return matrix_rows(seed, which, n, 0, n)


def reveal_vector(r_seed: str, n: int) -> np.ndarray:
    """The revealed vector r (int64, entries in [-R_BOUND, R_BOUND))."""
    bits = np.random.PCG64(np.random.SeedSequence(int(r_seed, 16), spawn_key=(VECTOR_R,)))
    words = np.asarray(bits.random_raw(n), dtype=np.uint64)
    return (words >> np.uint64(64 - 21)).astype(np.int64) - R_BOUND


def times_vector(m: np.ndarray, r: np.ndarray, block: int = 1024) -> np.ndarray:
    """m·r for an integer matrix, exactly (int64). float64 BLAS in row blocks: every product and partial sum is an
    integer below 2^53 for the sizes here (|m_ij| <= MAX_N, |r_j| <= R_BOUND), so no rounding happens in any order."""
    rf = np.asarray(r, dtype=np.float64)
    out = np.empty(m.shape[0], dtype=np.int64)
    for i in range(0, m.shape[0], block):
        out[i:i + block] = m[i:i + block].astype(np.float64) @ rf
    return out


_ENTRY_LUT = np.array([(i % 3) - 1 for i in range(256)], dtype=np.float32)  # `entries`, straight to float32
DIGIT_BITS = 10  # MAX_N * 2^10 = 2^24: float32 sums of one digit column are exact integers


def _digits(v: np.ndarray) -> np.ndarray:
    """Columns of base-2^10 digits of v (all but the last in [0, 2^10), the last signed, |last| <= 2^10)."""
    bits = int(np.abs(v).max(initial=0)).bit_length()
    count = 1 + max(0, -(-(bits - DIGIT_BITS) // DIGIT_BITS))
    columns, rest = [], v.astype(np.int64)
    for _ in range(count - 1):
        digit = rest & ((1 << DIGIT_BITS) - 1)
        columns.append(digit)
        rest = (rest - digit) >> DIGIT_BITS
    columns.append(rest)
    return np.stack(columns, axis=1).astype(np.float32)


def generated_times(seed: str, which: int, n: int, v: np.ndarray) -> np.ndarray:
    """M·v for the generated matrix `which`, exactly (int64), one generator block at a time (O(GEN_BLOCK * n)
    memory). float32 GEMM over the digits of v: every partial sum is an integer of magnitude <= n * 2^10 <= 2^24,
    so nothing rounds, and float32 moves half the bytes of float64 (this is the verifier's whole O(n^2) cost)."""
    check_size(n)
    digits = _digits(np.asarray(v))
    parts = np.concatenate([_ENTRY_LUT[raw_block(seed, which, b, n)] @ digits for b in range(n // GEN_BLOCK)])
    total = np.zeros(n, dtype=np.int64)
    for k in reversed(range(digits.shape[1])):
        total = (total << DIGIT_BITS) + parts[:, k].astype(np.int64)
    return total


def check_size(n: int) -> None:
    if not MIN_N <= n <= MAX_N or n & (n - 1):
        raise ValueError(f"n must be a power of two in [{MIN_N}, {MAX_N}], not {n}")


# ---------------------------------------------------------------------------------------------------- Merkle tree


def leaf_hash(row: np.ndarray) -> bytes:
    """A row's leaf: SHA-256 over 0x00 and the row as little-endian int16 (0x01 prefixes inner nodes, so a leaf can
    never pass for an inner node)."""
    return hashlib.sha256(b"\x00" + np.ascontiguousarray(row, dtype=ROW_DTYPE).tobytes()).digest()


def _parent(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def merkle_levels(leaves: list[bytes]) -> list[list[bytes]]:
    """Every level of the tree, leaves first, root last. The number of leaves must be a power of two."""
    if not leaves or len(leaves) & (len(leaves) - 1):
        raise ValueError("the number of leaves must be a power of two")
    levels = [list(leaves)]
    while len(levels[-1]) > 1:
        below = levels[-1]
        levels.append([_parent(below[i], below[i + 1]) for i in range(0, len(below), 2)])
    return levels


def merkle_path(levels: list[list[bytes]], index: int) -> list[bytes]:
    """The sibling hashes from leaf `index` up to (not including) the root."""
    path = []
    for level in levels[:-1]:
        path.append(level[index ^ 1])
        index //= 2
    return path


def root_from_path(leaf: bytes, index: int, path: list[bytes]) -> bytes:
    node = leaf
    for sibling in path:
        node = _parent(node, sibling) if index % 2 == 0 else _parent(sibling, node)
        index //= 2
    return node


# ---------------------------------------------------------------------------------------------------- encoding


def encode_ints(values: np.ndarray, dtype: np.dtype) -> str:
    return base64.b64encode(np.ascontiguousarray(values, dtype=dtype).tobytes()).decode()


def decode_ints(text: str, dtype: np.dtype, count: int, what: str) -> np.ndarray:
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} is not base64") from None
    if len(raw) != count * dtype.itemsize:
        raise ValueError(f"{what} has {len(raw)} bytes; {count} {dtype.name} values take {count * dtype.itemsize}")
    return np.frombuffer(raw, dtype=dtype)


@dataclass(frozen=True)
class Opened:
    row: np.ndarray  # int16, n values
    path: list[bytes]


def decode_proof(proof: ChallengeProof, n: int, expected_rows: list[int]) -> tuple[np.ndarray, dict[int, Opened]]:
    """The proof's C·r and opened rows as arrays. ValueError: the proof is malformed for this challenge (wrong
    sizes, rows other than those revealed, a path of the wrong length); that is bad input, not a failed proof."""
    depth = int(math.log2(n))
    product = decode_ints(proof.product, VECTOR_DTYPE, n, "product")
    indexes = [r.index for r in proof.rows]
    if sorted(indexes) != sorted(expected_rows) or len(set(indexes)) != len(indexes):
        raise ValueError(f"the proof opens rows {sorted(indexes)}; the reveal asked for {sorted(expected_rows)}")
    opened = {}
    for r in proof.rows:
        if len(r.path) != depth:
            raise ValueError(f"row {r.index}: the path has {len(r.path)} hashes; a tree of {n} rows needs {depth}")
        opened[r.index] = Opened(decode_ints(r.values, ROW_DTYPE, n, f"row {r.index}"),
                                 [bytes.fromhex(h) for h in r.path])
    return product, opened


# ---------------------------------------------------------------------------------------------------- verification


@dataclass(frozen=True)
class Verdict:
    passed: bool
    reason: str


def check_proof(seed: str, n: int, root: str, r_seed: str, product: np.ndarray,
                opened: dict[int, Opened]) -> Verdict:
    """Check an answer in O(n^2) time and O(GEN_BLOCK * n) memory. Cheap checks (Merkle paths) come first, so
    that a forged answer costs the verifier as little as possible."""
    check_size(n)
    want_root = bytes.fromhex(root)
    for i, o in sorted(opened.items()):
        if root_from_path(leaf_hash(o.row), i, o.path) != want_root:
            return Verdict(False, f"row {i} does not match the committed Merkle root")
    r = reveal_vector(r_seed, n)
    a_b_r = generated_times(seed, MATRIX_A, n, generated_times(seed, MATRIX_B, n, r))
    for i, o in sorted(opened.items()):
        row_r = int(times_vector(o.row.reshape(1, n), r)[0])
        if row_r != int(a_b_r[i]):
            return Verdict(False, f"row {i} is not row {i} of A·B (Freivalds)")
        if row_r != int(product[i]):
            return Verdict(False, f"(C·r)[{i}] does not agree with the opened row {i}")
    wrong = np.flatnonzero(product != a_b_r)
    if wrong.size:
        return Verdict(False, f"C·r != A·(B·r) in {wrong.size} of {n} entries (Freivalds), first at {wrong[0]}")
    return Verdict(True, f"all {len(opened)} opened rows and C·r check out")


# ---------------------------------------------------------------------------------------------------- device classes


@dataclass(frozen=True)
class DeviceClass:
    name: str
    gflops: float  # dense float32 (no tensor cores) of one device, from the vendor's datasheet
    gpu: bool


# (pattern on the lower-cased model name, class name, fp32 TFLOPS). First match wins: specific names before
# general ones ("h100 pcie" before "h100", "a100" before "a10").
GPU_TABLE: tuple[tuple[str, str, float], ...] = (
    (r"\bgh200\b", "NVIDIA GH200", 66.9),
    (r"\bh200\b", "NVIDIA H200", 66.9),
    (r"\bh100\b.*\bpcie\b", "NVIDIA H100 PCIe", 51.2),
    (r"\bh100\b.*\bnvl\b", "NVIDIA H100 NVL", 60.0),
    (r"\bh100\b", "NVIDIA H100 SXM", 66.9),
    (r"\bh800\b", "NVIDIA H800", 51.2),
    (r"\bb200\b", "NVIDIA B200", 60.0),  # conservative: public figures for dense fp32 vary
    (r"\ba100\b", "NVIDIA A100", 19.5),
    (r"\ba800\b", "NVIDIA A800", 19.5),
    (r"\ba10g\b", "NVIDIA A10G", 31.2),
    (r"\ba10\b", "NVIDIA A10", 31.2),
    (r"\ba40\b", "NVIDIA A40", 37.4),
    (r"\ba30\b", "NVIDIA A30", 10.3),
    (r"\bl40s\b", "NVIDIA L40S", 91.6),
    (r"\bl40\b", "NVIDIA L40", 90.5),
    (r"\bl4\b", "NVIDIA L4", 30.3),
    (r"\bt4\b", "NVIDIA T4", 8.1),
    (r"\bv100\b", "NVIDIA V100", 14.0),
    (r"\bp100\b", "NVIDIA P100", 9.3),
    (r"\brtx 6000 ada\b", "NVIDIA RTX 6000 Ada", 91.1),
    (r"\ba6000\b", "NVIDIA RTX A6000", 38.7),
    (r"\ba5000\b", "NVIDIA RTX A5000", 27.8),
    (r"\ba4000\b", "NVIDIA RTX A4000", 19.2),
    (r"\b4090\b", "NVIDIA GeForce RTX 4090", 82.6),
    (r"\b4080\b", "NVIDIA GeForce RTX 4080", 48.7),
    (r"\b4070\b", "NVIDIA GeForce RTX 4070", 29.1),
    (r"\b3090\b", "NVIDIA GeForce RTX 3090", 35.6),
    (r"\b3080\b", "NVIDIA GeForce RTX 3080", 29.8),
    (r"\b3070\b", "NVIDIA GeForce RTX 3070", 20.3),
    (r"\b3060\b", "NVIDIA GeForce RTX 3060", 12.7),
    (r"\b2080\b", "NVIDIA GeForce RTX 2080", 10.1),
    (r"\bmi300x?\b", "AMD Instinct MI300X", 81.7),
    (r"\bmi250x?\b", "AMD Instinct MI250", 45.3),
    (r"\bmi210\b", "AMD Instinct MI210", 22.6),
)
UNKNOWN_GPU = DeviceClass("unknown GPU", 2_000.0, True)  # lenient: an unlisted GPU still must beat a typical CPU
CPU_GFLOPS_PER_CORE = 2.0  # lenient on purpose: a CPU node only has to be an honest CPU node
MAX_COUNTED_CORES = 256

SLACK = 4.0  # the device may reach a quarter of its datasheet rate (busy, throttled, shared) and still pass
BASE_ALLOWANCE = 1.5  # seconds: two network trips, signing, thread hand-offs
PER_ENTRY_ALLOWANCE = 10e-9  # seconds per matrix entry (n^2): generating A and B, copies, hashing C's rows
CPU_N = 1024
GPU_N = 16384
SMALL_GPU_N = 8192  # GPUs with less memory than GPU_N_MEMORY_GB (A, B, C in float32 take 12 n^2 bytes)
GPU_N_MEMORY_GB = 6.0


def gpu_class(model: str) -> DeviceClass:
    name = model.casefold()
    for pattern, label, tflops in GPU_TABLE:
        if re.search(pattern, name):
            return DeviceClass(label, tflops * 1000.0, True)
    return UNKNOWN_GPU


def device_class(resources: Resources) -> DeviceClass:
    """The class a node is held to: its fastest claimed GPU, or its claimed CPU cores."""
    if resources.gpus:
        return max((gpu_class(g.model) for g in resources.gpus), key=lambda c: c.gflops)
    cores = min(resources.cpu_cores, MAX_COUNTED_CORES)
    return DeviceClass(f"CPU ({resources.cpu_cores} cores)", CPU_GFLOPS_PER_CORE * cores, False)


def challenge_size(resources: Resources) -> int:
    if not resources.gpus:
        return CPU_N
    return GPU_N if resources.max_gpu_memory_gb >= GPU_N_MEMORY_GB else SMALL_GPU_N


def matmul_flops(n: int) -> float:
    return 2.0 * n ** 3


def time_limit(device: DeviceClass, n: int) -> float:
    """Seconds from issue to commitment: the product at 1/SLACK of the class's rate, plus fixed allowances."""
    return SLACK * matmul_flops(n) / (device.gflops * 1e9) + BASE_ALLOWANCE + PER_ENTRY_ALLOWANCE * n * n


def measured_gflops(n: int, seconds: float) -> float:
    return matmul_flops(n) / max(seconds, 1e-9) / 1e9
