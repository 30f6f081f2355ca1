"""The GPU challenge's pure parts: deterministic matrices, exact arithmetic, the Merkle commitment, the Freivalds
checks against honest and cheating answers, and the device-class time bound."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from gpuswarm.proto import challenge as ch
from gpuswarm.proto.challenge import ChallengeIssue, ChallengeProof, OpenedRow
from gpuswarm.proto.models import Resources
from pydantic import ValidationError

SEED = "0123456789abcdef0123456789abcdef"
R_SEED = "fedcba9876543210fedcba9876543210"
N = 512


@pytest.fixture(scope="module")
def honest() -> dict:
    """An honest node's work for (SEED, N): C in float32, exactly, and the Merkle tree of its rows."""
    a, b = ch.matrix(SEED, ch.MATRIX_A, N), ch.matrix(SEED, ch.MATRIX_B, N)
    c = (a.astype(np.float32) @ b.astype(np.float32)).astype(np.int16)
    levels = ch.merkle_levels([ch.leaf_hash(row) for row in c])
    return {"a": a, "b": b, "c": c, "levels": levels, "root": levels[-1][0].hex()}


def opened_rows(c: np.ndarray, levels, rows) -> dict[int, ch.Opened]:
    return {i: ch.Opened(c[i].copy(), ch.merkle_path(levels, i)) for i in rows}


def verdict(honest: dict, product: np.ndarray, opened: dict, root: str | None = None) -> ch.Verdict:
    return ch.check_proof(SEED, N, root or honest["root"], R_SEED, product, opened)


ROWS = [0, 1, 77, 300, 511]


# ---------------------------------------------------------------------------------------------------- matrices


def test_matrices_are_deterministic_small_integers_and_seekable():
    a = ch.matrix(SEED, ch.MATRIX_A, N)
    assert a.dtype == np.int8 and a.shape == (N, N)
    assert set(np.unique(a)) == {-1, 0, 1}
    counts = np.unique(a, return_counts=True)[1] / a.size
    assert np.all(np.abs(counts - 1 / 3) < 0.01)  # close to uniform
    assert np.array_equal(a, ch.matrix(SEED, ch.MATRIX_A, N))
    assert np.array_equal(ch.matrix_rows(SEED, ch.MATRIX_A, N, 200, 300), a[200:300])  # any rows, alone
    assert not np.array_equal(a, ch.matrix(SEED, ch.MATRIX_B, N))
    assert not np.array_equal(a, ch.matrix("1" * 32, ch.MATRIX_A, N))


def test_raw_bytes_are_fixed_by_the_seed_not_by_numpy_or_the_host():
    # Golden values: PCG64's raw stream for a SeedSequence is stable across NumPy versions, and bytes are taken
    # little-endian. If these change, nodes and coordinators of different versions disagree on every challenge.
    assert ch.raw_block(SEED, ch.MATRIX_A, 0, 256)[0, :16].tobytes().hex() == "7ebc17bb1b0eee0ecdf9be234ffc3687"
    assert ch.raw_block(SEED, ch.MATRIX_B, 3, 256)[5, :16].tobytes().hex() == "3985c1c0278df69134ddf49338367caa"
    assert ch.reveal_vector(R_SEED, 256)[:4].tolist() == [-809861, -929399, 703516, -655733]


def test_float32_product_is_exact(honest):
    exact = honest["a"].astype(np.int64) @ honest["b"].astype(np.int64)
    assert np.array_equal(honest["c"].astype(np.int64), exact)
    assert np.abs(exact).max() <= N


def test_generated_times_is_exact_for_large_vectors(honest):
    r = ch.reveal_vector(R_SEED, N)
    assert r.min() >= -ch.R_BOUND and r.max() < ch.R_BOUND
    b_r = ch.generated_times(SEED, ch.MATRIX_B, N, r)
    assert np.array_equal(b_r, honest["b"].astype(np.int64) @ r)
    assert np.array_equal(ch.generated_times(SEED, ch.MATRIX_A, N, b_r), honest["a"].astype(np.int64) @ b_r)
    big = np.full(N, 2**40, dtype=np.int64) * np.where(np.arange(N) % 2, 1, -1)  # beyond float32's exact range
    assert np.array_equal(ch.generated_times(SEED, ch.MATRIX_A, N, big), honest["a"].astype(np.int64) @ big)


# ---------------------------------------------------------------------------------------------------- verification


def test_an_honest_answer_passes(honest):
    r = ch.reveal_vector(R_SEED, N)
    result = verdict(honest, ch.times_vector(honest["c"], r), opened_rows(honest["c"], honest["levels"], ROWS))
    assert result.passed, result.reason


def test_a_wrong_committed_row_fails(honest):
    c = honest["c"].copy()
    c[77, 5] += 1  # one entry off, in a row that is opened; committed like that
    levels = ch.merkle_levels([ch.leaf_hash(row) for row in c])
    r = ch.reveal_vector(R_SEED, N)
    result = verdict(honest, ch.times_vector(c, r), opened_rows(c, levels, ROWS), root=levels[-1][0].hex())
    assert not result.passed and "row 77 is not row 77 of A·B" in result.reason


def test_a_wrong_product_elsewhere_fails_freivalds(honest):
    # Faulty hardware: an entry of an unopened row is wrong. The openings cannot see it; C·r can.
    c = honest["c"].copy()
    c[123, 45] -= 2
    levels = ch.merkle_levels([ch.leaf_hash(row) for row in c])
    r = ch.reveal_vector(R_SEED, N)
    result = verdict(honest, ch.times_vector(c, r), opened_rows(c, levels, ROWS), root=levels[-1][0].hex())
    assert not result.passed and "Freivalds" in result.reason and "first at 123" in result.reason


def test_a_row_changed_after_the_commitment_fails_the_merkle_check(honest):
    opened = opened_rows(honest["c"], honest["levels"], ROWS)
    opened[300].row[0] += 1
    r = ch.reveal_vector(R_SEED, N)
    result = verdict(honest, ch.times_vector(honest["c"], r), opened)
    assert not result.passed and "row 300 does not match the committed Merkle root" in result.reason


def test_a_forged_path_fails(honest):
    opened = opened_rows(honest["c"], honest["levels"], ROWS)
    path = list(opened[1].path)
    path[3] = bytes(32)
    opened[1] = ch.Opened(opened[1].row, path)
    result = verdict(honest, ch.times_vector(honest["c"], ch.reveal_vector(R_SEED, N)), opened)
    assert not result.passed and "row 1 does not match" in result.reason


def test_a_row_opened_at_another_index_fails(honest):
    # The right row 0 with its own path, presented as row 1: the path's left/right order gives it away.
    opened = opened_rows(honest["c"], honest["levels"], ROWS)
    opened[1] = ch.Opened(honest["c"][0].copy(), ch.merkle_path(honest["levels"], 0))
    result = verdict(honest, ch.times_vector(honest["c"], ch.reveal_vector(R_SEED, N)), opened)
    assert not result.passed


def test_the_cheat_that_skips_the_product_cannot_open_rows(honest):
    """A cheater commits at once to a tree it can make without C, and answers C·r as A·(B·r), which costs O(n^2)
    after the reveal. C·r then checks out, but the opened rows cannot: either they are the garbage it committed
    to, or the true rows (computed after the reveal), which do not match its root."""
    r = ch.reveal_vector(R_SEED, N)
    shortcut = ch.generated_times(SEED, ch.MATRIX_A, N, ch.generated_times(SEED, ch.MATRIX_B, N, r))
    garbage = np.zeros((N, N), dtype=np.int16)
    levels = ch.merkle_levels([ch.leaf_hash(row) for row in garbage])
    root = levels[-1][0].hex()

    committed = verdict(honest, shortcut, opened_rows(garbage, levels, ROWS), root=root)
    assert not committed.passed and "is not row" in committed.reason

    true_rows = {i: ch.Opened(honest["c"][i].copy(), ch.merkle_path(levels, i)) for i in ROWS}
    recomputed = verdict(honest, shortcut, true_rows, root=root)
    assert not recomputed.passed and "does not match the committed Merkle root" in recomputed.reason


def test_a_node_that_computed_only_part_of_c_is_caught_by_an_opened_row(honest):
    c = honest["c"].copy()
    c[N // 2:] = 0  # half the work skipped
    levels = ch.merkle_levels([ch.leaf_hash(row) for row in c])
    r = ch.reveal_vector(R_SEED, N)
    result = verdict(honest, ch.times_vector(c, r), opened_rows(c, levels, ROWS), root=levels[-1][0].hex())
    assert not result.passed and "row 300 is not row 300" in result.reason
    # The chance to escape: every one of the 16 random openings lands in the computed half.
    assert 0.5 ** ch.OPENED_ROWS < 2e-5


def test_a_product_that_disagrees_with_its_own_rows_fails(honest):
    r = ch.reveal_vector(R_SEED, N)
    product = ch.times_vector(honest["c"], r)
    product[77] += 1
    result = verdict(honest, product, opened_rows(honest["c"], honest["levels"], ROWS))
    assert not result.passed and "(C·r)[77]" in result.reason


# ---------------------------------------------------------------------------------------------------- wire format


def proof_for(honest: dict, rows=ROWS, **overrides) -> ChallengeProof:
    r = ch.reveal_vector(R_SEED, N)
    fields = {"challenge_id": "c-0123456789abcdef", "node_id": "0123456789abcdef",
              "product": ch.encode_ints(ch.times_vector(honest["c"], r), ch.VECTOR_DTYPE),
              "rows": [OpenedRow(index=i, values=ch.encode_ints(honest["c"][i], ch.ROW_DTYPE),
                                 path=[h.hex() for h in ch.merkle_path(honest["levels"], i)]) for i in rows]}
    return ChallengeProof(**(fields | overrides))


def test_decode_proof_round_trip(honest):
    product, opened = ch.decode_proof(proof_for(honest), N, ROWS)
    assert ch.check_proof(SEED, N, honest["root"], R_SEED, product, opened).passed


@pytest.mark.parametrize("change, message", [
    (lambda p: {"rows": p.rows[:-1]}, "the reveal asked for"),
    (lambda p: {"rows": [*p.rows[:-1], p.rows[0]]}, "the reveal asked for"),
    (lambda p: {"product": p.product[:-8]}, "product has"),
    (lambda p: {"product": "***"}, "not base64"),
    (lambda p: {"rows": [p.rows[0].model_copy(update={"path": p.rows[0].path[:-1]}), *p.rows[1:]]}, "path has"),
    (lambda p: {"rows": [p.rows[0].model_copy(update={"values": base64.b64encode(b"xx").decode()}),
                         *p.rows[1:]]}, "row 0 has 2 bytes"),
])
def test_decode_proof_rejects_malformed_answers(honest, change, message):
    proof = proof_for(honest)
    with pytest.raises(ValueError, match=message):
        ch.decode_proof(proof.model_copy(update=change(proof)), N, ROWS)


def test_issue_sizes_must_be_powers_of_two_in_range():
    fields = {"challenge_id": "c-0123456789abcdef", "node_id": "0123456789abcdef", "seed": SEED,
              "device_class": "CPU", "time_limit": 3.0, "issued_at": 1.0, "deadline": 4.0}
    assert ChallengeIssue(n=1024, **fields).n == 1024
    for n in (1000, 128, 2 * ch.MAX_N):
        with pytest.raises(ValidationError):
            ChallengeIssue(n=n, **fields)


def test_proof_fields_are_bounded():
    with pytest.raises(ValidationError):
        ChallengeProof(challenge_id="c-0123456789abcdef", node_id="0123456789abcdef",
                       product="A" * (ch.MAX_VECTOR_B64 + 4), rows=[])


# ---------------------------------------------------------------------------------------------------- device classes


def resources(model: str | None, memory_gb: float = 80.0, cores: int = 16) -> Resources:
    gpus = [] if model is None else [{"model": model, "memory_gb": memory_gb}]
    return Resources(gpus=gpus, cpu_cores=cores, ram_gb=64.0)


@pytest.mark.parametrize("model, name", [
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"),
    ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe"),
    ("NVIDIA H100 NVL", "NVIDIA H100 NVL"),
    ("NVIDIA H200", "NVIDIA H200"),
    ("NVIDIA A100-SXM4-80GB", "NVIDIA A100"),
    ("NVIDIA A10G", "NVIDIA A10G"),
    ("NVIDIA A10", "NVIDIA A10"),
    ("NVIDIA L4", "NVIDIA L4"),
    ("NVIDIA L40S", "NVIDIA L40S"),
    ("Tesla T4", "NVIDIA T4"),
    ("Tesla V100-SXM2-16GB", "NVIDIA V100"),
    ("NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090"),
    ("NVIDIA GeForce RTX 3090", "NVIDIA GeForce RTX 3090"),
    ("NVIDIA RTX A6000", "NVIDIA RTX A6000"),
    ("AMD Instinct MI300X", "AMD Instinct MI300X"),
    ("Acme Tensor Brick 9000", "unknown GPU"),
])
def test_gpu_models_map_to_their_class(model, name):
    assert ch.gpu_class(model).name == name


def test_a_node_is_held_to_its_fastest_claimed_gpu():
    mixed = Resources(gpus=[{"model": "Tesla T4", "memory_gb": 16}, {"model": "NVIDIA H100 PCIe", "memory_gb": 80}],
                      cpu_cores=32, ram_gb=256)
    assert ch.device_class(mixed).name == "NVIDIA H100 PCIe"


def test_challenge_size_follows_the_class():
    assert ch.challenge_size(resources(None)) == ch.CPU_N
    assert ch.challenge_size(resources("NVIDIA H100 80GB HBM3")) == ch.GPU_N
    assert ch.challenge_size(resources("NVIDIA GeForce GTX 1050", memory_gb=4)) == ch.SMALL_GPU_N


def test_time_bound_per_class():
    h100 = ch.device_class(resources("NVIDIA H100 80GB HBM3"))
    t4 = ch.device_class(resources("Tesla T4"))
    cpu = ch.device_class(resources(None, cores=2))
    h100_limit = ch.time_limit(h100, ch.GPU_N)
    # The H100 bound: well under what a CPU of 150 GFLOPS (this development machine's 2 cores) needs for the
    # product alone, and well over what an H100 needs (the product at its datasheet rate plus the allowances).
    assert h100_limit < ch.matmul_flops(ch.GPU_N) / 150e9 / 5
    assert h100_limit > ch.matmul_flops(ch.GPU_N) / (h100.gflops * 1e9) + ch.BASE_ALLOWANCE
    assert 4.0 < h100_limit < 6.0
    # A slower class gets more time for the same n; the product term follows the datasheet rate.
    assert ch.time_limit(t4, ch.GPU_N) > h100_limit
    product_t4 = ch.time_limit(t4, ch.GPU_N) - ch.time_limit(h100, ch.GPU_N)
    assert product_t4 == pytest.approx(ch.SLACK * ch.matmul_flops(ch.GPU_N) * (1 / t4.gflops - 1 / h100.gflops) / 1e9)
    # CPU nodes: generous; a 2-core node of 2 GFLOPS per core has seconds for n = 1024 (~2 GFLOP).
    assert not cpu.gpu and cpu.gflops == 2 * ch.CPU_GFLOPS_PER_CORE
    assert ch.time_limit(cpu, ch.CPU_N) > ch.matmul_flops(ch.CPU_N) / (cpu.gflops * 1e9)
    # More claimed cores is a tighter bound, down to the allowances: the claim is checked too.
    assert ch.time_limit(ch.device_class(resources(None, cores=64)), ch.CPU_N) < ch.time_limit(cpu, ch.CPU_N)
    # An unknown GPU is held to a lenient rate, still far above any CPU class.
    assert ch.UNKNOWN_GPU.gflops < min(tflops for _, _, tflops in ch.GPU_TABLE) * 1000
