"""The one client of the coordinator's /v1 API, used by the CLI, the scripts and tests, and the node daemon.

Owns the HTTP requests (aiohttp), the error family, parsing every answer into its response model (`proto.api`,
`proto.models`), the node's signed routes, and downloads streamed to disk and checked against their SHA-256.
`CoordinatorClient` is the async core; `SyncClient` runs that same core on one private event loop for callers
that have none (the CLI, the lab scripts). It knows nothing of the coordinator's internals: only the wire.

Errors are one family, `ApiError(message, status, code)`: `CoordinatorUnavailable` (no connection, a timeout, a
5xx, an answer that does not parse: try again later) and `Rejected` (4xx: the coordinator understood and said no).
The node daemon relies on that split.

Imports proto only. The GPU challenge's models (proto.challenge, which needs numpy) are imported inside the three
challenge calls, which only a node makes, so the job owner's slim install never loads numpy.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import os
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import quote

import aiohttp
from gpuswarm.proto.api import (
    ArtifactInfo,
    ArtifactList,
    ArtifactStored,
    AssignmentList,
    AuditAnswer,
    BlobsMissing,
    BlobStored,
    DhtPeers,
    Health,
    HeartbeatAnswer,
    JobAudits,
    JobContributions,
    JobDetail,
    JobInfo,
    JobList,
    JobStatement,
    JobSummary,
    NodeChallenges,
    NodeInfo,
    NodeList,
    NodeStatement,
    OwnerAccount,
    OwnerCreated,
    ProgressCurve,
    RevokeAnswer,
    RoundAnswer,
)
from gpuswarm.proto.audits import (
    EVIDENCE_KIND,
    FETCH_EVIDENCE_KIND,
    VERDICT_KIND,
    AuditVerdict,
    EvidenceFetch,
    EvidenceMeta,
)
from gpuswarm.proto.models import (
    ENVELOPE_HEADER,
    TENSORBOARD_ARTIFACT,
    ArtifactMeta,
    Assignment,
    AssignmentPoll,
    BlobFetch,
    Heartbeat,
    JobSpec,
    MeshConfig,
    MeshPoll,
    NodeRegistration,
    RegistrationResponse,
    RoundReport,
    is_job_id,
)
from gpuswarm.proto.signing import SignedEnvelope
from gpuswarm.proto.sweeps import SweepDetail, SweepList, SweepSpec, SweepSummary
from pydantic import BaseModel, ValidationError

if TYPE_CHECKING:
    from gpuswarm.proto.challenge import ChallengeCommit, ChallengeIssue, ChallengeProof, ChallengeResult, CommitAnswer

DEFAULT_URL = "http://127.0.0.1:8470"
MESH_POLL_TIMEOUT = 40.0  # longer than the coordinator holds a mesh long-poll (20 s)
PROOF_TIMEOUT = 120.0  # the coordinator checks a challenge proof in O(n^2): seconds for the largest
CHUNK = 1 << 20
_STREAM = float("inf")  # a request's timeout for uploads: no total limit, but every read must progress

M = TypeVar("M", bound=BaseModel)
Progress = Callable[[int], None]  # called with the bytes sent or received so far


class ApiError(Exception):
    """A call that did not succeed: `message` says why; `status` and `code` are the API's, when it answered."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.code = message, status, code


class CoordinatorUnavailable(ApiError):
    """No usable answer (network, timeout, 5xx, an answer that does not parse): try again later."""


class Rejected(ApiError):
    """A 4xx: the coordinator understood the request and refused it; sending it again will not help."""

    def __str__(self) -> str:
        return f"{self.status} {self.code or 'error'}: {self.message}"


class Signer(Protocol):
    """Who signs the node routes' bodies: `gpuswarm.node.identity.Identity`."""

    @property
    def node_id(self) -> str: ...

    def sign(self, kind: str, payload: dict) -> SignedEnvelope: ...


def file_digest(path: Path) -> tuple[str, int]:
    """The SHA-256 (hex) and size of a file, read in chunks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


async def file_chunks(path: Path, progress: Progress | None = None) -> AsyncIterator[bytes]:
    """The file's bytes in chunks, read off the event loop; `progress(bytes_sent_so_far)` after each."""
    sent = 0
    with open(path, "rb") as f:
        while chunk := await asyncio.to_thread(f.read, CHUNK):
            sent += len(chunk)
            yield chunk
            if progress is not None:
                progress(sent)


def _segment(value: str) -> str:
    """A path segment from a caller's value (an id, a file name): never a way to another route."""
    return quote(value, safe="")


class CoordinatorClient:
    """The async client. `token`: a job owner's API token or the admin token, sent as a bearer token. `signer`:
    the node identity that signs the node routes. Used as an async context manager it keeps one connection pool
    (the node daemon); otherwise each call opens and closes its own."""

    def __init__(self, base_url: str = DEFAULT_URL, signer: Signer | None = None, *, token: str | None = None,
                 timeout: float = 10.0):
        # Several coordinators of one database, comma-separated: calls go to one, and move to the next when it
        # cannot be reached (`_fail_over`).
        self.urls = [u.strip().rstrip("/") for u in base_url.split(",") if u.strip()] or [DEFAULT_URL]
        self._current = 0
        self.signer, self.token, self.timeout = signer, token, timeout
        self._session: aiohttp.ClientSession | None = None

    @property
    def base_url(self) -> str:
        return self.urls[self._current]

    def _fail_over(self) -> bool:
        """Move to the next coordinator URL, if there is another. Returns whether it moved."""
        if len(self.urls) == 1:
            return False
        self._current = (self._current + 1) % len(self.urls)
        return True

    async def __aenter__(self) -> CoordinatorClient:
        self._session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------------------------------------ transport

    @contextlib.asynccontextmanager
    async def _session_for_call(self) -> AsyncIterator[aiohttp.ClientSession]:
        if self._session is not None:
            yield self._session
            return
        async with aiohttp.ClientSession() as session:
            yield session

    def _headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return headers | dict(extra or {})

    def _unreachable(self, error: BaseException, timeout: float) -> CoordinatorUnavailable:
        if isinstance(error, TimeoutError):
            reason = f"no answer within {timeout:g}s"
        elif isinstance(error, aiohttp.ClientConnectorError):
            os_error = error.os_error
            reason = os.strerror(os_error.errno) if (os_error.errno or 0) > 0 else (os_error.strerror or str(os_error))
        else:
            reason = str(error) or type(error).__name__
        return CoordinatorUnavailable(f"cannot reach the coordinator at {self.base_url}: {reason}")

    def _refusal(self, status: int, body: bytes, what: str) -> ApiError:
        try:
            error = json.loads(body)["error"]
            message, code, from_api = str(error["message"]), error.get("code"), True
        except (ValueError, KeyError, TypeError):
            message, code, from_api = f"{self.base_url} answered HTTP {status} to {what}", None, False
        if not from_api and status < 500:
            # Not the API's error body: a proxy or load balancer answered, not the coordinator. Its 4xx says
            # nothing about the request, so it is a reason to try again later, never to drop a report or a model.
            return CoordinatorUnavailable(f"{message} (not the API's error body: a proxy in between?)", status=status)
        if status >= 500:
            if code is not None:
                message = f"the coordinator at {self.base_url} answered HTTP {status} to {what}: {message}"
            return CoordinatorUnavailable(message, status=status, code=code)
        return Rejected(message, status=status, code=code)

    async def request(self, method: str, path: str, body: Any = None, *, data: Any = None,
                      headers: Mapping[str, str] | None = None, params: Mapping[str, str] | None = None,
                      timeout: float | None = None) -> Any:
        """One call with `body` as JSON (or raw `data`: bytes, or an async iterator of chunks, streamed); its answer
        as plain JSON. The typed methods below parse it into their models; this is for what they do not cover (a
        test's hand-made request). `timeout`: the whole call's; `_STREAM` (a stream of unknown duration): each
        connect and read must progress within the client's timeout instead."""
        timeout = timeout or self.timeout
        what = f"{method} {path}"
        if timeout == _STREAM:
            limits = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout, sock_read=self.timeout)
            timeout = self.timeout
        else:
            limits = aiohttp.ClientTimeout(total=timeout)
        for attempt in range(len(self.urls)):
            try:
                async with self._session_for_call() as session, session.request(
                        method, self.base_url + path, json=body, data=data, params=params,
                        headers=self._headers(headers), timeout=limits) as response:
                    raw = await response.read()
                    status = response.status
                break
            except (aiohttp.ClientError, OSError) as e:  # TimeoutError is an OSError
                error = self._unreachable(e, timeout)
                # Refused before anything was sent: the same call goes to the next coordinator at once. Any other
                # failure may have reached the database (a signed message's nonce is then spent): the next call
                # goes there instead.
                moved = self._fail_over()
                if not (moved and isinstance(e, aiohttp.ClientConnectorError) and data is None
                        and attempt < len(self.urls) - 1):
                    raise error from None
        if status >= 400:
            raise self._refusal(status, raw, what)
        try:
            return json.loads(raw) if raw else {}
        except (ValueError, UnicodeDecodeError):
            raise CoordinatorUnavailable(f"the coordinator at {self.base_url} answered {what} with something that "
                                         f"is not JSON") from None

    async def _call(self, model: type[M], method: str, path: str, **kwargs) -> M:
        data = await self.request(method, path, **kwargs)
        try:
            return model.model_validate(data)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, x['loc'])) or 'answer'}: {x['msg']}" for x in e.errors()[:3])
            raise CoordinatorUnavailable(f"the coordinator at {self.base_url} answered {method} {path} with a "
                                         f"{model.__name__} this client cannot read ({problems})") from None

    def _envelope(self, kind: str, payload: BaseModel) -> SignedEnvelope:
        if self.signer is None:
            raise TypeError("this call is a node's: give the client a signer (the node's Identity)")
        return self.signer.sign(kind, payload.model_dump(mode="json"))

    async def _signed(self, model: type[M], path: str, kind: str, payload: BaseModel, **kwargs) -> M:
        envelope = self._envelope(kind, payload)
        return await self._call(model, "POST", path, body=envelope.model_dump(mode="json"), **kwargs)

    # ------------------------------------------------------------------------------------------------ anyone

    async def health(self) -> Health:
        return await self._call(Health, "GET", "/v1/health")

    async def dht(self) -> DhtPeers:
        return await self._call(DhtPeers, "GET", "/v1/dht")

    async def openapi(self) -> dict[str, Any]:
        return await self.request("GET", "/v1/openapi.json")

    async def nodes(self) -> list[NodeInfo]:
        return (await self._call(NodeList, "GET", "/v1/nodes")).nodes

    async def node_statement(self, node_id: str) -> NodeStatement:
        return await self._call(NodeStatement, "GET", f"/v1/nodes/{_segment(node_id)}/statement")

    async def node_challenges(self, node_id: str) -> NodeChallenges:
        return await self._call(NodeChallenges, "GET", f"/v1/nodes/{_segment(node_id)}/challenges")

    # ------------------------------------------------------------------------------------------------ job owner

    async def submit_job(self, spec: JobSpec | Mapping[str, Any]) -> JobInfo:
        body = spec.model_dump(mode="json") if isinstance(spec, JobSpec) else dict(spec)
        return await self._call(JobInfo, "POST", "/v1/jobs", body=body)

    async def jobs(self, state: str | None = None) -> list[JobSummary]:
        return (await self._call(JobList, "GET", "/v1/jobs", params={"state": state} if state else None)).jobs

    async def job(self, job_id: str) -> JobDetail:
        return await self._call(JobDetail, "GET", f"/v1/jobs/{_segment(job_id)}")

    async def contributions(self, job_id: str) -> JobContributions:
        return await self._call(JobContributions, "GET", f"/v1/jobs/{_segment(job_id)}/contributions")

    async def progress(self, job_id: str, after: int | None = None) -> ProgressCurve:
        """The job's training curve: points after step `after` (all when None), at most 5000 per answer."""
        return await self._call(ProgressCurve, "GET", f"/v1/jobs/{_segment(job_id)}/progress",
                                params=None if after is None else {"after": str(after)})

    async def cancel_job(self, job_id: str) -> JobInfo:
        return await self._call(JobInfo, "POST", f"/v1/jobs/{_segment(job_id)}/cancel")

    async def job_statement(self, job_id: str) -> JobStatement:
        return await self._call(JobStatement, "GET", f"/v1/jobs/{_segment(job_id)}/statement")

    async def job_audits(self, job_id: str) -> JobAudits:
        return await self._call(JobAudits, "GET", f"/v1/jobs/{_segment(job_id)}/audits")

    async def submit_sweep(self, spec: SweepSpec | Mapping[str, Any]) -> SweepSummary:
        body = spec.model_dump(mode="json") if isinstance(spec, SweepSpec) else dict(spec)
        return await self._call(SweepSummary, "POST", "/v1/sweeps", body=body)

    async def sweeps(self) -> list[SweepSummary]:
        return (await self._call(SweepList, "GET", "/v1/sweeps")).sweeps

    async def sweep(self, sweep_id: str) -> SweepDetail:
        return await self._call(SweepDetail, "GET", f"/v1/sweeps/{_segment(sweep_id)}")

    async def cancel_sweep(self, sweep_id: str) -> SweepSummary:
        return await self._call(SweepSummary, "POST", f"/v1/sweeps/{_segment(sweep_id)}/cancel")

    async def whoami(self) -> OwnerAccount:
        return await self._call(OwnerAccount, "GET", "/v1/owners/me")

    async def download_artifact(self, job_id: str, name: str, dest: Path) -> str:
        """Stream an artifact to `dest`, check it against the SHA-256 the coordinator sent, return the digest.
        Written to DEST.part first: `dest` only ever holds a whole, checked file."""
        return await self._download(f"/v1/jobs/{_segment(job_id)}/artifacts/{_segment(name)}", dest, what=name)

    async def artifacts(self, job_id: str) -> list[ArtifactInfo]:
        """The job's artifacts (models, checkpoints, the TensorBoard file), oldest first."""
        return (await self._call(ArtifactList, "GET", f"/v1/jobs/{_segment(job_id)}/artifacts")).artifacts

    # The content-addressed store (docs/decisions/0013): an owner uploads a job's code and dataset before submitting
    # it. The coordinator answers relative to the owner: a blob is "held" only once this owner uploaded its bytes.

    async def missing_blobs(self, shas: list[str]) -> list[str]:
        """Those of `shas` (at most 64 per call) that this owner does not hold yet, in the order given."""
        return (await self._call(BlobsMissing, "POST", "/v1/blobs/missing", body={"sha256": list(shas)})).missing

    async def upload_blob(self, path: Path, sha256: str, size: int, progress: Progress | None = None) -> BlobStored:
        """Stream the file at `path` (whose SHA-256 and size the caller computed) into the store, in chunks;
        `progress(bytes_sent_so_far)` after each. The coordinator checks the bytes against `sha256` and `size`."""

        return await self._call(BlobStored, "PUT", f"/v1/blobs/{_segment(sha256)}", data=file_chunks(path, progress),
                                headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
                                timeout=_STREAM)

    async def download_blob(self, sha256: str, dest: Path, progress: Progress | None = None) -> str:
        """Stream a blob this owner holds to `dest` (through DEST.part), check it is `sha256`, return it."""
        return await self._download(f"/v1/blobs/{_segment(sha256)}", dest, expected=sha256, progress=progress,
                                    what=f"blob {sha256[:12]}")

    async def _download(self, path: str, dest: Path, *, expected: str | None = None,
                        headers: Mapping[str, str] | None = None, progress: Progress | None = None,
                        what: str = "download") -> str:
        """GET `path` streamed to a temporary file beside `dest`, checked against `expected` (or the answer's
        X-Content-SHA256), then renamed to `dest`. Returns the SHA-256. A mismatch raises ApiError, no file left."""
        tmp = dest.with_name(f"{dest.name}.{os.getpid()}.part")
        digest, received = hashlib.sha256(), 0
        # No total limit (a model may be large): each connect and read must progress within the timeout.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout, sock_read=self.timeout)
        try:
            async with self._session_for_call() as session, session.get(
                    self.base_url + path, headers=self._headers(headers), timeout=timeout) as response:
                if response.status >= 400:
                    raise self._refusal(response.status, await response.read(), f"GET {path}")
                expected = expected or response.headers.get("X-Content-SHA256")
                with open(tmp, "wb") as f:
                    async for chunk in response.content.iter_chunked(CHUNK):
                        digest.update(chunk)
                        f.write(chunk)
                        received += len(chunk)
                        if progress is not None:
                            progress(received)
        except (aiohttp.ClientError, TimeoutError) as e:
            tmp.unlink(missing_ok=True)
            error = self._unreachable(e, self.timeout)
            self._fail_over()
            raise error from None
        except OSError as e:  # the local file (TimeoutError, an OSError too, is caught above)
            tmp.unlink(missing_ok=True)
            raise ApiError(f"cannot write {tmp}: {e}") from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if expected and digest.hexdigest() != expected:
            tmp.unlink(missing_ok=True)
            raise ApiError(f"download of {what} is corrupt: SHA-256 {digest.hexdigest()} != {expected}",
                           code="digest_mismatch")
        tmp.replace(dest)
        return digest.hexdigest()

    async def download_tensorboard(self, job_id: str, logdir: Path) -> tuple[Path, str]:
        """Save the job's TensorBoard event file as LOGDIR/JOB_ID/tensorboard.tfevents (one run per job for
        `tensorboard --logdir LOGDIR`), replacing an earlier download. Returns the path and its SHA-256."""
        if not is_job_id(job_id):  # it names a directory: nothing like "../x"
            raise ApiError(f"not a job id: {job_id!r}")
        directory = logdir / job_id
        directory.mkdir(parents=True, exist_ok=True)
        dest = directory / TENSORBOARD_ARTIFACT
        return dest, await self.download_artifact(job_id, TENSORBOARD_ARTIFACT, dest)

    # ------------------------------------------------------------------------------------------------ admin

    async def create_owner(self, name: str, credits: float) -> OwnerCreated:
        return await self._call(OwnerCreated, "POST", "/v1/owners", body={"name": name, "credits": credits})

    async def adjust_credits(self, owner_id: str, amount: float, memo: str = "") -> OwnerAccount:
        return await self._call(OwnerAccount, "POST", f"/v1/owners/{_segment(owner_id)}/credits",
                                body={"amount": amount, "memo": memo})

    async def revoke_node(self, node_id: str) -> RevokeAnswer:
        return await self._call(RevokeAnswer, "POST", f"/v1/nodes/{_segment(node_id)}/revoke", body={})

    # ------------------------------------------------------------------------------------------------ node

    @property
    def node_id(self) -> str:
        if self.signer is None:
            raise TypeError("this client has no signer, so no node id")
        return self.signer.node_id

    async def register(self, registration: NodeRegistration) -> RegistrationResponse:
        return await self._signed(RegistrationResponse, "/v1/nodes/register", "register", registration)

    async def heartbeat(self, heartbeat: Heartbeat) -> HeartbeatAnswer:
        return await self._signed(HeartbeatAnswer, "/v1/nodes/heartbeat", "heartbeat", heartbeat)

    async def assignments(self) -> list[Assignment]:
        return (await self.poll()).assignments

    async def poll(self) -> AssignmentList:
        """Node: its active assignments, and the audits it must answer or referee."""
        return await self._signed(AssignmentList, "/v1/nodes/assignments", "poll",
                                  AssignmentPoll(node_id=self.node_id))

    async def mesh_peers(self, since: int) -> MeshConfig:
        """Long-poll: returns when the coordinator's mesh version passes `since` (or after its poll timeout)."""
        return await self._signed(MeshConfig, "/v1/mesh/peers", "mesh_poll",
                                  MeshPoll(node_id=self.node_id, since=since), timeout=MESH_POLL_TIMEOUT)

    async def report_round(self, report: RoundReport) -> RoundAnswer:
        return await self._signed(RoundAnswer, "/v1/rounds", "round_report", report)

    async def upload(self, job_id: str, path: Path, *, final: bool, accuracy: float | None = None,
                     epoch: float | None = None, checkpoint_step: int | None = None,
                     metrics: Mapping[str, float] | None = None, name: str | None = None,
                     progress: Progress | None = None) -> ArtifactStored:
        """Upload a file as the job's artifact `name` (default: `path.name`), streamed in chunks; the signed header
        binds its size and SHA-256. `checkpoint_step` marks a checkpoint of that global step (the coordinator keeps
        the job's newest few); `metrics` are a final model's."""
        name = name or path.name
        sha256, size = await asyncio.to_thread(file_digest, path)
        meta = ArtifactMeta(job_id=job_id, node_id=self.node_id, name=name, sha256=sha256, size=size, final=final,
                            accuracy=accuracy, epoch=epoch, checkpoint_step=checkpoint_step,
                            metrics=dict(metrics) if metrics is not None else None)
        envelope = self._envelope("artifact", meta)

        return await self._call(ArtifactStored, "PUT", f"/v1/jobs/{_segment(job_id)}/artifacts/{_segment(name)}",
                                data=file_chunks(path, progress), timeout=_STREAM,
                                headers={ENVELOPE_HEADER: envelope.model_dump_json(), "Content-Length": str(size),
                                         "Content-Type": "application/octet-stream"})

    async def fetch_blob(self, job_id: str, sha256: str, dest: Path, progress: Progress | None = None) -> str:
        """Node: stream a blob of a job this node is assigned to (its code, dataset or a checkpoint) to `dest`,
        through a temporary file beside it, and check it is `sha256` (ApiError `digest_mismatch` if not, and no
        file is left). Returns the SHA-256."""
        envelope = self._envelope("fetch", BlobFetch(job_id=job_id, node_id=self.node_id, sha256=sha256))
        return await self._download(f"/v1/jobs/{_segment(job_id)}/blobs/{_segment(sha256)}", dest, expected=sha256,
                                    headers={ENVELOPE_HEADER: envelope.model_dump_json()}, progress=progress,
                                    what=f"blob {sha256[:12]} of job {job_id}")

    # Refereed re-execution (proto/audits.py): an audited node's evidence, a referee's download and verdict.

    async def upload_evidence(self, audit_id: str, path: Path) -> AuditAnswer:
        sha256, size = await asyncio.to_thread(file_digest, path)
        envelope = self._envelope(EVIDENCE_KIND, EvidenceMeta(audit_id=audit_id, node_id=self.node_id,
                                                              sha256=sha256, size=size))
        return await self._call(AuditAnswer, "PUT", f"/v1/audits/{_segment(audit_id)}/evidence",
                                data=file_chunks(path, None), timeout=_STREAM,
                                headers={ENVELOPE_HEADER: envelope.model_dump_json(), "Content-Length": str(size),
                                         "Content-Type": "application/octet-stream"})

    async def fetch_evidence(self, audit_id: str, sha256: str, dest: Path) -> str:
        envelope = self._envelope(FETCH_EVIDENCE_KIND, EvidenceFetch(audit_id=audit_id, node_id=self.node_id))
        return await self._download(f"/v1/audits/{_segment(audit_id)}/evidence", dest, expected=sha256,
                                    headers={ENVELOPE_HEADER: envelope.model_dump_json()},
                                    what=f"the evidence of audit {audit_id}")

    async def post_verdict(self, verdict: AuditVerdict) -> AuditAnswer:
        return await self._signed(AuditAnswer, f"/v1/audits/{_segment(verdict.audit_id)}/verdict", VERDICT_KIND,
                                  verdict)

    # GPU challenge (proto/challenge.py): start when the heartbeat answer asks, commit the root, prove the rows.

    async def challenge_start(self) -> ChallengeIssue:
        from gpuswarm.proto import challenge

        return await self._signed(challenge.ChallengeIssue, "/v1/challenges", challenge.START_KIND,
                                  challenge.ChallengeStart(node_id=self.node_id))

    async def challenge_commit(self, commit: ChallengeCommit) -> CommitAnswer:
        from gpuswarm.proto import challenge

        return await self._signed(challenge.CommitAnswer, f"/v1/challenges/{_segment(commit.challenge_id)}/commit",
                                  challenge.COMMIT_KIND, commit)

    async def challenge_proof(self, proof: ChallengeProof) -> ChallengeResult:
        from gpuswarm.proto import challenge

        return await self._signed(challenge.ChallengeResult, f"/v1/challenges/{_segment(proof.challenge_id)}/proof",
                                  challenge.PROOF_KIND, proof, timeout=PROOF_TIMEOUT)


def _blocking(method):
    """`CoordinatorClient.method`, run to completion on the SyncClient's loop."""

    @functools.wraps(method)
    def call(self: SyncClient, *args, **kwargs):
        return self._run(method(self.api, *args, **kwargs))

    return call


class SyncClient:
    """The same client for callers without an event loop: each call runs the async core to completion on this
    object's private loop (one call at a time). Async code uses `CoordinatorClient`, or calls this one through
    `asyncio.to_thread`: a running loop cannot be blocked on."""

    def __init__(self, base_url: str = DEFAULT_URL, *, token: str | None = None, timeout: float = 10.0,
                 signer: Signer | None = None):
        self.api = CoordinatorClient(base_url, signer, token=token, timeout=timeout)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    @property
    def base_url(self) -> str:
        return self.api.base_url

    @property
    def token(self) -> str | None:
        return self.api.token

    def _run(self, coroutine):
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                self._loop = asyncio.new_event_loop()
            return self._loop.run_until_complete(coroutine)

    def close(self) -> None:
        with self._lock:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.close()

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        loop = getattr(self, "_loop", None)
        if loop is not None and not loop.is_closed() and not loop.is_running():
            loop.close()

    request = _blocking(CoordinatorClient.request)
    health = _blocking(CoordinatorClient.health)
    dht = _blocking(CoordinatorClient.dht)
    openapi = _blocking(CoordinatorClient.openapi)
    nodes = _blocking(CoordinatorClient.nodes)
    node_statement = _blocking(CoordinatorClient.node_statement)
    node_challenges = _blocking(CoordinatorClient.node_challenges)
    submit_job = _blocking(CoordinatorClient.submit_job)
    jobs = _blocking(CoordinatorClient.jobs)
    job = _blocking(CoordinatorClient.job)
    contributions = _blocking(CoordinatorClient.contributions)
    progress = _blocking(CoordinatorClient.progress)
    cancel_job = _blocking(CoordinatorClient.cancel_job)
    job_statement = _blocking(CoordinatorClient.job_statement)
    job_audits = _blocking(CoordinatorClient.job_audits)
    whoami = _blocking(CoordinatorClient.whoami)
    submit_sweep = _blocking(CoordinatorClient.submit_sweep)
    sweeps = _blocking(CoordinatorClient.sweeps)
    sweep = _blocking(CoordinatorClient.sweep)
    cancel_sweep = _blocking(CoordinatorClient.cancel_sweep)
    download_artifact = _blocking(CoordinatorClient.download_artifact)
    artifacts = _blocking(CoordinatorClient.artifacts)
    missing_blobs = _blocking(CoordinatorClient.missing_blobs)
    upload_blob = _blocking(CoordinatorClient.upload_blob)
    download_blob = _blocking(CoordinatorClient.download_blob)
    download_tensorboard = _blocking(CoordinatorClient.download_tensorboard)
    create_owner = _blocking(CoordinatorClient.create_owner)
    adjust_credits = _blocking(CoordinatorClient.adjust_credits)
    revoke_node = _blocking(CoordinatorClient.revoke_node)
    register = _blocking(CoordinatorClient.register)
    heartbeat = _blocking(CoordinatorClient.heartbeat)
    assignments = _blocking(CoordinatorClient.assignments)
    report_round = _blocking(CoordinatorClient.report_round)
    upload = _blocking(CoordinatorClient.upload)
    fetch_blob = _blocking(CoordinatorClient.fetch_blob)
