"""gpuswarm.node: the GPU owner's daemon and its training processes.

Owns the node's identity (key files), the probe of what the machine offers, the GPU challenge solver, the DHT
advertiser, the mesh link, the job runner (one child process per job, see `worker`, which trains a `workloads`
entry and attests contributions through `attest`), the on-disk outbox of round reports, the Prometheus metrics,
and the state machine that ties them together. Talks to the coordinator only through `gpuswarm.client`'s API
client. Imports proto, mesh, dht and client (and the root's `gpuswarm.console`); never the coordinator.
"""
