"""The scaling benchmark's floor (scripts/bench/scaling.py): a job's workload trained by one plain PyTorch process
with one thread, the way one machine would train it, evaluating every `--eval-every` steps. Prints one JSON line,
`seconds` (from this process's start to the evaluation that met the stop rule's target, or null), `steps` and
`metric`.

Its seconds count from the process's start as the kernel recorded it, so they include starting Python, importing
torch and reading the data, as a node's seconds include its trainer's start. This module imports nothing of the
benchmark's lab for the same reason: until 2026-12-02 the loop ran inside scaling.py, whose imports (torch among
them, matplotlib, the lab) came before its clock started, which left 8 of a digits loop's 13 s under 0.4 CPU out.

Run: python scripts/bench/plain_loop.py --spec JSON --data DIR [--code DIR] [--eval-every 20] [--max-seconds 900]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def since_start() -> float:
    """Seconds since this process started: /proc/self/stat's start time, in clock ticks since boot."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True, help="the job spec's fields, JSON (the workload and its stop rule)")
    parser.add_argument("--data", required=True, type=Path)
    parser.add_argument("--code", type=Path, help="the job's code directory, for a workload of the owner's own")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--max-seconds", type=float, default=900.0)
    args = parser.parse_args(argv)

    import torch
    from gpuswarm.node.trainer import ShardStream, build_workload, configure_torch
    from gpuswarm.proto.models import JobSpec

    configure_torch(1)  # as the node's trainer: one thread, subnormals flushed
    spec = JobSpec.model_validate(json.loads(args.spec))
    (name, op, value), = spec.stop.metric_targets()
    with tempfile.TemporaryDirectory() as work:
        workload, _ = build_workload(spec, args.code, args.data, torch.device("cpu"), Path(work))
        model = workload.build_model()
        optimizer = workload.optimizer().build([p for p in model.parameters() if p.requires_grad])
        stream = ShardStream(workload, 0)
        stream.reshard(0, 1, 0)
        step = 0
        while since_start() < args.max_seconds:
            loss = workload.loss(model, stream.next())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % args.eval_every == 0:
                metric = workload.evaluate(model)[name]
                if metric <= value if op == "<=" else metric >= value:
                    print(json.dumps({"seconds": since_start(), "steps": step, "metric": metric}), flush=True)
                    return 0
    print(json.dumps({"seconds": None, "steps": step, "metric": None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
