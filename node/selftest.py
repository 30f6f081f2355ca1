"""`gpuswarm node self-test`: before a node goes live, check what a renter relies on, each with a verdict.

Owns the checks and their verdicts (`Check`: pass, warn, fail):
- gpu: the GPUs the driver sees, and that torch can use them through CUDA (a driver without a working CUDA fails;
  no GPU at all is a CPU node: a warning);
- challenge: a GPU challenge of this node's class (`gpuswarm.node.challenge.rehearse`), issued, solved and checked
  here; it fails when the proof does not check out or the time bound the coordinator would set is missed;
- disk: free space in the state directory for the artifact cache (`cache_gb`) and 1 GiB more;
- coordinator: GET /v1/health answers, with its version and clock;
- mesh: with the mesh on, WireGuard (the kernel module, or wireguard-go and /dev/net/tun) and CAP_NET_ADMIN; off, a
  warning (unencrypted);
- sandbox: the hostile probes of `gpuswarm node sandbox-check`, all contained (a failure only when this node runs
  job owners' code; otherwise a warning).
Any failure makes the command exit 1.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from gpuswarm.node.settings import NodeSettings

PASS, WARN, FAIL = "pass", "warn", "fail"
DISK_SPARE = 2**30  # beyond the cache: job workdirs, checkpoints before upload, logs
CAP_NET_ADMIN = 12


@dataclass(frozen=True)
class Check:
    name: str
    verdict: str
    detail: str
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def check_gpu(settings: NodeSettings) -> Check:
    from gpuswarm.node import gpu

    if settings.cpu:
        return Check("gpu", PASS, "CPU node (cpu = true): no GPU offered")
    driver, usable = gpu.nvml_gpus() or [], gpu.torch_gpus()
    if usable:
        names = ", ".join(f"{name} ({memory:.0f} GiB)" for name, memory in usable)
        return Check("gpu", PASS, f"{len(usable)} GPU(s) usable through CUDA: {names}")
    if driver:
        return Check("gpu", FAIL, f"the driver sees {len(driver)} GPU(s) ({driver[0][0]}), but torch cannot use "
                                  "CUDA: check the CUDA build of torch and the driver version")
    return Check("gpu", WARN, "no GPU found: this node offers its CPU only")


def check_challenge(settings: NodeSettings) -> Check:
    from gpuswarm.node.challenge import choose_device, rehearse
    from gpuswarm.node.gpu import probe

    resources = probe(force_cpu=settings.cpu)
    r = rehearse(resources, choose_device(resources))
    detail = (f"{r.issue.device_class}, n = {r.issue.n}: solved in {r.seconds:.2f} s of a {r.issue.time_limit:.2f} s "
              f"bound ({r.gflops:.0f} GFLOP/s)")
    if not r.proof_ok:
        return Check("challenge", FAIL, f"{detail}; the proof does not check out: {r.reason}")
    return Check("challenge", PASS if r.passed else FAIL, detail if r.passed else f"{detail}: TOO SLOW")


def check_disk(settings: NodeSettings) -> Check:
    where = settings.state_dir.resolve()
    while not where.exists():
        where = where.parent
    free, need = shutil.disk_usage(where).free, int(settings.cache_gb * 2**30) + DISK_SPARE
    detail = f"{free / 2**30:.1f} GiB free at {where}; the cache may use {settings.cache_gb:g} GiB, plus 1 GiB"
    return Check("disk", PASS if free >= need else FAIL, detail)


def check_coordinator(settings: NodeSettings, timeout: float = 10.0) -> Check:
    from gpuswarm.client.api import ApiError, SyncClient

    urls = [u.strip() for u in settings.coordinator.split(",") if u.strip()]
    problems = []
    for url in urls:
        try:
            with SyncClient(url, timeout=timeout) as api:
                health = api.health()
            skew = time.time() - health.time
            verdict = PASS if abs(skew) < 60 else WARN
            return Check("coordinator", verdict, f"{url}: version {health.version}, clocks {skew:+.1f} s apart")
        except ApiError as e:
            problems.append(f"{url}: {e}")
    return Check("coordinator", FAIL, "; ".join(problems) or "no coordinator URL")


def _has_cap_net_admin() -> bool:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_NET_ADMIN & 1)
    except OSError:
        pass
    return os.geteuid() == 0


def check_mesh(settings: NodeSettings) -> Check:
    from gpuswarm.mesh.backend import kernel_wireguard_available

    if not settings.mesh:
        return Check("mesh", WARN, "mesh off (mesh = false): hivemind traffic is NOT encrypted")
    problems = []
    if kernel_wireguard_available():
        how = "kernel WireGuard"
    elif shutil.which("wireguard-go"):
        how = "wireguard-go"
        if not Path("/dev/net/tun").exists():
            problems.append("/dev/net/tun is missing")
    else:
        how = None
        problems.append("no WireGuard: neither the kernel module nor wireguard-go")
    if not _has_cap_net_admin():
        problems.append("no CAP_NET_ADMIN (run as root, or with AmbientCapabilities=CAP_NET_ADMIN)")
    if problems:
        return Check("mesh", FAIL, "; ".join(problems))
    return Check("mesh", PASS, f"{how}, CAP_NET_ADMIN, UDP port {settings.listen_port}")


def check_sandbox(settings: NodeSettings) -> Check:
    from gpuswarm.node import sandbox
    from gpuswarm.node.sandboxcheck import run_check

    miss = FAIL if settings.allow_custom_code else WARN
    try:
        results = run_check()
    except sandbox.SandboxError as e:
        return Check("sandbox", miss, f"cannot sandbox job code: {e}")
    escaped = [r.probe for r in results if not r.ok]
    if escaped:
        return Check("sandbox", miss, f"NOT CONTAINED: {', '.join(escaped)}")
    return Check("sandbox", PASS, f"all {len(results)} hostile probes contained")


CHECKS: list[Callable[[NodeSettings], Check]] = [check_gpu, check_challenge, check_disk, check_coordinator,
                                                  check_mesh, check_sandbox]


def run(settings: NodeSettings, on_check: Callable[[Check], None] = lambda c: None) -> list[Check]:
    """Every check, in order; one that raises is a failure with the reason, never the end of the run."""
    results = []
    for check in CHECKS:
        name = check.__name__.removeprefix("check_")
        started = time.monotonic()
        try:
            result = check(settings)
        except Exception as e:  # noqa: BLE001 - the verdict says what broke
            result = Check(name, FAIL, f"the check itself failed: {e!r}")
        result = Check(result.name, result.verdict, result.detail, round(time.monotonic() - started, 1))
        results.append(result)
        on_check(result)
    return results
