"""A TCP proxy in front of a database server, so a test can stop "the server" (refuse and cut every
connection) and bring it back on the same port, without touching the real server, or put the server a
network hop away (``delay``)."""

from __future__ import annotations

import socket
import threading
import time


class Proxy:
    def __init__(self, upstream_port: int, delay: float = 0.0) -> None:
        """``delay``: seconds each chunk waits before it is passed on, each way (a database one network hop
        away: 0.0005 makes a round trip about a millisecond longer)."""
        self.upstream = ("127.0.0.1", upstream_port)
        self.delay = delay
        self.port = 0
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.cut = 0
        """Connections cut by stop(), over the proxy's life."""

    def start(self) -> Proxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def stop(self) -> None:
        """The server goes away: new connections are refused, open ones are reset."""
        with self._lock:  # _accept registers a connection only while its listener is the current one
            listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked on it
            except OSError:
                pass
            listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, set()
        for s in sockets:
            self.cut += 1
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                # Wakes the pump blocked in recv() on it (nothing goes on the wire): a socket closed under a
                # blocked recv() stays open until that returns, which, for an idle connection, is never.
                s.shutdown(socket.SHUT_RD)
            except OSError:
                pass
            s.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:  # stop() came while this one was being connected: it
                    client.close()  # must not outlive the "server", nor slip past stop()'s list
                    server.close()
                    return
                self._sockets.update((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if self.delay:
                    time.sleep(self.delay)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                cut = source not in self._sockets
            if not cut:  # one side hung up: pass it on. (Cut by stop(), which resets both instead.)
                for s in (source, sink):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
