"""Writes docs/grafana/gpuswarm.json, the Grafana dashboard of the coordinator's and the nodes' /metrics.

The dashboard is generated rather than hand-edited so that panels stay uniform and reviewable; a test checks that
the committed file is this script's output and that every metric it queries is one the daemons export. Import it
in Grafana (Dashboards -> New -> Import) and pick the Prometheus data source that scrapes both daemons.

    .venv/bin/python scripts/grafana_dashboard.py          # rewrite the file
    .venv/bin/python scripts/grafana_dashboard.py --check  # exit 1 if the file is stale
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "gpuswarm.json"
DS = {"type": "prometheus", "uid": "${datasource}"}
WIDTH, HEIGHT = 8, 8  # three panels per row of Grafana's 24-column grid


def panel(title: str, exprs: list[tuple[str, str]], unit: str = "short", description: str = "") -> dict:
    return {
        "type": "timeseries", "title": title, "description": description, "datasource": DS,
        "fieldConfig": {"defaults": {"unit": unit, "custom": {"lineWidth": 1, "fillOpacity": 10}}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [{"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
                    for i, (expr, legend) in enumerate(exprs)],
    }


def row(title: str) -> dict:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


COORDINATOR = 'job=~"$coordinator_job"'
NODE = 'job=~"$node_job", instance=~"$instance"'
LATENCY = "gpuswarm_coordinator_http_request_duration_seconds"

SECTIONS = [
    ("Coordinator", [
        panel("Jobs by state", [(f"sum by (state) (gpuswarm_coordinator_jobs{{{COORDINATOR}}})", "{{state}}")]),
        panel("Nodes", [(f"gpuswarm_coordinator_nodes{{{COORDINATOR}}}", "registered"),
                        (f"gpuswarm_coordinator_nodes_online{{{COORDINATOR}}}", "online"),
                        (f"gpuswarm_coordinator_nodes_verified{{{COORDINATOR}}}", "verified"),
                        (f"gpuswarm_coordinator_nodes_revoked{{{COORDINATOR}}}", "revoked"),
                        (f"gpuswarm_coordinator_assignments_active{{{COORDINATOR}}}", "active assignments")]),
        panel("API latency p99 by route", [(
            f"histogram_quantile(0.99, sum by (le, route) (rate({LATENCY}_bucket{{{COORDINATOR}}}[$__rate_interval])))",
            "{{route}}")], "s"),
        panel("API requests by status", [(
            f"sum by (status) (rate({LATENCY}_count{{{COORDINATOR}}}[$__rate_interval]))", "{{status}}")], "reqps"),
        panel("Matching latency", [
            (f"histogram_quantile(0.5, sum by (le) (rate(gpuswarm_coordinator_matching_duration_seconds_bucket"
             f"{{{COORDINATOR}}}[$__rate_interval])))", "p50"),
            (f"histogram_quantile(0.99, sum by (le) (rate(gpuswarm_coordinator_matching_duration_seconds_bucket"
             f"{{{COORDINATOR}}}[$__rate_interval])))", "p99")], "s"),
        panel("Heartbeats", [
            (f"sum by (result) (rate(gpuswarm_coordinator_heartbeats_total{{{COORDINATOR}}}[$__rate_interval]))",
             "{{result}}"),
            (f"sum(rate(gpuswarm_coordinator_supervisor_tick_failures_total{{{COORDINATOR}}}[$__rate_interval]))",
             "supervisor failures"),
            (f"sum(rate(gpuswarm_coordinator_assignments_made_total{{{COORDINATOR}}}[$__rate_interval]))",
             "assignments made")], "ops"),
    ]),
    ("Nodes", [
        panel("Node state", [(f"gpuswarm_node_state{{{NODE}}} == 1", "{{instance}} {{state}}")],
              description="One line per node, labelled with its current state."),
        panel("Training throughput", [(f"gpuswarm_node_samples_per_second{{{NODE}}}", "{{instance}} {{job_id}}")],
              "short"),
        panel("Test accuracy and loss", [(f"gpuswarm_node_accuracy{{{NODE}}}", "accuracy {{instance}} {{job_id}}"),
                                         (f"gpuswarm_node_loss{{{NODE}}}", "loss {{instance}} {{job_id}}")]),
        panel("Averaging rounds", [(
            f"sum by (result) (rate(gpuswarm_node_averaging_rounds_total{{{NODE}}}[$__rate_interval]))",
            "{{result}}")], "ops"),
        panel("GPU utilisation", [(f"gpuswarm_node_gpu_utilization_ratio{{{NODE}}}", "{{instance}} gpu {{gpu}}")],
              "percentunit", "Absent on nodes without an NVIDIA GPU or without nvidia-ml-py."),
        panel("GPU memory", [(f"gpuswarm_node_gpu_memory_used_bytes{{{NODE}}}", "{{instance}} gpu {{gpu}} used"),
                             (f"gpuswarm_node_gpu_memory_total_bytes{{{NODE}}}", "{{instance}} gpu {{gpu}} total")],
              "bytes"),
        panel("Mesh traffic", [
            (f"sum by (instance) (rate(gpuswarm_node_mesh_peer_sent_bytes_total{{{NODE}}}[$__rate_interval]))",
             "{{instance}} sent"),
            (f"sum by (instance) (rate(gpuswarm_node_mesh_peer_received_bytes_total{{{NODE}}}[$__rate_interval]))",
             "{{instance}} received")], "Bps"),
        panel("Mesh handshake age", [(f"gpuswarm_node_mesh_peer_handshake_age_seconds{{{NODE}}}",
                                      "{{instance}} -> {{peer}}")], "s",
              "WireGuard re-handshakes every 2 minutes on a live path; above 180 s the path is dead."),
        panel("Mesh RTT", [(f"gpuswarm_node_mesh_peer_rtt_seconds{{{NODE}}}", "{{instance}} -> {{peer}}")], "s"),
        panel("Coordinator link", [
            (f"gpuswarm_node_coordinator_reachable{{{NODE}}}", "{{instance}} reachable"),
            (f"gpuswarm_node_outbox_reports{{{NODE}}}", "{{instance}} reports waiting"),
            (f"rate(gpuswarm_node_heartbeats_failed_total{{{NODE}}}[$__rate_interval])", "{{instance}} failed/s")]),
    ]),
]


def variable(name: str, label: str, query: str, default: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DS, "query": {"query": query, "refId": name},
            "definition": query, "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
            "current": {"text": default, "value": default}}


def dashboard() -> dict:
    panels, y = [], 0
    for title, members in SECTIONS:
        panels.append(row(title) | {"gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        y += 1
        for i, p in enumerate(members):
            panels.append(p | {"gridPos": {"h": HEIGHT, "w": WIDTH, "x": i % 3 * WIDTH, "y": y + i // 3 * HEIGHT}})
        y += -(-len(members) // 3) * HEIGHT
    for i, p in enumerate(panels):
        p["id"] = i + 1
    return {
        "uid": "gpuswarm", "title": "gpuswarm", "tags": ["gpuswarm"], "timezone": "browser", "editable": True,
        "schemaVersion": 39, "version": 1, "refresh": "10s", "time": {"from": "now-1h", "to": "now"},
        "graphTooltip": 1, "annotations": {"list": []}, "links": [],
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            variable("coordinator_job", "Coordinator job", "label_values(gpuswarm_coordinator_info, job)", "All"),
            variable("node_job", "Node job", "label_values(gpuswarm_node_info, job)", "All"),
            variable("instance", "Node", 'label_values(gpuswarm_node_info{job=~"$node_job"}, instance)', "All"),
        ]},
        "panels": panels,
    }


def metric_names(board: dict) -> set[str]:
    """The metric names the dashboard's queries use (histogram/counter series suffixes removed)."""
    names = set()
    for p in board["panels"]:
        for t in p.get("targets", []):
            names |= set(re.findall(r"\b(gpuswarm_[a-z_]+)", t["expr"]))
    return {re.sub(r"_(bucket|count|sum|total)$", "", n) for n in names}


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        sys.exit(0 if OUT.read_text() == render() else f"{OUT} is stale: run scripts/grafana_dashboard.py")
    OUT.write_text(render())
    print(f"wrote {OUT}")
