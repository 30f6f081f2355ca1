"""DiLoCo in one process: how many inner steps k workers need to reach a tinylm target, without a network.

k workers each step their own copy of tinylm (the scaling bench's model and data) with the workload's AdamW on their
own shard, `--h` inner steps at `--batch` each; then the anchor takes an outer SGD step on the mean of their
pseudo-gradients (anchor - worker), and is evaluated. Prints one JSON line: rounds and per-worker inner steps until
val_bpb <= `--target`, and the CPU per worker step (a ratio between runs of one session; other load moves it).
`--codec` sends the pseudo-gradients through an averaging codec as a round does: each worker's cut into the
averager's parts and encoded, the mean of the decoded parts encoded again on its way back.
It answers what the swarm could do if rounds cost nothing (decision 0033); scripts/bench/run scaling measures the
real thing.

Run: .venv/bin/python scripts/bench/diloco_sim.py --k 4 --batch 8 --h 32 [--olr 1.0 --mom 0.0] [--target 3.9]
     [--codec none|fp16|8bit]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT / "scripts"), str(ROOT / "examples" / "tinylm")]

from gpuswarm.node.trainer import ShardStream, build_workload  # noqa: E402
from gpuswarm.proto.models import JobSpec  # noqa: E402
from scaling import TINYLM  # noqa: E402
from split import corpus  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=1, help="workers")
    p.add_argument("--batch", type=int, default=32, help="batch per worker")
    p.add_argument("--h", type=int, default=8, help="inner steps per round")
    p.add_argument("--olr", type=float, default=1.0, help="outer learning rate")
    p.add_argument("--mom", type=float, default=0.0, help="outer momentum (Nesterov when > 0)")
    p.add_argument("--target", type=float, default=3.9, help="val_bpb to reach")
    p.add_argument("--max-rounds", type=int, default=400)
    p.add_argument("--codec", choices=["none", "fp16", "8bit"], default="none",
                   help="what a round sends (hivemind_adapter.averager_compression)")
    a = p.parse_args()
    from gpuswarm.node.trainer import configure_torch

    configure_torch(1)  # as the node's trainer: one thread, subnormals flushed
    with tempfile.TemporaryDirectory() as tmp:
        spec = JobSpec.model_validate({
            "code": {"sha256": "0" * 64, "size": 1, "format": "tar", "entrypoint": "tinylm.workload:TinyLM"},
            "hyperparameters": {**TINYLM, "batch_size": a.batch}})
        workload, _ = build_workload(spec, ROOT / "examples" / "tinylm", corpus(Path(tmp) / "stdlib"),
                                     torch.device("cpu"), Path(tmp))
        anchor = workload.build_model()
        workers = []
        for k in range(a.k):
            model = copy.deepcopy(anchor)
            stream = ShardStream(workload, 0)
            stream.reshard(k, a.k, 0)
            workers.append((model, workload.optimizer().build(list(model.parameters())), stream))
        params = list(anchor.parameters())
        outer = torch.optim.SGD(params, lr=a.olr, momentum=a.mom, nesterov=a.mom > 0)
        started, bpb, rounds = time.process_time(), float("inf"), 0
        while bpb > a.target and rounds < a.max_rounds:
            rounds += 1
            deltas = [torch.zeros_like(q) for q in params]
            mine = []  # each worker's own pseudo-gradient, for --codec
            for model, optimizer, stream in workers:
                with torch.no_grad():
                    for q, w in zip(params, model.parameters(), strict=True):
                        w.copy_(q)
                for _ in range(a.h):
                    workload.loss(model, stream.next()).backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                with torch.no_grad():
                    for d, q, w in zip(deltas, params, model.parameters(), strict=True):
                        d += (q - w) / a.k
                    if a.codec != "none":
                        mine.append(torch.cat([(q - w).flatten() for q, w in zip(params, model.parameters(),
                                                                                  strict=True)]))
            if a.codec != "none":
                deltas = through_codec(mine, a.codec, deltas)
            for q, d in zip(params, deltas, strict=True):
                q.grad = d
            outer.step()
            outer.zero_grad()
            with torch.no_grad():
                bpb = workload.evaluate(anchor)["val_bpb"]
        cpu = time.process_time() - started
    print(json.dumps({"k": a.k, "batch": a.batch, "h": a.h, "olr": a.olr, "mom": a.mom, "rounds": rounds,
                      "steps_per_worker": rounds * a.h, "val_bpb": round(bpb, 3),
                      "cpu_per_worker_step_ms": round(cpu / (rounds * a.h * a.k) * 1000, 1)}))


def through_codec(mine: list[torch.Tensor], codec_name: str, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """The mean of the workers' flat pseudo-gradients as a round of this codec returns it. As in hivemind's
    all-reduce: the vector is cut into one share per worker, each share into parts of the averager's part size
    (in encoded bytes); every worker's part is encoded and decoded, and the mean of the decoded parts encoded and
    decoded again on its way back. In `like`'s shapes."""
    from gpuswarm.dht.hivemind_adapter import averager_compression, averager_options
    from hivemind.compression import CompressionInfo, deserialize_torch_tensor

    codec = averager_compression(codec_name)
    ratio = codec.estimate_compression_ratio(CompressionInfo.from_tensor(mine[0]))
    part = int(averager_options()["part_size_bytes"] / (mine[0].element_size() * ratio))

    def roundtrip(flat: torch.Tensor) -> torch.Tensor:
        return torch.cat([deserialize_torch_tensor(codec.compress(chunk, CompressionInfo.from_tensor(chunk)))
                          for share in flat.tensor_split(len(mine)) for chunk in share.split(part)])

    mean = roundtrip(torch.stack([roundtrip(m) for m in mine]).mean(0))
    return [chunk.view_as(t) for chunk, t in zip(mean.split([t.numel() for t in like]), like, strict=True)]


if __name__ == "__main__":
    main()
