"""A fault-injecting TCP proxy in front of PostgreSQL, MySQL/MariaDB or MongoDB, for the tests of issue #25.

It forwards the wire protocol unchanged and, at a chosen statement (the n-th unit whose text matches a
pattern, counted over all connections), does one of:

- ``lose_ack``: forwards the statement, reads the server's whole answer, drops it and cuts the
  connection: the statement ran (a COMMIT committed) and the client never hears so;
- ``cut_before`` / ``cut_inside`` / ``cut_after``: cuts before forwarding it, after half its bytes, or
  after its answer reached the client;
- ``terminate``: has the server end the backend (``pg_terminate_backend``, ``KILL CONNECTION``, through
  the ``terminate`` callback the test gives, which receives the backend's id), then forwards it;
- ``delay``: holds it for ``seconds`` before forwarding;
- ``freeze``: stops forwarding on that connection in both directions, without FIN or RST, until
  ``thaw()`` (a paused VM, a stopped process on the far side).

On MongoDB a statement is a request message (a command: ``update agent_sessions {...}``), and there is no
``terminate`` (no backend to end from outside that the driver would see otherwise than as a cut).

``partition()`` freezes every connection, and holds new ones, until ``heal()``. A cut is an RST towards
the client and a close towards the server, as when a middlebox drops the connection.

Every wait in here is bounded or ends with ``close()``: pumps block in ``recv`` on sockets that
``close()`` shuts down, and a frozen pump waits on an event in slices.
"""

from __future__ import annotations

import logging
import re
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bson.errors import BSONError

from . import wire

log = logging.getLogger(__name__)

FAULTS = ("lose_ack", "cut_before", "cut_inside", "cut_after", "terminate", "delay", "freeze")


@dataclass
class Rule:
    """Fire ``fault`` at the ``nth`` unit (1-based, over all connections) whose text matches ``pattern``."""

    fault: str
    pattern: str = ".*"
    nth: int = 1
    seconds: float = 0.0
    after: str | None = None
    """Only a unit that follows, on its connection, one matching this (the COMMIT of an INSERT, say)."""
    seen: int = 0
    fired: list[str] = field(default_factory=list)
    """The text of the unit it fired at (empty until it fires)."""

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}: one of {FAULTS}")
        self._re = re.compile(self.pattern, re.IGNORECASE | re.DOTALL)
        self._after = None if self.after is None else re.compile(self.after, re.IGNORECASE | re.DOTALL)

    def matches(self, text: str, previous: str) -> bool:
        if self.fired or not self._re.search(text):
            return False
        if self._after is not None and not self._after.search(previous):
            return False
        self.seen += 1
        return self.seen == self.nth


def pg_write(key: str, value: str = "") -> str:
    """The pattern of a server store's write (every one is one call of ``agent_sessions_write``: PostgreSQL's
    function, its parameters shown after the statement: wire.py; MySQL's procedure, its arguments inside the
    CALL as PyMySQL escapes them) whose change has ``key``, its value starting with ``value`` (a regular
    expression): ``pg_write("splice")``, ``pg_write("lease", "{.release")``."""
    mysql = value.replace('"', r'\\"')
    return (rf'agent_sessions_write\(.* \$3=\{{(.*[ ,])?"{key}": {value}'
            rf"|CALL agent_sessions_write\(X'[0-9a-f]*', '(?:[^'\\]|\\.)*', '\{{(.*[ ,])?\\\"{key}\\\": {mysql}")


def every_attempt(proxy: FaultProxy, fault: str, pattern: str, attempts: int = 5) -> list[Rule]:
    """``fault`` at each of the first ``attempts`` statements matching ``pattern``: a SQL store runs a
    write again on a new connection when its line was cut before it committed anything (at most 4 more
    times), so a write that is to fail must be cut at each attempt."""
    return [proxy.arm(Rule(fault, pattern)) for _ in range(attempts)]  # each fires at the next match


class _Cut(Exception):
    """The proxy ended this connection on purpose."""


class _Conn:
    """One client connection and its upstream one, with a pump each way."""

    def __init__(self, proxy: FaultProxy, client: socket.socket, server: socket.socket) -> None:
        self.proxy, self.client, self.server = proxy, client, server
        self.flowing = threading.Event()
        self.flowing.set()
        self.closed = threading.Event()
        self.backend_id: int | None = None
        self.lock = threading.Lock()
        self.expect_byte = 0  # PostgreSQL: one-byte answers due (to SSLRequest/GSSENCRequest)
        self.sent_units = 0  # units sent that earn an answer
        self.answered_units = 0
        self.drop = 0  # n: the n-th answer is dropped, then the connection cut (lose_ack); -n: cut after it
        self.commands: list[int] = []  # MySQL: commands awaiting their answer
        self.deprecate_eof = False
        self.handshaken = threading.Event()
        self.previous = ""  # the text of the unit before, on this connection

    # -- plumbing ---------------------------------------------------------------------------------------

    def recv_from(self, sock: socket.socket) -> wire.Recv:
        def recv(n: int) -> bytes:
            out = b""
            while len(out) < n:
                try:
                    chunk = sock.recv(n - len(out))
                except OSError as exc:
                    raise EOFError(str(exc)) from exc
                if not chunk:
                    raise EOFError("peer closed")
                out += chunk
            return out

        return recv

    def wait_flowing(self) -> None:
        while not self.flowing.wait(0.05):
            if self.closed.is_set() or self.proxy.closing.is_set():
                raise _Cut("closed while frozen")
        while not self.proxy.flowing.wait(0.05):
            if self.closed.is_set() or self.proxy.closing.is_set():
                raise _Cut("closed while partitioned")

    def send(self, sock: socket.socket, data: bytes) -> None:
        self.wait_flowing()
        try:
            sock.sendall(data)
        except OSError as exc:
            raise EOFError(str(exc)) from exc

    def cut(self, why: str) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        log.info("fault proxy: cut a connection (%s)", why)
        for sock, reset in ((self.client, True), (self.server, False)):
            try:
                if reset:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def start(self) -> None:
        up, down = {"postgres": (self._pg_up, self._pg_down), "mysql": (self._my_up, self._my_down),
                    "mongodb": (self._mongo_up, self._mongo_down)}[self.proxy.protocol]
        for pump in (up, down):
            threading.Thread(target=self._guard, args=(pump,), daemon=True).start()

    def _guard(self, pump: Callable[[], None]) -> None:
        try:
            pump()
        except (EOFError, _Cut, ValueError, IndexError, struct.error, BSONError) as exc:
            self.cut(f"{pump.__name__}: {exc}")

    # -- faults -----------------------------------------------------------------------------------------

    def apply(self, unit: wire.Unit) -> None:
        """Forward ``unit`` upstream, doing what an armed rule says on the way."""
        rule = self.proxy.rule_for(unit.text, self.previous) if unit.counted else None
        if unit.counted:
            self.previous = unit.text
        fault = rule.fault if rule is not None else None
        if rule is not None:
            rule.fired.append(unit.text)
            self.proxy.record(rule, unit.text)
        if fault == "cut_before":
            raise _Cut("cut_before")
        if fault == "delay":
            assert rule is not None
            time.sleep(rule.seconds)
        if fault == "terminate":
            assert self.proxy.terminate is not None and self.backend_id is not None
            self.proxy.terminate(self.backend_id)
        if fault == "freeze":
            self.flowing.clear()
        if fault == "cut_inside":
            self.send(self.server, unit.raw[: max(1, len(unit.raw) // 2)])
            raise _Cut("cut_inside")
        with self.lock:
            if unit.answered:
                self.sent_units += 1
                if fault in ("lose_ack", "cut_after"):
                    self.drop = self.sent_units if fault == "lose_ack" else -self.sent_units
        self.send(self.server, unit.raw)

    def answered(self, packets: bytes) -> None:
        """The whole answer to the next unit arrived: pass it on, or drop it and cut (lose_ack), or pass
        it on and cut (cut_after)."""
        with self.lock:
            self.answered_units += 1
            number = self.answered_units
        if self.drop == number:
            raise _Cut("lose_ack")
        self.send(self.client, packets)
        if self.drop == -number:
            raise _Cut("cut_after")

    # -- PostgreSQL -------------------------------------------------------------------------------------

    def _pg_up(self) -> None:
        recv = self.recv_from(self.client)
        while True:  # the startup phase: SSL/GSS requests answered by a byte, then the startup message
            message, code = wire.pg_untyped(recv)
            if code in (wire.SSL_REQUEST, wire.GSSENC_REQUEST):
                with self.lock:
                    self.expect_byte += 1
                self.send(self.server, message)
                continue
            self.send(self.server, message)
            if code == wire.CANCEL_REQUEST:
                return
            break
        units = wire.PgClientUnits()
        while True:
            kind, message = wire.pg_typed(recv)
            if not self.handshaken.is_set():  # authentication messages (a password): forward as they are
                self.send(self.server, message)
                continue
            unit = units.feed(kind, message)
            if unit is not None:
                self.apply(unit)

    def _pg_down(self) -> None:
        recv = self.recv_from(self.server)
        answer: list[bytes] = []
        while True:
            first = recv(1)  # read before deciding: the server says nothing before the request it answers
            with self.lock:
                single = self.expect_byte > 0
                if single:
                    self.expect_byte -= 1
            if single:
                if first != b"N":
                    raise _Cut(f"server offered encryption ({first!r}): the proxy speaks plain text only")
                self.send(self.client, first)
                continue
            kind, message = wire.pg_typed(recv, first)
            if not self.handshaken.is_set():
                if kind == b"K":
                    self.backend_id = wire.pg_backend_pid(message)
                if kind == b"Z":  # set before the client can answer it, so its first query counts as one
                    self.handshaken.set()
                self.send(self.client, message)
                continue
            answer.append(message)
            if kind == b"Z":
                whole, answer = b"".join(answer), []
                self.answered(whole)

    # -- MySQL ------------------------------------------------------------------------------------------

    def _my_up(self) -> None:
        recv = self.recv_from(self.client)
        first = True
        while not self.handshaken.is_set():
            packet = wire.my_packet(recv)
            if first:
                self.deprecate_eof = bool(wire.my_client_flags(packet) & wire.CLIENT_DEPRECATE_EOF)
                first = False
            self.send(self.server, packet)
            # the server's verdict (OK, ERR, or an auth switch that needs another client packet)
            while not self.handshaken.is_set() and not self.closed.is_set():
                if self._auth_more.wait(0.05):
                    self._auth_more.clear()
                    break
        while True:
            packet = wire.my_packet(recv)
            unit = wire.my_unit(packet)
            if unit.answered:
                with self.lock:
                    self.commands.append(wire.my_payload(packet)[0])
            self.apply(unit)

    _auth_more: threading.Event

    def _my_down(self) -> None:
        recv = self.recv_from(self.server)
        greeting = wire.my_packet(recv)
        self.backend_id = wire.my_thread_id(greeting)
        self.send(self.client, greeting)
        while True:
            packet = wire.my_packet(recv)
            head = wire.my_payload(packet)[0]
            if head in (0x00, 0xFF):  # set before the client can answer it, so its first command counts
                self.handshaken.set()
                self.send(self.client, packet)
                break
            self.send(self.client, packet)
            self._auth_more.set()  # an auth switch or more auth data: the client answers
        while True:
            packets = wire.my_answer(recv, self._next_command(), self.deprecate_eof)
            self.answered(b"".join(packets))

    def _next_command(self) -> int:
        deadline = time.monotonic() + 3600
        while time.monotonic() < deadline:
            with self.lock:
                if self.commands:
                    return self.commands.pop(0)
            if self.closed.wait(0.001):
                raise _Cut("closed")
        raise _Cut("no command for an hour")


    # -- MongoDB ----------------------------------------------------------------------------------------

    def _mongo_up(self) -> None:
        recv = self.recv_from(self.client)
        self.handshaken.set()  # the handshake is a hello like any: passed on uncounted (wire.Unit.counted)
        while True:
            message, *_ = wire.mongo_message(recv)
            self.apply(wire.mongo_unit(message))

    def _mongo_down(self) -> None:
        recv = self.recv_from(self.server)
        answer: list[bytes] = []
        while True:  # the driver waits for each reply before its next request: replies come in order
            message, *_ = wire.mongo_message(recv)
            answer.append(message)
            if not wire.mongo_more_to_come(message):
                whole, answer = b"".join(answer), []
                self.answered(whole)


class FaultProxy:
    """``FaultProxy("postgres", 5432).start()``; point the engine at ``proxy.port``; ``arm(Rule(...))``."""

    def __init__(self, protocol: str, upstream_port: int, terminate: Callable[[int], None] | None = None) -> None:
        if protocol not in ("postgres", "mysql", "mongodb"):
            raise ValueError(f"protocol {protocol!r}: postgres, mysql or mongodb")
        self.protocol = protocol
        self.upstream = ("127.0.0.1", upstream_port)
        self.terminate = terminate
        self.port = 0
        self.flowing = threading.Event()
        self.flowing.set()
        self.closing = threading.Event()
        self.rules: list[Rule] = []
        self.log: list[tuple[str, str]] = []
        """(fault, statement) of every fault fired, in order."""
        self.statements: list[str] = []
        """The text of every unit seen, in order (to choose a statement for a later trial)."""
        self._conns: list[_Conn] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None

    def start(self) -> FaultProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def arm(self, rule: Rule) -> Rule:
        if rule.fault == "terminate" and self.terminate is None:
            raise ValueError(f"terminate on {self.protocol}: the proxy was given no way to end a backend")
        with self._lock:
            self.rules.append(rule)
        return rule

    def disarm(self) -> None:
        """Drop every rule that has not fired."""
        with self._lock:
            self.rules = [rule for rule in self.rules if rule.fired]

    def rule_for(self, text: str, previous: str = "") -> Rule | None:
        with self._lock:
            self.statements.append(text)
            for rule in self.rules:
                if rule.matches(text, previous):
                    return rule
        return None

    def record(self, rule: Rule, text: str) -> None:
        with self._lock:
            self.log.append((rule.fault, text))
        log.info("fault proxy: %s at %r", rule.fault, text[:120])

    def partition(self) -> None:
        """Nothing goes through, either way, on any connection, old or new, until ``heal()``."""
        self.flowing.clear()

    def heal(self) -> None:
        self.flowing.set()

    def thaw(self) -> None:
        """Frozen connections flow again."""
        with self._lock:
            for conn in self._conns:
                conn.flowing.set()

    def cut_all(self) -> None:
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.cut("cut_all")

    def close(self) -> None:
        self.closing.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        self.cut_all()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self.closing.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            conn = _Conn(self, client, server)
            conn._auth_more = threading.Event()
            with self._lock:
                self._conns = [c for c in self._conns if not c.closed.is_set()] + [conn]
            conn.start()
