"""What the trusted/sandboxed split costs per training step, measured side by side in one run.

For each workload (the built-in digits-mlp, and examples/tinylm on a slice of this machine's standard library) the
same local step is timed three ways, after a warm-up:
- in-process: what the worker did before the split: batch, forward, loss, backward, and the gradients added into
  a float32 accumulator (hivemind's local accumulation) in the same process;
- split: the trainer in a plain child process (as a built-in runs on a node without bubblewrap): the worker's
  request, the trainer's step, the gradients through shared memory, the worker's copy-out and finite check, then
  the same accumulation;
- sandboxed: the same, with the trainer in its bubblewrap sandbox (what every job runs on a node that has it).
Plus the cost of an averaged step's parameter hand-over (the worker publishes, the trainer takes them before its
next step), measured as the step time with a new parameter version every step minus without.

Run: scripts/bench/run split [--steps N] [--device cpu|cuda]. Prints the table and appends it to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch
from gpuswarm.node import sandbox
from gpuswarm.node.trainer import ShardStream, build_workload
from gpuswarm.node.trainer_link import Inputs, Settings, TrainerLink
from gpuswarm.node.worker import SharedParams
from gpuswarm.proto.models import JobSpec
from gpuswarm.sdk import to_device

ROOT = Path(__file__).resolve().parents[2]
TINYLM_CPU = {"context": 64, "d_model": 192, "n_layer": 3, "n_head": 6, "batch_size": 32}
TINYLM_GPU = {"context": 512, "d_model": 512, "n_layer": 8, "n_head": 8, "batch_size": 64, "chunk": 65536,
              "val_windows": 64}


def corpus(directory: Path) -> Path:
    """The standard library's top-level modules (about 5 MB of Python): tinylm's text."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    directory.mkdir(parents=True, exist_ok=True)
    for path in sorted(stdlib.glob("*.py")):
        (directory / path.name).write_bytes(path.read_bytes())
    return directory


def specs(data: Path, device: str) -> list[tuple[str, JobSpec, Inputs]]:
    digits = JobSpec.model_validate({"workload": "digits-mlp", "stop": {"max_steps": 1}})
    tinylm = JobSpec.model_validate({
        "code": {"sha256": "0" * 64, "size": 1, "format": "tar", "entrypoint": "tinylm.workload:TinyLM"},
        "hyperparameters": {**(TINYLM_GPU if device == "cuda" else TINYLM_CPU), "val_windows": 16},
        "stop": {"max_steps": 1}})
    return [("digits-mlp", digits, Inputs()),
            ("tinylm", tinylm, Inputs(code=ROOT / "examples" / "tinylm", dataset=data))]


def median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1000


def in_process(spec: JobSpec, inputs: Inputs, steps: int, device: torch.device, workdir: Path) -> tuple[float, int]:
    if inputs.code is not None:
        sys.path.insert(0, str(inputs.code))
    workload, _ = build_workload(spec, inputs.code, inputs.dataset, device, workdir)
    model = workload.build_model().to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    accumulator = torch.zeros(sum(p.numel() for p in params))
    stream = ShardStream(workload, 0)
    stream.reshard(0, 1, 0)
    times = []
    for i in range(steps + 5):
        t0 = time.perf_counter()
        loss = workload.loss(model, to_device(stream.next(), device))
        loss.backward()
        offset = 0
        for p in params:  # hivemind accumulates the local gradients in float32 on the host
            accumulator[offset:offset + p.numel()].add_(p.grad.reshape(-1).float().cpu())
            offset += p.numel()
            p.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 5:
            times.append(time.perf_counter() - t0)
    return median_ms(times), accumulator.numel()


def split(spec: JobSpec, inputs: Inputs, steps: int, sandboxed: bool, workdir: Path,
          gpus: list[str]) -> tuple[float, float]:
    """(ms per step, ms per step when every step also hands over new parameters)."""
    link = TrainerLink(workdir, Settings(sandboxed=sandboxed, answer_timeout=300))
    try:
        link.start(spec.model_dump(mode="json"), inputs, gpus, threads=1, nice=0)
        shared = SharedParams(link)
        accumulator = torch.zeros_like(shared.grad_flat)

        def step() -> float:
            t0 = time.perf_counter()
            link.request("step", "step", "bench", version=shared.version, index=0, count=1, step=0, resume=None)
            shared.take_grads()
            accumulator.add_(shared.grad_flat)
            return time.perf_counter() - t0

        for _ in range(5):
            step()
        plain = [step() for _ in range(steps)]
        handed = []
        for _ in range(steps):
            t0 = time.perf_counter()
            shared.publish()  # the worker's side of an averaged step; the trainer takes them in its next step
            step()
            handed.append(time.perf_counter() - t0)
        return median_ms(plain), median_ms(handed)
    finally:
        link.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to docs/benchmarks.md")
    args = parser.parse_args()
    from gpuswarm.node.trainer import configure_torch

    configure_torch(1)  # as the node's trainer: one thread, subnormals flushed
    device = torch.device(args.device)
    gpus = ["0"] if device.type == "cuda" else []
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
    why = sandbox.unavailable_reason()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = corpus(Path(tmp) / "corpus")
        for name, spec, inputs in specs(data, device.type):
            base, numel = in_process(spec, inputs, args.steps, device, Path(tmp) / f"{name}-in")
            child, child_handed = split(spec, inputs, args.steps, False, Path(tmp) / f"{name}-child", gpus)
            boxed = boxed_handed = None
            if why is None:
                boxed, boxed_handed = split(spec, inputs, args.steps, True, Path(tmp) / f"{name}-box", gpus)
            rows.append((name, numel, base, child, boxed, child_handed - child,
                         None if boxed is None else boxed_handed - boxed))
            print(rows[-1], flush=True)
    fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [f"## split: trusted worker and sandboxed trainer ({time.strftime('%Y-%m-%d')}, {platform.machine()}, "
             f"{os.cpu_count()} cores, {args.device}, torch {torch.__version__}, 1 thread, "
             f"median of {args.steps} steps)",
             "", "| workload | parameters | in-process ms/step | split ms/step | sandboxed ms/step | sandboxed / "
             "in-process | parameter hand-over ms (split / sandboxed) |", "|---|---|---|---|---|---|---|"]
    for name, numel, base, child, boxed, hand_child, hand_boxed in rows:
        ratio = "n/a" if boxed is None else f"{boxed / base:.2f}x"
        lines.append(f"| {name} | {numel:,} | {base:.2f} | {child:.2f} | {fmt(boxed)} | {ratio} | "
                     f"{fmt(hand_child)} / {fmt(hand_boxed)} |")
    if why is not None:
        lines += ["", f"No sandbox on this machine: {why}"]
    table = "\n".join(lines) + "\n"
    print(table)
    if not args.no_write:
        with open(ROOT / "docs" / "benchmarks.md", "a") as f:
            f.write("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
