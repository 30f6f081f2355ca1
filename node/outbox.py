"""The node's outbox: contribution claims on disk until the coordinator acknowledges them.

Claims are stored unsigned, one JSON file each, and signed afresh at every send, so a claim buffered through a
long coordinator outage is not refused as stale. The coordinator deduplicates by (job, node, seq), so a resend
after a lost acknowledgement is harmless. `seq` comes from a persisted counter, never reused across restarts.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from gpuswarm.node.identity import write_private_file
from gpuswarm.proto.models import ContributionClaim

logger = logging.getLogger(__name__)


class Outbox:
    def __init__(self, directory: Path):
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self._seq_file = directory / "next_seq"
        # Never reuse a seq: take the larger of the counter and what is still queued, even if the counter is lost.
        queued = [int(p.stem.removeprefix("claim-")) for p in directory.glob("claim-*.json")
                  if p.stem.removeprefix("claim-").isdigit()]
        try:
            stored = int(self._seq_file.read_text())
        except (OSError, ValueError):
            stored = 0
        self._next_seq = max([stored, *(q + 1 for q in queued)])

    def next_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        write_private_file(self._seq_file, str(self._next_seq).encode())
        return seq

    def add(self, claim: ContributionClaim) -> None:
        write_private_file(self._path(claim), claim.model_dump_json().encode())

    def pending(self) -> list[ContributionClaim]:
        claims = []
        for path in sorted(self.directory.glob("claim-*.json")):
            try:
                claims.append(ContributionClaim.model_validate(json.loads(path.read_text())))
            except (OSError, ValueError) as e:
                logger.error("dropping unreadable claim file %s: %s", path, e)
                path.unlink(missing_ok=True)
        return claims

    def ack(self, claim: ContributionClaim) -> None:
        self._path(claim).unlink(missing_ok=True)

    def _path(self, claim: ContributionClaim) -> Path:
        return self.directory / f"claim-{claim.seq:012d}.json"
