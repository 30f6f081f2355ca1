"""The node's client of the coordinator: every request is a signed envelope (or carries one in a header).

The daemon talks to the coordinator only through this interface, so unit tests can drive the daemon with a
stand-in and integration tests use the real service. Failures split in two: `CoordinatorUnavailable` (network
errors, 5xx: try again later) and `Rejected` (4xx: the coordinator understood and said no).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import aiohttp
from gpuswarm.node.identity import Identity
from gpuswarm.proto import challenge as challenge_proto
from gpuswarm.proto.models import (
    ArtifactMeta,
    Assignment,
    AssignmentPoll,
    Heartbeat,
    MeshConfig,
    MeshPoll,
    NodeRegistration,
    RegistrationResponse,
    RoundReport,
)

ENVELOPE_HEADER = "X-Gpuswarm-Envelope"
MESH_POLL_TIMEOUT = 40.0  # longer than the coordinator holds a long-poll (20 s)


class CoordinatorUnavailable(ConnectionError):
    pass


class Rejected(Exception):
    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


class CoordinatorClient:
    def __init__(self, base_url: str, identity: Identity, *, timeout: float = 10.0):
        self.base_url = base_url.rstrip("/")
        self.identity = identity
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> CoordinatorClient:
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self

    async def __aexit__(self, *exc) -> None:
        if self._session is not None:
            await self._session.close()

    async def _request(self, method: str, path: str, **kwargs) -> Any:
        if self._session is None:
            raise RuntimeError("use CoordinatorClient as an async context manager")
        try:
            async with self._session.request(method, self.base_url + path, **kwargs) as response:
                body = await response.read()
                if response.status >= 500:
                    raise CoordinatorUnavailable(f"coordinator answered {response.status}")
                data = json.loads(body) if body else {}
                if response.status >= 400:
                    error = data.get("error", {}) if isinstance(data, dict) else {}
                    raise Rejected(response.status, error.get("code", "error"), error.get("message", body[:200]))
                return data
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise CoordinatorUnavailable(f"cannot reach the coordinator at {self.base_url}: {e!r}") from None
        except json.JSONDecodeError:
            raise CoordinatorUnavailable("coordinator sent a response that is not JSON") from None

    async def _signed(self, path: str, kind: str, payload: dict, **kwargs) -> Any:
        envelope = self.identity.sign(kind, payload).model_dump(mode="json")
        return await self._request("POST", path, json=envelope, **kwargs)

    async def register(self, registration: NodeRegistration) -> RegistrationResponse:
        data = await self._signed("/v1/nodes/register", "register", registration.model_dump(mode="json"))
        return RegistrationResponse.model_validate(data)

    async def heartbeat(self, heartbeat: Heartbeat) -> dict:
        return await self._signed("/v1/nodes/heartbeat", "heartbeat", heartbeat.model_dump(mode="json"))

    async def assignments(self) -> list[Assignment]:
        data = await self._signed("/v1/nodes/assignments", "poll",
                                  AssignmentPoll(node_id=self.identity.node_id).model_dump(mode="json"))
        return [Assignment.model_validate(a) for a in data["assignments"]]

    async def mesh_peers(self, since: int) -> MeshConfig:
        """Long-poll: returns when the coordinator's mesh version passes `since` (or after its poll timeout)."""
        data = await self._signed("/v1/mesh/peers", "mesh_poll",
                                  MeshPoll(node_id=self.identity.node_id, since=since).model_dump(mode="json"),
                                  timeout=aiohttp.ClientTimeout(total=MESH_POLL_TIMEOUT))
        return MeshConfig.model_validate(data)

    async def report_round(self, report: RoundReport) -> dict:
        return await self._signed("/v1/rounds", "round_report", report.model_dump(mode="json"))

    async def upload(self, job_id: str, path: Path, *, final: bool, accuracy: float | None = None,
                     epoch: float | None = None) -> None:
        data = path.read_bytes()
        meta = ArtifactMeta(job_id=job_id, node_id=self.identity.node_id, name=path.name,
                            sha256=hashlib.sha256(data).hexdigest(), size=len(data), final=final,
                            accuracy=accuracy, epoch=epoch)
        envelope = self.identity.sign("artifact", meta.model_dump(mode="json"))
        await self._request("PUT", f"/v1/jobs/{job_id}/artifacts/{path.name}", data=data,
                            headers={ENVELOPE_HEADER: envelope.model_dump_json(),
                                     "Content-Type": "application/octet-stream"})

    # GPU challenge (proto/challenge.py): start when the heartbeat answer asks, commit the root, prove the rows.

    async def challenge_start(self) -> challenge_proto.ChallengeIssue:
        data = await self._signed("/v1/challenges", challenge_proto.START_KIND,
                                  challenge_proto.ChallengeStart(node_id=self.identity.node_id).model_dump(mode="json"))
        return challenge_proto.ChallengeIssue.model_validate(data)

    async def challenge_commit(self, commit: challenge_proto.ChallengeCommit) -> challenge_proto.CommitAnswer:
        data = await self._signed(f"/v1/challenges/{commit.challenge_id}/commit", challenge_proto.COMMIT_KIND,
                                  commit.model_dump(mode="json"))
        return challenge_proto.CommitAnswer.model_validate(data)

    async def challenge_proof(self, proof: challenge_proto.ChallengeProof) -> challenge_proto.ChallengeResult:
        # The coordinator checks the proof in O(n^2) (seconds for the largest challenges): a longer timeout.
        data = await self._signed(f"/v1/challenges/{proof.challenge_id}/proof", challenge_proto.PROOF_KIND,
                                  proof.model_dump(mode="json"), timeout=aiohttp.ClientTimeout(total=120.0))
        return challenge_proto.ChallengeResult.model_validate(data)
