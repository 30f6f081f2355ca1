"""gpuswarm.mesh: the WireGuard mesh (keys, IPAM, wireguard-go and netlink backends, the reconciler).

Not built yet: the mesh is its own issue. Until then nodes bind hivemind to the host address they are given
(`gpuswarm node start --host`, loopback by default), and the coordinator's registration response carries
`mesh: null`. That field and the node's `--host` are the seams the mesh will fill. Imports proto only.
"""
