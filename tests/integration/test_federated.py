"""End to end: a federated job on data the nodes keep (examples/federated), non-IID, with real processes.

Three node daemons each hold their own part of the byo example's data (three of its four classes each, so no
node sees every class) under the name "byo-part" in their settings; a fourth holds none and must not be matched. The job
names the dataset (`local_dataset`) and trains in mode "fedavg". Every node talks to the coordinator through a relay
in this test that reads every byte they send: no window of any part's training data is among them, and nothing
the coordinator stored (blobs, artifacts, database) holds any either.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from localswarm import LocalSwarm
from test_local_swarm import wait_for_job

pytestmark = pytest.mark.integration
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TARGET = 0.85  # the job's stop rule: accuracy >= 0.85 on the whole validation split
WINDOW = 64  # bytes of a part's training data that, found anywhere, would mean it left its node


class ScanningRelay:
    """A TCP relay to the coordinator that keeps every byte the nodes send through it, to search afterwards."""

    def __init__(self, target_port: int):
        self.target_port, self.sent = target_port, bytearray()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pipe, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, outbound: bool) -> None:
        try:
            while data := source.recv(65536):
                if outbound:
                    with self.lock:
                        self.sent += data
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


def windows(data: bytes) -> list[bytes]:
    return [data[i:i + WINDOW] for i in range(0, len(data) - WINDOW, len(data) // 16)]


def test_a_federated_job_learns_from_data_that_never_leave_the_nodes(swarm_lab, tmp_path):
    source = tmp_path / "data"
    subprocess.run([sys.executable, str(EXAMPLES / "byo" / "make_data.py"), "--out", str(source)], check=True)
    subprocess.run([sys.executable, str(EXAMPLES / "federated" / "split_data.py"), "--source", str(source),
                    "--out", str(tmp_path / "parts"), "--parts", "3"], check=True, capture_output=True)
    parts = [tmp_path / "parts" / str(i) for i in range(3)]
    classes = [set(np.load(p / "train_y.npy").tolist()) for p in parts]
    assert all(len(c) == 3 for c in classes) and set().union(*classes) == {0, 1, 2, 3}  # non-IID

    lab: LocalSwarm = swarm_lab()
    lab.start_coordinator()
    relay = ScanningRelay(int(lab.url.rsplit(":", 1)[1]))
    try:
        for i, part in enumerate(parts):
            lab.start_node(i, 0.5, "--allow-custom-code", "--coordinator", f"http://127.0.0.1:{relay.port}",
                           env={"GPUSWARM_NODE_DATASETS": json.dumps({"byo-part": str(part)})})
        lab.start_node(3, 0.0, "--allow-custom-code")  # the cheapest, but it holds no such dataset
        nodes = lab.wait_for_nodes(4)
        assert sorted(n.resources.datasets for n in nodes) == [[], ["byo-part"], ["byo-part"], ["byo-part"]]

        job = lab.submit_file(EXAMPLES / "federated" / "job.toml")
        done = wait_for_job(lab, job.id, timeout=600)
        assert done.state == "completed", (done.state, done.error, done.progress)
        assert done.final_metrics["accuracy"] >= TARGET
        assert {a.node_id for a in done.assignments} == {lab.node_id(i) for i in range(3)}  # not node 3
        assert done.spec.local_dataset == "byo-part" and done.spec.dataset is None
    finally:
        relay.close()

    # Nothing of any part's training data went to the coordinator, or was stored there.
    sent = bytes(relay.sent)
    assert len(sent) > 10_000  # registration, heartbeats, claims, the model: the relay saw the traffic
    stored = b"".join(f.read_bytes() for f in (lab.root / "coordinator").rglob("*") if f.is_file())
    for part in parts:
        for name in ("train_x.npy", "train_y.npy"):
            for window in windows((part / name).read_bytes()[128:]):  # past the .npy header, which all share
                assert window not in sent, f"{part / name} was sent to the coordinator"
                assert window not in stored, f"{part / name} is in the coordinator's store"
