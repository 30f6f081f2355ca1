"""Reachability and round-trip time over the mesh: ICMP echo through a raw socket (root, as the mesh needs).

Used by `gpuswarm mesh status` for each peer's RTT, and by the network lab to check links.
"""

from __future__ import annotations

import ipaddress
import os
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


def icmp_ping(address: str, count: int = 1, wait_s: float = 1.0) -> bool:
    """True at the first echo reply of up to `count` requests."""
    return icmp_rtt(address, count, wait_s) is not None
