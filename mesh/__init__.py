"""gpuswarm.mesh: the WireGuard mesh. Imports third-party libraries, its own modules and the root package's
`gpuswarm.console` only (proto is allowed; nothing uses it yet); never node, coordinator, client or dht.

- `keys`: X25519 key pairs in WireGuard's base64 form, hex for the UAPI, the private key file (0600).
- `ipam`: pure address management over plain-dict state (stable address per key, release grace period).
- `uapi`: a client of wireguard-go's UAPI socket (per-peer sets, never `replace_peers`).
- `backend`: `MeshBackend` with `UserspaceBackend` (wireguard-go + pyroute2) and `KernelBackend` (netlink), and
  `choose_backend()`.
- `reconciler`: `plan(current, desired)` (fewest changes) and `MeshAgent.reconcile(desired)`.
- `paths`: pure path choice per peer (which candidate endpoint, failover, lowest RTT), `next_path(state, facts)`.
- `probe`: ICMP echo RTTs through the mesh (`icmp_rtts` for many peers at once).
- `cli`: `gpuswarm mesh status`, from the node daemon's mesh.json and the device itself.

Submodules are imported explicitly (`from gpuswarm.mesh.ipam import allocate`), so that the coordinator, which
needs only IPAM, does not load pyroute2.
"""
