"""An HTTP endpoint that misbehaves on purpose, in a thread: it stalls (reads the request, never answers) or answers
500 to everything. It counts what it received, so a test asserts how often the client tried, never how long."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class BadServer:
    endpoint: str
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _read_head(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        part = conn.recv(65536)
        if not part:
            break
        data += part
    return data.partition(b"\r\n\r\n")[0]


def _serve(listener: socket.socket, server: BadServer, mode: str, release: threading.Event) -> None:
    held: list[socket.socket] = []
    while not release.is_set():
        try:
            conn, _ = listener.accept()
        except OSError:  # the listener was closed: the test is over
            break
        if release.is_set():  # the wake-up connection from bad_http_server's exit
            conn.close()
            break
        with server.lock:
            server.connections += 1
        conn.settimeout(30)
        if mode == "stall":
            try:
                head = _read_head(conn)
            except OSError:
                head = b""
            with server.lock:
                server.requests.append(head.split(b"\r\n")[0])
            held.append(conn)  # never answered, closed only when the test ends
            continue
        with conn:
            try:
                head = _read_head(conn)
                with server.lock:
                    server.requests.append(head.split(b"\r\n")[0])
                body = b"<html>internal error</html>"  # one answer a connection, then closed: no idle keep-alive
                conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/html\r\nConnection: close"
                             b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            except OSError:
                pass
    for conn in held:
        conn.close()


@contextmanager
def bad_http_server(mode: str) -> Iterator[BadServer]:
    """`mode` is "stall" or "500"; the server lives for the `with` block on a free loopback port."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    server = BadServer(f"http://127.0.0.1:{listener.getsockname()[1]}")
    release = threading.Event()
    thread = threading.Thread(target=_serve, args=(listener, server, mode, release), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        release.set()
        with contextlib.suppress(OSError):  # wake the blocked accept(): closing the listener alone does not
            socket.create_connection(listener.getsockname(), timeout=5).close()
        thread.join(timeout=30)
        listener.close()
