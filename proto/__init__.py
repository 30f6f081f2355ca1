"""gpuswarm.proto: the contracts between processes.

Owns the pydantic models of every message that crosses a process boundary (`models`, the API's answers in `api`,
the GPU challenge's in `challenge`), the signed envelope (`signing`), what the swarm keeps in its DHT (`dht`: key
names, run ids, the signed node advert; the hivemind side of the DHT is `gpuswarm.dht`'s), the catalogue of
built-in workloads with their hyper-parameter schemas (`workloads`), what owners and operators send is checked
by (`strict`: unknown keys and wrong types refused, "did you mean"), and the shared log formats and options
(`logs`). It imports nothing else of gpuswarm, so every other package may depend on it. Nothing here does I/O or
starts an event loop, except `logs.configure`, which sets up the calling process's logging (a stderr handler, the
format its child processes inherit through the environment, and hivemind's own loggers when hivemind is
installed). Only `challenge` needs numpy, and only `logs.configure` touches hivemind, lazily.
"""

PROTOCOL_VERSION = 1
