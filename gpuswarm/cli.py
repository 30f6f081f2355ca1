"""The `gpuswarm` command: assembles the command groups each package owns, and nothing else."""

from __future__ import annotations

import logging
import os
import sys

import typer

from gpuswarm.client.jobcli import job_app
from gpuswarm.client.nodescli import nodes_app
from gpuswarm.client.sweepcli import sweep_app
from gpuswarm.coordinator.cli import coordinator_app
from gpuswarm.dht.cli import dht_app
from gpuswarm.mesh.cli import mesh_app
from gpuswarm.node.cli import node_app

app = typer.Typer(help="gpuswarm: a peer-to-peer GPU marketplace.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)
app.add_typer(coordinator_app, name="coordinator")
app.add_typer(node_app, name="node")
app.add_typer(job_app, name="job")
app.add_typer(sweep_app, name="sweep")
app.add_typer(mesh_app, name="mesh")
app.add_typer(nodes_app, name="nodes")
app.add_typer(dht_app, name="dht")


def main() -> None:
    try:
        app()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    if "hivemind" in sys.modules:
        # The command's work is done and its DHT shut down. A hivemind call still pending in an executor thread
        # (its DHT process terminated the hard way under load) would block interpreter exit forever, since exit
        # joins those threads: `dht watch` once ignored Ctrl-C for over a minute this way. Leave without waiting.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
