"""The listening sockets of `ninfer serve`: one per --host address, all on one port."""

from __future__ import annotations

import socket


class BindError(Exception):
    """An address of --host could not be bound (the message names it)."""

    def __init__(self, address: str, port: int, reason: str):
        super().__init__(f"{address}:{port}: {reason}")
        self.address, self.port, self.reason = address, port, reason


def bind_sockets(hosts: list[str], port: int) -> list[socket.socket]:
    """One listener per address of --host (llama-server's comma list), all on one port: with port
    0 the first bind picks it and the others take the same. With several addresses an IPv6 one
    binds IPv6 only (llama-server: "with multiple TCP addresses, :: binds IPv6 only"), so
    `0.0.0.0,::` does not clash with itself."""
    socks: list[socket.socket] = []
    try:
        for host in hosts:
            try:
                socks.append(bind_socket(host, port, v6only=len(hosts) > 1))
            except OSError as e:
                raise BindError(host, port, str(e.strerror or e)) from None
            port = socks[0].getsockname()[1]
    except BindError:
        for s in socks:
            s.close()
        raise
    return socks


def bind_socket(host: str, port: int, v6only: bool = False) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP (not 0): asyncio turns Nagle off (TCP_NODELAY) only on accepted sockets whose
    # proto says TCP, and with Nagle on every small SSE write after the first waits for the client's
    # delayed ACK (~40 ms); the listener's TCP_NODELAY is inherited by accepted sockets as well.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if v6only and family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def announce(host: str, port: int) -> str:
    """The URL a client uses for a listener (the wildcard addresses shown as loopback)."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"http://{shown}:{port}"
