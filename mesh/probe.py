"""Reachability and round-trip time over the mesh: ICMP echo through a raw socket (root, as the mesh needs).

`icmp_rtts` probes many peers at once (one socket, one echo each, one shared wait): the node's path keeper uses
it every tick to try and measure paths (`gpuswarm.mesh.paths`). `icmp_rtt` probes one address, for
`gpuswarm mesh status` and the network lab. A raw ICMP socket sees every echo reply in the network namespace, so
replies are matched by source address, identifier (random per call) and sequence number.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import struct
import time


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def icmp_rtt(address: str, count: int = 1, wait_s: float = 1.0) -> float | None:
    """Seconds for the first echo reply of up to `count` requests (one at a time, `wait_s` each), or None.
    A send error (no route, WireGuard's "required key not available") counts as a lost request."""
    target = str(ipaddress.IPv4Address(address))
    ident = os.getpid() & 0xFFFF
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as sock:
        for seq in range(1, count + 1):
            payload = b"gpuswarm-probe" + struct.pack("!d", time.time())
            header = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
            packet = struct.pack("!BBHHH", 8, 0, _checksum(header + payload), ident, seq) + payload
            sent = time.monotonic()
            deadline = sent + wait_s
            try:
                sock.sendto(packet, (target, 0))
            except OSError:
                time.sleep(max(0.0, deadline - time.monotonic()))
                continue
            while (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                try:
                    data, (source, _) = sock.recvfrom(2048)
                except TimeoutError:
                    break
                ihl = (data[0] & 0x0F) * 4
                kind, _, _, reply_id, reply_seq = struct.unpack("!BBHHH", data[ihl : ihl + 8])
                if source == target and kind == 0 and reply_id == ident and reply_seq == seq:
                    return time.monotonic() - sent
    return None


def _echo(ident: int, seq: int) -> bytes:
    payload = b"gpuswarm-probe" + struct.pack("!d", time.time())
    header = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
    return struct.pack("!BBHHH", 8, 0, _checksum(header + payload), ident, seq) + payload


def icmp_rtts(addresses: list[str], wait_s: float = 1.0) -> dict[str, float | None]:
    """Seconds to each address's echo reply, or None for no reply within `wait_s` (one echo each, all sent at
    once, so the call takes at most `wait_s` however many addresses). A send error (no route, WireGuard's
    "required key not available") counts as no reply. Raises PermissionError without the right to raw sockets."""
    targets = list(dict.fromkeys(str(ipaddress.IPv4Address(a)) for a in addresses))
    results: dict[str, float | None] = dict.fromkeys(targets)
    if not targets:
        return results
    ident = secrets.randbits(16)
    sent: dict[int, tuple[str, float]] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as sock:
        for seq, target in enumerate(targets, start=1):
            try:
                sock.sendto(_echo(ident, seq), (target, 0))
            except OSError:
                continue
            sent[seq] = (target, time.monotonic())
        deadline = time.monotonic() + wait_s
        while sent and (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                data, (source, _) = sock.recvfrom(2048)
            except TimeoutError:
                break
            received = time.monotonic()
            ihl = (data[0] & 0x0F) * 4
            if len(data) < ihl + 8:
                continue
            kind, _, _, reply_id, reply_seq = struct.unpack("!BBHHH", data[ihl : ihl + 8])
            if kind == 0 and reply_id == ident and reply_seq in sent and sent[reply_seq][0] == source:
                target, at = sent.pop(reply_seq)
                results[target] = received - at
    return results


def icmp_ping(address: str, count: int = 1, wait_s: float = 1.0) -> bool:
    """True at the first echo reply of up to `count` requests."""
    return icmp_rtt(address, count, wait_s) is not None
