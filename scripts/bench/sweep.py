"""scripts/bench/run sweep: the product's hyper-parameter sweep against Ray Tune's, side by side in one run.

Ours: a local swarm (a real coordinator and --nodes real node daemons on this machine, scripts/localswarm.py) runs
examples/sweep/sweep.toml: digits-mlp, 12 trials, 2 at a time, TPE, ASHA on epochs (first rung 1 epoch, factor 3),
up to 8 epochs a trial. Wall time is from `gpuswarm sweep submit` to the sweep's end. Then Ray Tune on the same
machine (scripts/bench/sweep_raytune.py, in .venv-ray: see its docstring) with the same space, trial count,
sampler settings, scheduler and epochs. They run one after the other, never together (2 cores).

Prints a Markdown table and appends it to docs/benchmarks.md (--no-write: print only). Without .venv-ray the Ray
row says so.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from localswarm import LocalSwarm  # noqa: E402

EXAMPLE = ROOT / "examples" / "sweep" / "sweep.toml"
RAY_PYTHON = ROOT / ".venv-ray" / "bin" / "python"


def ours(trials: int, nodes: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        sweep_file = Path(tmp) / "sweep.toml"
        sweep_file.write_text(EXAMPLE.read_text().replace("trials = 12", f"trials = {trials}"))
        lab = LocalSwarm(Path(tmp) / "swarm")
        try:
            lab.start_coordinator()
            for i in range(nodes):
                lab.start_node(i)
            lab.wait_for_nodes(nodes)
            started = time.perf_counter()
            out = subprocess.run([sys.executable, "-m", "gpuswarm.cli", "sweep", "submit", str(sweep_file), "-c",
                                  lab.url, "--token", lab.client.token, "--json"], capture_output=True, text=True,
                                 check=True).stdout
            sweep_id = json.loads(out)["id"]
            while (sweep := lab.client.sweep(sweep_id)).state == "running":
                time.sleep(1.0)
            seconds = time.perf_counter() - started
        finally:
            lab.stop()
    states = [t.state for t in sweep.trials]
    epochs = sum(max((x for x, _ in t.curve), default=0) for t in sweep.trials)
    return {"tool": f"gpuswarm ({nodes} nodes)", "trials": len(states), "pruned": states.count("pruned"),
            "best_accuracy": sweep.best.value if sweep.best else None,
            "best_params": sweep.best.params if sweep.best else None, "wall_seconds": round(seconds, 1),
            "epochs_reported": epochs, "state": sweep.state.value}


def ray(trials: int) -> dict | None:
    if not RAY_PYTHON.exists():
        return None
    out = subprocess.run([str(RAY_PYTHON), str(ROOT / "scripts" / "bench" / "sweep_raytune.py"), "--trials",
                          str(trials), "--json"], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return result | {"tool": f"Ray Tune {result['ray_version']} (1 process, 2 trials at a time)"}


def table(rows: list[dict], trials: int) -> str:
    lines = [f"## sweep ({time.strftime('%Y-%m-%d')}, {platform.machine()}, 2 cores, digits-mlp, {trials} trials, "
             "2 at a time, TPE with 4 random trials first, ASHA on epochs (1, 3), up to 8 epochs)", "",
             "| tool | best accuracy | trials stopped early | wall time (s) | best params |",
             "|---|---:|---:|---:|---|"]
    for r in rows:
        params = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in (r.get("best_params") or {}).items())
        accuracy = "-" if r.get("best_accuracy") is None else f"{r['best_accuracy']:.4f}"
        lines.append(f"| {r['tool']} | {accuracy} | {r.get('pruned', '-')} of {r.get('trials', '-')} | "
                     f"{r.get('wall_seconds', '-')} | {params} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=12)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--no-write", action="store_true", help="print only; do not append to docs/benchmarks.md")
    args = parser.parse_args()
    rows = [ours(args.trials, args.nodes)]
    rows.append(ray(args.trials) or {"tool": "Ray Tune: not run (no .venv-ray; see scripts/bench/sweep_raytune.py)"})
    for r in rows:
        print(json.dumps(r), file=sys.stderr)
    text = table(rows, args.trials)
    print(text)
    if not args.no_write:
        with open(ROOT / "docs" / "benchmarks.md", "a") as f:
            f.write("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
