"""In-sandbox start-up (stdlib only): listen on 127.0.0.1:PORT, forward each connection to the relay's unix
socket, then run the harness and exit with its status.

Why: the sandbox has its own network namespace (only loopback, no route out), and SDKs need a TCP base URL;
the only way out is the unix socket the runner bound in, which the runner proxies to the relay. The port
listens before the harness starts, so its first call never races the forwarder.

Usage: ``python3 sandbox_init.py PORT SOCKET -- ARGV...``
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    """Copy ``src`` to ``dst`` until EOF, then half-close ``dst``."""
    try:
        while chunk := src.recv(65536):
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _serve(conn: socket.socket, path: str) -> None:
    """One forwarded connection: TCP client <-> the relay's unix socket."""
    try:
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.connect(path)
    except OSError as exc:
        print(f"sandbox_init: cannot reach the relay socket {path}: {exc}", file=sys.stderr)
        conn.close()
        return
    back = threading.Thread(target=_pipe, args=(upstream, conn), daemon=True)
    back.start()
    _pipe(conn, upstream)
    back.join()
    conn.close()
    upstream.close()


def _accept(listener: socket.socket, path: str) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_serve, args=(conn, path), daemon=True).start()


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: sandbox_init.py PORT SOCKET -- ARGV...", file=sys.stderr)
        return 2
    port, path, command = int(argv[0]), argv[1], argv[3:]
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    threading.Thread(target=_accept, args=(listener, path), daemon=True).start()
    try:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    except OSError as exc:
        print(f"sandbox_init: cannot start the harness {command!r}: {exc}", file=sys.stderr)
        return 127
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    code = child.wait()
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell reports it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
