"""A small synchronous client of the coordinator's /v1 API for the CLI, the demo and the tests.

Errors come back as `ApiClientError` carrying the API's error code and message, or a clear sentence when the
coordinator cannot be reached at all.
"""

from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from gpuswarm.proto.models import is_job_id

DEFAULT_URL = "http://127.0.0.1:8470"
TENSORBOARD_ARTIFACT = "tensorboard.tfevents"  # coordinator.tensorboard.ARTIFACT_NAME (not imported: no protobuf here)


class ApiClientError(Exception):
    def __init__(self, message: str, *, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code


class CoordinatorClient:
    def __init__(self, base_url: str = DEFAULT_URL, timeout: float = 10.0, token: str | None = None):
        """`token`: a job owner's API token, or the admin token for admin calls (sent as a bearer token)."""
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.token = token

    def _open(self, method: str, path: str, body: Any = None):
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data else {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            try:
                error = json.loads(e.read())["error"]
                raise ApiClientError(error["message"], status=e.code, code=error.get("code")) from None
            except (ValueError, KeyError, TypeError):
                raise ApiClientError(f"HTTP {e.code} from {self.base_url}{path}", status=e.code) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ApiClientError(f"cannot reach the coordinator at {self.base_url}: {reason}") from None

    def request(self, method: str, path: str, body: Any = None) -> Any:
        with self._open(method, path, body) as response:
            return json.loads(response.read())

    def health(self) -> dict:
        return self.request("GET", "/v1/health")

    def submit_job(self, spec: dict) -> dict:
        return self.request("POST", "/v1/jobs", spec)

    def jobs(self, state: str | None = None) -> list[dict]:
        return self.request("GET", "/v1/jobs" + (f"?state={state}" if state else ""))["jobs"]

    def job(self, job_id: str) -> dict:
        return self.request("GET", f"/v1/jobs/{job_id}")

    def progress(self, job_id: str, after: int | None = None) -> dict:
        """The job's training curve: `{job_id, state, points: [...], truncated}`, points after step `after`."""
        return self.request("GET", f"/v1/jobs/{job_id}/progress" + ("" if after is None else f"?after={after}"))

    def cancel_job(self, job_id: str) -> dict:
        return self.request("POST", f"/v1/jobs/{job_id}/cancel")

    def nodes(self) -> list[dict]:
        return self.request("GET", "/v1/nodes")["nodes"]

    def revoke_node(self, node_id: str) -> dict:
        return self.request("POST", f"/v1/nodes/{node_id}/revoke", {})

    def job_statement(self, job_id: str) -> dict:
        return self.request("GET", f"/v1/jobs/{job_id}/statement")

    def node_statement(self, node_id: str) -> dict:
        return self.request("GET", f"/v1/nodes/{node_id}/statement")

    def create_owner(self, name: str, credits: float) -> dict:
        return self.request("POST", "/v1/owners", {"name": name, "credits": credits})

    def whoami(self) -> dict:
        return self.request("GET", "/v1/owners/me")

    def adjust_credits(self, owner_id: str, amount: float, memo: str = "") -> dict:
        return self.request("POST", f"/v1/owners/{owner_id}/credits", {"amount": amount, "memo": memo})

    def download_artifact(self, job_id: str, name: str, dest: Path) -> str:
        """Stream an artifact to `dest`, check it against the SHA-256 the coordinator recorded, return the digest."""
        tmp = dest.with_name(dest.name + ".part")
        digest = hashlib.sha256()
        with self._open("GET", f"/v1/jobs/{job_id}/artifacts/{name}") as response, open(tmp, "wb") as f:
            expected = response.headers.get("X-Content-SHA256")
            while chunk := response.read(1 << 20):
                digest.update(chunk)
                f.write(chunk)
        if expected and digest.hexdigest() != expected:
            tmp.unlink(missing_ok=True)
            raise ApiClientError(f"download of {name} is corrupt: SHA-256 {digest.hexdigest()} != {expected}")
        tmp.replace(dest)
        return digest.hexdigest()

    def download_tensorboard(self, job_id: str, logdir: Path) -> tuple[Path, str]:
        """Save the job's TensorBoard event file as LOGDIR/JOB_ID/tensorboard.tfevents (one run per job for
        `tensorboard --logdir LOGDIR`), replacing an earlier download. Returns the path and its SHA-256."""
        if not is_job_id(job_id):  # it names a directory: nothing like "../x"
            raise ApiClientError(f"not a job id: {job_id!r}")
        directory = logdir / job_id
        directory.mkdir(parents=True, exist_ok=True)
        dest = directory / TENSORBOARD_ARTIFACT
        return dest, self.download_artifact(job_id, TENSORBOARD_ARTIFACT, dest)
