"""GPU-challenge benchmark on this machine: what a CPU can do against each class's time bound, and what checking
an answer costs the coordinator.

Measures, on the CPU with torch (as a node without a GPU computes):
- matmul: float32 GFLOP/s of this CPU (torch, n = 4096, best of 3);
- solve: the node's whole timed work (generate A and B, C = A @ B in row blocks, hash the rows) for the CPU class
  (n = 1024) and for the H100 class (n = 16384), run to the end (no giving up), against the class's time bound;
- verify: the coordinator's check of an honest answer (proto.challenge.check_proof) for n = 1024 and 16384.

Run: scripts/bench/run challenge [--skip-h100]. Prints the table and appends it to
docs/benchmarks.md. The full H100-class product takes a minute or more on a small CPU.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch
from gpuswarm.node.challenge import rehearse, warm_up
from gpuswarm.proto import challenge as ch
from gpuswarm.proto.models import Resources

ROOT = Path(__file__).resolve().parents[2]


def cpu_gflops(n: int = 4096, runs: int = 3) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(runs))
    return ch.matmul_flops(n) / best / 1e9


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def run_class(label: str, resources: Resources) -> list[str]:
    r = rehearse(resources, "cpu")
    if not r.proof_ok:
        raise SystemExit(f"an honest answer failed: {r.reason}")
    within = "yes" if r.passed else "NO"
    return [f"| {label} | {r.issue.device_class} | {r.issue.n} | {r.seconds:.2f} | {r.issue.time_limit:.2f} | "
            f"{within} | {r.gflops:.0f} | {r.check_seconds:.2f} |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-h100", action="store_true", help="skip the minute-long H100-class product")
    args = parser.parse_args()
    warm_up("cpu")
    cores = len(os.sched_getaffinity(0))
    load = os.getloadavg()[0]
    gflops = cpu_gflops()
    lines = [
        f"## GPU challenge on {platform.node()} ({cores} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, load average {load:.1f} at start)",
        "",
        f"This CPU: {gflops:.0f} GFLOP/s float32 (torch matmul, n = 4096, best of 3).",
        "",
        "| node claims | class | n | solve s (generate, multiply, hash) | bound s | within | GFLOP/s incl. overhead "
        "| coordinator check s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += run_class("CPU, 2 cores", Resources(cpu_cores=2, ram_gb=8))
    if not args.skip_h100:
        lines += run_class("NVIDIA H100 80GB HBM3 (computed on this CPU)",
                           Resources(gpus=[{"model": "NVIDIA H100 80GB HBM3", "memory_gb": 80}], cpu_cores=2,
                                     ram_gb=8))
    lines.append("")
    text = "\n".join(lines)
    print(text)
    with open(ROOT / "docs" / "benchmarks.md", "a") as f:
        f.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
