"""What this machine offers: its GPUs (through nvidia-ml-py when installed and working, else torch.cuda asked in a
child process, so that the daemon never holds a CUDA context), its CPU cores and its RAM."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections import Counter

from gpuswarm.proto.models import GPUInfo, Resources

logger = logging.getLogger(__name__)


def _ram_gb() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def _cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def nvml_gpus() -> list[tuple[str, float]] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            found = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(handle)
                found.append((name.decode() if isinstance(name, bytes) else name,
                              pynvml.nvmlDeviceGetMemoryInfo(handle).total / 2**30))
            return found
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError as e:
        logger.info("nvidia-ml-py present but NVML failed (%s); falling back to torch.cuda", e)
        return None


_TORCH_PROBE = """
import json, torch
gpus = [] if not torch.cuda.is_available() else [
    (torch.cuda.get_device_properties(i).name, torch.cuda.get_device_properties(i).total_memory / 2**30)
    for i in range(torch.cuda.device_count())]
print(json.dumps(gpus))
"""


def torch_gpus() -> list[tuple[str, float]]:
    """The GPUs torch.cuda sees, asked in a child process: initialising CUDA in the daemon itself would keep a
    CUDA context (GPU memory, visible in nvidia-smi) for the daemon's whole life."""
    try:
        out = subprocess.run([sys.executable, "-c", _TORCH_PROBE], capture_output=True, text=True, timeout=120,
                             check=True).stdout
        return [(str(name), float(memory)) for name, memory in json.loads(out.strip().splitlines()[-1])]
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        logger.warning("could not probe GPUs through torch.cuda: %s", e)
        return []


def probe(force_cpu: bool = False) -> Resources:
    devices = [] if force_cpu else (nvml_gpus() or torch_gpus())
    counts = Counter((name, round(mem, 1)) for name, mem in devices)
    gpus = [GPUInfo(model=name, memory_gb=mem, count=n) for (name, mem), n in sorted(counts.items())]
    resources = Resources(gpus=gpus, cpu_cores=_cpu_cores(), ram_gb=round(_ram_gb(), 1))
    if gpus:
        logger.info("GPUs: %s", ", ".join(f"{g.count}x {g.model} ({g.memory_gb:.0f} GiB)" for g in gpus))
    else:
        logger.info("no GPU found; offering %d CPU cores and %.0f GiB RAM", resources.cpu_cores, resources.ram_gb)
    return resources
