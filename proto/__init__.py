"""gpuswarm.proto: the contracts between processes.

Owns the pydantic models of every message that crosses a process boundary, the signed envelope, the DHT key
names and the hivemind record validator for node adverts, and the catalogue of built-in workloads with their
hyper-parameter schemas. It does no I/O, starts no event loop and imports nothing else of gpuswarm, so every
other package may depend on it.
"""

PROTOCOL_VERSION = 1
