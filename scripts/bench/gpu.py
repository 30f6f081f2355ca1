"""GPU benchmark: what a node gets out of its GPU. tinylm trained by a real node (a coordinator and one
`gpuswarm node start` on this machine: the GPU challenge, the sandboxed trainer, the worker's averaging loop) against
a plain PyTorch loop of the same model, data, batch, optimizer and precision on the same GPU, one after the other in
one run, with nvidia-smi sampled every 0.5 s during each for the GPU's utilisation and memory.

- plain loop: one process, the workload built as a node builds it, `optimizer.step()` every batch, after a warm-up;
  samples per second over `--seconds` of steps (no evaluation).
- node: the job's own figure, the samples its node trained over the wall time since its trainer started (what the
  worker reports in its progress: evaluation after every round, averaging rounds and the gradient hand-over
  from the sandbox included). The job stops after `--seconds` of training.
- GPU utilisation: nvidia-smi's utilization.gpu (the share of time a kernel ran), averaged over the training window
  of each (the node's from its first reported step to its end); memory: the most used.

The node's challenge result (its class's bound, its seconds, its GFLOPS) and the processes nvidia-smi saw on the
GPU during the job are printed too.

Run: scripts/bench/run gpu [--seconds 60] [--device cuda|cpu] [--threads 1,auto] [--no-write]. Prints the table and
appends it, with docs/img/gpu.png, to docs/benchmarks.md. On a machine without a GPU, `--device cpu` runs the same
comparison on the CPU (a smaller model). On a GPU machine without the venv, run this file with the python3 that
has gpuswarm installed, from outside the checkout (its gpuswarm/ folder would shadow the installed package).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT / "scripts")]

import charts  # noqa: E402
from localswarm import LocalSwarm  # noqa: E402
from split import TINYLM_CPU, TINYLM_GPU, corpus  # noqa: E402

TINYLM = ROOT / "examples" / "tinylm"


def params(device: str) -> dict:
    return {**(TINYLM_GPU if device == "cuda" else TINYLM_CPU), "val_windows": 16}


class Smi:
    """nvidia-smi sampled every 0.5 s in the background for GPU 0, the one the plain loop and the node use:
    (monotonic time, utilisation %, memory MiB)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []
        self.process = None
        if shutil.which("nvidia-smi"):
            self.process = subprocess.Popen(["nvidia-smi", "-i", "0", "--query-gpu=utilization.gpu,memory.used",
                                             "--format=csv,noheader,nounits", "-lms", "500"],
                                            stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with contextlib.suppress(ValueError):
                util, memory = (float(v) for v in line.split(",")[:2])
                self.samples.append((time.monotonic(), util, memory))

    def window(self, start: float, end: float) -> tuple[float | None, float | None]:
        """(mean utilisation %, most memory MiB) over [start, end]."""
        inside = [(u, m) for t, u, m in self.samples if start <= t <= end]
        if not inside:
            return None, None
        return statistics.fmean(u for u, _ in inside), max(m for _, m in inside)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)


def plain_loop(data: str, device_name: str, seconds: float) -> None:
    """The floor: the workload stepping alone in this process; prints one JSON line."""
    import torch
    from gpuswarm.node.trainer import configure_torch

    configure_torch(1)  # as the node's trainer: one thread, subnormals flushed
    sys.path.insert(0, str(TINYLM))
    from gpuswarm.node.trainer import ShardStream, build_workload
    from gpuswarm.proto.models import JobSpec
    from gpuswarm.sdk import to_device

    device = torch.device(device_name)
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
    spec = JobSpec.model_validate({"code": {"sha256": "0" * 64, "size": 1, "format": "tar",
                                            "entrypoint": "tinylm.workload:TinyLM"},
                                   "hyperparameters": params(device.type), "stop": {"max_steps": 1}})
    with tempfile.TemporaryDirectory() as work:
        workload, _ = build_workload(spec, TINYLM, Path(data), device, Path(work))
        model = workload.build_model().to(device)
        optimizer = workload.optimizer().build([p for p in model.parameters() if p.requires_grad])
        stream = ShardStream(workload, 0)
        stream.reshard(0, 1, 0)

        def step() -> int:
            batch = to_device(stream.next(), device)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = workload.loss(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return len(batch)

        for _ in range(10):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        started, samples, steps = time.monotonic(), 0, 0
        while time.monotonic() - started < seconds:
            samples += step()
            steps += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = time.monotonic() - started
        print(json.dumps({"samples_per_second": samples / elapsed, "steps": steps,
                          "ms_per_step": elapsed / steps * 1000, "started": started, "ended": time.monotonic(),
                          "bf16": bf16}))


def run_plain(data: Path, device: str, seconds: float) -> dict:
    out = subprocess.run([sys.executable, __file__, "--plain-loop", str(data), "--device", device,
                          "--seconds", str(seconds)], capture_output=True, text=True, timeout=seconds + 300)
    if out.returncode != 0:
        raise RuntimeError(f"the plain loop failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def job_file(path: Path, data: Path, device: str, seconds: float) -> Path:
    hyper = "\n".join(f"{k} = {json.dumps(v)}" for k, v in params(device).items())
    path.write_text(f"""name = "gpu-bench"
budget = 10.0

[code]
path = "{TINYLM}"
entrypoint = "tinylm.workload:TinyLM"

[dataset]
path = "{data}"

[params]
{hyper}

[stop]
max_seconds = {seconds}
max_epochs = 1000

[training]
precision = "bf16"
checkpoint_every_minutes = 60
""")
    return path


def run_node(root: Path, data: Path, device: str, seconds: float, smi: Smi, threads: str) -> dict:
    swarm = LocalSwarm(root)
    try:
        swarm.start_coordinator()
        # "--no-cpu" after LocalSwarm's "--cpu": the last one given wins, so the node offers its GPU.
        swarm.start_node(1, 0.0, "--allow-custom-code", *(["--no-cpu"] if device == "cuda" else []),
                         env={"GPUSWARM_TORCH_THREADS": "" if threads == "auto" else threads})
        node = swarm.wait_for_nodes(1, timeout=180)[0]
        swarm.wait(lambda: swarm.client.nodes()[0].verified, 300, "the node's challenge to pass")
        record = swarm.client.node_challenges(node.id).challenges[0]
        challenge = {"device_class": record.device_class, "n": record.n, "seconds": record.seconds,
                     "time_limit": record.time_limit, "gflops": record.measured_gflops}
        job = swarm.submit_file(job_file(root / "job.toml", data, device, seconds))
        first_step = apps = None
        deadline = time.monotonic() + seconds + 600
        while True:
            if time.monotonic() > deadline or swarm.nodes[1].poll() is not None:
                raise RuntimeError(f"the job did not end in time or the node exited\n{swarm.log_tail('node-1', 60)}")
            info = swarm.client.job(job.id)
            if first_step is None and info.progress.global_step > 0:
                first_step = time.monotonic()
            if apps is None and first_step is not None and shutil.which("nvidia-smi"):
                apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                                       "--format=csv,noheader"], capture_output=True, text=True,
                                      timeout=30).stdout.strip()
                (root / "nvidia-smi.txt").write_text(subprocess.run(["nvidia-smi"], capture_output=True, text=True,
                                                                    timeout=30).stdout)
            if info.state in ("completed", "failed", "cancelled"):
                break
            time.sleep(1.0)
        ended = time.monotonic()
        if info.state != "completed":
            raise RuntimeError(f"the job ended {info.state}: {info.error}\n{swarm.log_tail('node-1', 60)}")
        util, memory = smi.window(first_step or ended, ended)
        log = "\n".join(p.read_text(errors="replace") for p in (root / "node-1" / "jobs").glob("*/worker.log"))
        trained_on = next((line.split(" INFO training ", 1)[1] for line in log.splitlines()
                           if " INFO training " in line), "?")
        return {"samples_per_second": info.progress.samples_per_second, "global_steps": info.progress.global_step,
                "utilisation": util, "memory_mib": memory, "apps": apps, "trained_on": trained_on,
                "node": node.model_dump(mode="json"), "challenge": challenge}
    finally:
        swarm.stop()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plain-loop", help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda where there is one")
    parser.add_argument("--seconds", type=float, default=60.0, help="training time of each side")
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to docs/benchmarks.md")
    parser.add_argument("--threads", default="auto",
                        help='comma-separated GPUSWARM_TORCH_THREADS per node case ("auto": the node\'s default)')
    parser.add_argument("--keep", type=Path, help="keep the swarm's logs and databases under this directory")
    args = parser.parse_args()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.plain_loop:
        plain_loop(args.plain_loop, args.device, args.seconds)
        return 0
    smi = Smi()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = args.keep or Path(tmp)
            data = corpus(Path(tmp) / "corpus")
            plain = run_plain(data, args.device, args.seconds)
            plain["utilisation"], plain["memory_mib"] = smi.window(plain["started"], plain["ended"])
            print("plain loop:", json.dumps(plain), flush=True)
            nodes = []
            for threads in args.threads.split(","):
                nodes.append(run_node(root / f"swarm-{threads}", data, args.device, args.seconds, smi, threads))
                print(f"node ({threads} threads):", json.dumps(nodes[-1]), flush=True)
    finally:
        smi.stop()
    node = nodes[-1]
    gpu = node["node"]["resources"]["gpus"]
    what = gpu[0]["model"] if gpu else f"{os.cpu_count()} CPU cores"
    fmt = lambda v, f: "n/a" if v is None else format(v, f)  # noqa: E731
    h, c = params(args.device), node["challenge"]
    lines = [f"## gpu: one node against a plain loop on the same device ({time.strftime('%Y-%m-%d')}, "
             f"{platform.machine()}, {what}, tinylm d_model {h['d_model']}, {h['n_layer']} layers, context "
             f"{h['context']}, batch {h['batch_size']}, bf16 autocast: {plain['bf16']}, {args.seconds:g} s each)", "",
             "| case | samples/s | vs plain loop | GPU utilisation % (mean) | GPU memory MiB (most) |",
             "|---|---|---|---|---|",
             f"| plain PyTorch loop | {plain['samples_per_second']:.1f} | 1.00 | {fmt(plain['utilisation'], '.0f')} | "
             f"{fmt(plain['memory_mib'], '.0f')} |",
             *(f"| one gpuswarm node ({n['trained_on']}) | {n['samples_per_second']:.1f} | "
               f"{n['samples_per_second'] / plain['samples_per_second']:.2f} | {fmt(n['utilisation'], '.0f')} | "
               f"{fmt(n['memory_mib'], '.0f')} |" for n in nodes), "",
             f"The node's GPU challenge: {c['device_class']}, n = {c['n']}, committed in {c['seconds']:.2f} s of "
             f"{c['time_limit']:.2f} s ({c['gflops']:,.0f} GFLOPS measured). nvidia-smi's compute processes during "
             f"the job: {node['apps'] or 'n/a'}."]
    groups = ["plain loop", *(f"node, {n['trained_on'].rsplit(', ', 1)[-1]}" for n in nodes)]
    lines += ["", charts.bars("gpu", f"one node against a plain loop on {what}", groups, {
        "samples/s vs the plain loop": [1.0, *(n["samples_per_second"] / plain["samples_per_second"] for n in nodes)],
        "GPU utilisation (share of time)": [(r["utilisation"] or 0) / 100 for r in (plain, *nodes)]},
        "share", reference=(1.0, "the plain loop"))] if not args.no_write else []
    table = "\n".join(lines) + "\n"
    print(table)
    if not args.no_write:
        with open(ROOT / "docs" / "benchmarks.md", "a") as f:
            f.write("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
