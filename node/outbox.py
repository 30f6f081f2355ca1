"""The node's outbox: round reports on disk until the coordinator acknowledges them.

A report (`proto.models.RoundReport`) holds the signed claims of one round's group, as the training process
collected them. It is stored unsigned, one JSON file per (job, epoch), and the report itself is signed afresh at
every send, so a report buffered through a long coordinator outage is not refused as stale. The claims inside
keep their own signatures; the coordinator deduplicates them by signature, so a resend after a lost
acknowledgement changes nothing.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from gpuswarm.node.identity import write_private_file
from gpuswarm.proto.models import RoundReport

logger = logging.getLogger(__name__)


class Outbox:
    def __init__(self, directory: Path):
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)

    def add(self, report: RoundReport) -> None:
        write_private_file(self._path(report), report.model_dump_json().encode())

    def _files(self) -> list[Path]:
        return list(self.directory.glob("round-*.json"))

    def depth(self) -> int:
        """How many reports wait, without reading them (cheap enough for every metrics scrape)."""
        return len(self._files())

    def pending(self) -> list[RoundReport]:
        """Every stored report, oldest round first."""
        reports = []
        for path in self._files():
            try:
                reports.append(RoundReport.model_validate(json.loads(path.read_text())))
            except (OSError, ValueError) as e:
                logger.error("dropping unreadable report file %s: %s", path, e)
                path.unlink(missing_ok=True)
        return sorted(reports, key=lambda r: (r.job_id, r.epoch))

    def ack(self, report: RoundReport, *, delivered: bool = True) -> None:
        """Forget a report the coordinator answered. `delivered`: it took the report, so its own claim is noted
        in `delivered.jsonl` (job, epoch, the claim's signature): the node's own record of what the ledger must
        hold, which an operator or the fault suite checks the coordinator's books against."""
        path = self._path(report)
        if delivered and path.exists():  # once, even if a resend is acknowledged twice
            own = [c.get("signature") for c in report.claims if isinstance(c, dict)
                   and isinstance(c.get("payload"), dict) and c["payload"].get("node_id") == report.node_id]
            line = json.dumps({"job_id": report.job_id, "epoch": report.epoch, "signature": own[0] if own else None})
            with open(self.directory / "delivered.jsonl", "a") as f:
                f.write(line + "\n")
        path.unlink(missing_ok=True)

    def delivered(self) -> list[dict]:
        """What `ack` noted as delivered, oldest first."""
        try:
            lines = (self.directory / "delivered.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.strip()]

    def _path(self, report: RoundReport) -> Path:
        return self.directory / f"round-{report.job_id}-{report.epoch:012d}.json"
