"""gpuswarm.dht: the swarm's hivemind DHT peer, its record validators, and the operators' `gpuswarm dht` tools.

- `swarm`: `SwarmDHT`, the DHT peer process every gpuswarm process runs (it dies with its owner).
- `validators`: every record's proof chained to the coordinator (`SwarmRecordValidator`) and signed, owned
  node adverts (`NodeAdvertValidator`); the rules are in `proto.dht`.
- `hivemind_adapter`: the one module that reaches past hivemind's public API, pinned to hivemind 1.1.12.
- `inspect`: reading and decoding the DHT's records from a short-lived client-mode peer.
- `cli`: the `gpuswarm dht` command group (its Ctrl-C handling is `gpuswarm.ctrl_c`).

Imports proto, `gpuswarm.client` (the API client, for `gpuswarm dht --coordinator`) and `gpuswarm.console`; never node
or coordinator. The coordinator and the node daemon start their DHT peers from here. Importing the package or
`cli` loads no hivemind: `swarm`, `validators` and `inspect` do.
"""
