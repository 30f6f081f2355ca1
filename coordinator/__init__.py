"""gpuswarm.coordinator: the marketplace's aiohttp service.

Owns the HTTP API under /v1, the SQLAlchemy models and queries, the pure matcher, the ledger of contributions,
the artifact store, and the hivemind DHT peer that bootstraps the swarm. It is never in the training data path.
Imports proto, mesh and client (the operator's CLI), and starts a `gpuswarm.dht.SwarmDHT` lazily; never node.
"""
