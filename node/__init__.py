"""gpuswarm.node: the GPU owner's daemon.

Owns the node's identity (key files), GPU probe, coordinator client, DHT advertiser, job runner (one child
process per job, see `worker`), the on-disk outbox of signed contribution claims, and the state machine that ties
them together. Imports proto and mesh; never the coordinator.
"""
