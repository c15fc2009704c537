"""Listening sockets a parent binds and hands to the server processes it starts.

`triptych serve` (and every local deployment) used to probe a free port, close the probe
and pass the number on; the child bound it only after loading its model, seconds later.
Any process on the machine (another deployment, an agent's ephemeral listener) could take
the port in between, and the child then failed to start. Instead the parent binds the
socket itself and the child inherits it (`--fd`): the port is held from the moment it is
chosen, and the child serves on exactly that socket.
"""

from __future__ import annotations

import socket


def reserve(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to (host, port) — port 0: any free one —, to hand to a child
    (`subprocess.Popen(pass_fds=...)`). Address reuse lets a restarted server bind the
    port its predecessor left (connections of the old one may linger in TIME_WAIT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def adopt(fd: int) -> socket.socket:
    """The child's side: the socket behind an inherited file descriptor (family and type
    read from it), for `uvicorn.Server.run(sockets=[...])`, which listens on it."""
    sock = socket.socket(fileno=fd)
    if sock.type != socket.SOCK_STREAM:
        raise SystemExit(f"--fd {fd} is not a stream socket")
    return sock
