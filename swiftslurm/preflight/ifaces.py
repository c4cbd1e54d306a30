"""Which address of a node the network checks use: the one on the interface NCCL will use.

``NCCL_SOCKET_IFNAME`` (prefixes, ``^`` to exclude, ``=`` for exact names, comma-separated, as NCCL reads it)
picks the interface when set; unset, an IPoIB interface (``ib*``) is preferred as NCCL prefers it, else the
address the node name resolves to. ``match_ifname`` and ``pick_address`` are pure; ``interface_addresses``
reads this host's IPv4 addresses (getifaddrs).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import socket
from typing import Mapping

IFNAME_ENV = "NCCL_SOCKET_IFNAME"


def match_ifname(spec: str, names: list[str]) -> list[str]:
    """The interface names NCCL_SOCKET_IFNAME=spec selects, in the order given (pure)."""
    text = spec.strip()
    exclude = text.startswith("^")
    text = text[1:] if exclude else text
    exact = text.startswith("=")
    text = text[1:] if exact else text
    words = [w.strip() for w in text.split(",") if w.strip()]

    def hit(name: str) -> bool:
        return any(name == w if exact else name.startswith(w) for w in words)

    return [n for n in names if hit(n) != exclude]


def pick_address(env: Mapping[str, str], interfaces: list[tuple[str, str]], node_addr: str | None) -> tuple[str | None, str, str]:
    """(address, interface or "", error) for this node's network checks (pure).

    ``interfaces``: (name, IPv4 address) pairs of this host; ``node_addr``: what the node name resolves to."""
    spec = (env.get(IFNAME_ENV) or "").strip()
    names = list(dict.fromkeys(n for n, _ in interfaces))
    if spec:
        chosen = match_ifname(spec, names)
        if not chosen:
            have = ", ".join(f"{n} ({a})" for n, a in interfaces) or "none with an IPv4 address"
            return None, "", f"no interface matches {IFNAME_ENV}={spec!r}; this node has {have}"
    else:
        chosen = [n for n in names if n.startswith("ib")]
        if not chosen:
            return node_addr, "", "" if node_addr else "the node name does not resolve"
    pairs = [(n, a) for n, a in interfaces if n in chosen]
    for n, a in pairs:  # the node-name address when it is on a chosen interface, else the first chosen one
        if a == node_addr:
            return a, n, ""
    n, a = min(pairs, key=lambda p: chosen.index(p[0]))
    return a, n, ""


class _Sockaddr(ctypes.Structure):
    _fields_ = [("sa_family", ctypes.c_ushort), ("sa_data", ctypes.c_ubyte * 14)]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [
    ("ifa_next", ctypes.POINTER(_Ifaddrs)), ("ifa_name", ctypes.c_char_p), ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.POINTER(_Sockaddr)), ("ifa_netmask", ctypes.POINTER(_Sockaddr)),
    ("ifa_ifu", ctypes.POINTER(_Sockaddr)), ("ifa_data", ctypes.c_void_p),
]


def interface_addresses() -> list[tuple[str, str]]:
    """(interface, IPv4 address) for every address of this host, in the kernel's order; [] where unknown."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return []
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        return []
    out: list[tuple[str, str]] = []
    try:
        node = head
        while node:
            entry = node.contents
            if entry.ifa_addr and entry.ifa_addr.contents.sa_family == socket.AF_INET:
                raw = bytes(entry.ifa_addr.contents.sa_data[2:6])  # sockaddr_in: port (2 bytes), then the address
                out.append((entry.ifa_name.decode(errors="replace"), socket.inet_ntoa(raw)))
            node = entry.ifa_next
    finally:
        libc.freeifaddrs(head)
    return out
