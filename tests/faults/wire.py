"""Just enough of the PostgreSQL, MySQL and MongoDB wire protocols to find where a statement begins and
where the server's whole answer to it ends, so the fault proxy can act at a chosen statement.

A *unit* is what the client sends before it waits: PostgreSQL's simple ``Query``, or an extended-protocol
batch (``Parse``/``Bind``/``Describe``/``Execute``... up to ``Sync`` or ``Flush``); a MySQL command packet;
a MongoDB request message (``OP_MSG``, or the ``OP_QUERY`` of an old handshake). Its *answer* is everything
the server sends for it: on PostgreSQL up to the ``ReadyForQuery`` that a ``Query`` or a ``Sync`` earns (a
``Flush`` earns none), on MySQL an OK, an ERR, or result sets up to the last EOF (following "more results"
flags), on MongoDB the reply whose ``responseTo`` is the request's id (and the replies after it while
each says ``moreToCome``; a request that says ``moreToCome`` earns none). Nothing here knows about sockets:
each reader takes a ``recv_exactly`` function, so the proxy decides how to wait.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import bson
from bson import json_util

Recv = Callable[[int], bytes]
"""``recv(n)``: exactly ``n`` bytes, or raises ``EOFError`` when the peer has gone."""

SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104
CANCEL_REQUEST = 80877102


@dataclass
class Unit:
    """What the client sent before waiting: its bytes, the statements' text, and whether an answer is due."""

    raw: bytes
    statements: list[str] = field(default_factory=list)
    answered: bool = True
    counted: bool = True
    """Whether rules see it: a MongoDB ``hello`` (a pool's handshake, a monitor's heartbeat, on a clock of
    the driver's own) is passed on uncounted, so a trial's n-th statement is the same on every replay."""

    @property
    def text(self) -> str:
        return "; ".join(self.statements)


# -- PostgreSQL -------------------------------------------------------------------------------------------


def pg_untyped(recv: Recv) -> tuple[bytes, int]:
    """A startup-phase message (no type byte): its bytes and its code (SSLRequest, StartupMessage...)."""
    head = recv(8)
    length, code = struct.unpack("!ii", head)
    return head + recv(length - 8), code


def pg_typed(recv: Recv, first: bytes = b"") -> tuple[bytes, bytes]:
    """A typed message: (its type byte, its whole bytes). ``first``: its type byte, if already read."""
    head = first + recv(5 - len(first))
    kind, length = head[:1], struct.unpack("!i", head[1:])[0]
    return kind, head + recv(length - 4)


def _cstring(body: bytes, at: int) -> tuple[str, int]:
    end = body.index(b"\0", at)
    return body[at:end].decode("utf-8", "replace"), end + 1


class PgClientUnits:
    """Groups the client's typed messages into units, remembering prepared statements' text by name."""

    def __init__(self) -> None:
        self.prepared: dict[str, str] = {}
        self.portals: dict[str, str] = {}
        self.pending: list[bytes] = []
        self.texts: list[str] = []
        self.last_parsed = ""

    def feed(self, kind: bytes, message: bytes) -> Unit | None:
        """``None`` while the batch goes on; the unit once a ``Query``, ``Sync``, ``Flush`` or ``Terminate`` ends it."""
        body = message[5:]
        self.pending.append(message)
        if kind == b"Q":
            self.texts.append(_cstring(body, 0)[0])
        elif kind == b"P":
            name, at = _cstring(body, 0)
            query = _cstring(body, at)[0]
            self.prepared[name] = query
            self.last_parsed = query
        elif kind == b"B":
            portal, at = _cstring(body, 0)
            statement, at = _cstring(body, at)
            query = self.prepared.get(statement, self.last_parsed if not statement else "?")
            self.portals[portal] = query + _pg_params(body, at)
        elif kind == b"E":
            self.texts.append(self.portals.get(_cstring(body, 0)[0], "?"))
        if kind not in (b"Q", b"S", b"H", b"X"):
            return None
        unit = Unit(b"".join(self.pending), self.texts, answered=kind in (b"Q", b"S"))
        self.pending, self.texts = [], []
        return unit


PARAM_CHARS = 20_000
"""How much of each bound parameter a unit's text shows."""


def _pg_params(body: bytes, at: int) -> str:
    """A ``Bind``'s parameters (from ``at``, its format codes), as text after the statement: ``-- $1=...``,
    so a rule can choose among the calls of one statement by what they carry (the PostgreSQL store's writes
    are all one function's call, told apart by their change's JSON)."""
    (codes,) = struct.unpack_from("!h", body, at)
    at += 2 + 2 * codes
    (count,) = struct.unpack_from("!h", body, at)
    at += 2
    shown = []
    for i in range(count):
        (length,) = struct.unpack_from("!i", body, at)
        at += 4
        value = "NULL" if length < 0 else body[at:at + min(length, PARAM_CHARS)].decode("utf-8", "replace")
        at += max(length, 0)
        shown.append(f"${i + 1}={value}")
    return f" -- {' '.join(shown)}" if shown else ""


def pg_backend_pid(message: bytes) -> int:
    """The backend's process id, from its BackendKeyData ('K') message."""
    return int(struct.unpack("!i", message[5:9])[0])


# -- MySQL ------------------------------------------------------------------------------------------------

COM_QUIT = 0x01
COM_QUERY = 0x03
CLIENT_DEPRECATE_EOF = 1 << 24
MORE_RESULTS = 0x0008
_MAX = 0xFFFFFF


def my_packet(recv: Recv) -> bytes:
    """One logical packet (continuations of a 16 MiB one included), header and all."""
    out = b""
    while True:
        head = recv(4)
        length = head[0] | head[1] << 8 | head[2] << 16
        out += head + recv(length)
        if length < _MAX:
            return out


def my_payload(packet: bytes) -> bytes:
    return packet[4:]


def my_thread_id(greeting: bytes) -> int:
    """The connection id from the server's initial handshake (protocol 10)."""
    payload = my_payload(greeting)
    end = payload.index(b"\0", 1)
    return int(struct.unpack("<I", payload[end + 1 : end + 5])[0])


def my_client_flags(response: bytes) -> int:
    """The capability flags of the client's handshake response (protocol 41)."""
    return int(struct.unpack("<I", my_payload(response)[:4])[0])


def my_unit(packet: bytes) -> Unit:
    payload = my_payload(packet)
    command = payload[0] if payload else -1
    text = payload[1:].decode("utf-8", "replace") if command == COM_QUERY else f"command {command:#04x}"
    return Unit(packet, [text], answered=command != COM_QUIT)


def _lenenc(payload: bytes, at: int) -> tuple[int, int]:
    first = payload[at]
    if first < 0xFB:
        return first, at + 1
    size = {0xFC: 2, 0xFD: 3, 0xFE: 8}[first]
    return int.from_bytes(payload[at + 1 : at + 1 + size], "little"), at + 1 + size


def _status(payload: bytes) -> int:
    """Status flags of an OK packet (after its affected-rows and insert-id) or of an old-style EOF."""
    if payload[0] == 0xFE and len(payload) < 9:
        return int(struct.unpack("<H", payload[3:5])[0]) if len(payload) >= 5 else 0
    _, at = _lenenc(payload, 1)
    _, at = _lenenc(payload, at)
    return int(struct.unpack("<H", payload[at : at + 2])[0])


def my_answer(recv: Recv, command: int, deprecate_eof: bool) -> list[bytes]:
    """Every packet of the server's answer to one command."""
    packets: list[bytes] = []

    def next_payload() -> bytes:
        packet = my_packet(recv)
        packets.append(packet)
        return my_payload(packet)

    while True:
        first = next_payload()
        if command != COM_QUERY or first[0] == 0xFF:
            return packets  # OK/ERR/EOF: one packet (a non-query command, or any error)
        if first[0] == 0x00:
            if _status(first) & MORE_RESULTS:
                continue
            return packets
        columns, _ = _lenenc(first, 0)
        for _ in range(columns):
            next_payload()
        if not deprecate_eof:
            next_payload()  # the EOF after the column definitions
        while True:
            row = next_payload()
            if row[0] == 0xFF:
                return packets
            if row[0] == 0xFE and len(row) < _MAX:
                if len(row) < 9 or deprecate_eof:
                    break
        if not _status(row) & MORE_RESULTS:
            return packets


# -- MongoDB ----------------------------------------------------------------------------------------------

OP_REPLY = 1
OP_QUERY = 2004
OP_COMPRESSED = 2012
OP_MSG = 2013
MORE_TO_COME = 1 << 1
CHECKSUM = 1 << 0
_HELLO = {"hello", "ismaster"}
_NOISE = {"lsid", "$db", "$clusterTime", "txnNumber", "$readPreference"}


def mongo_message(recv: Recv) -> tuple[bytes, int, int, int]:
    """One message: (its bytes, its requestID, its responseTo, its opCode)."""
    head = recv(16)
    length, request_id, response_to, op_code = struct.unpack("<iiii", head)
    return head + recv(length - 16), request_id, response_to, op_code


def mongo_more_to_come(message: bytes) -> bool:
    """An ``OP_MSG`` whose sender sends more without waiting: a request that earns no reply, or an exhaust
    reply that other replies follow."""
    op_code, flags = struct.unpack("<iI", message[12:20])
    return op_code == OP_MSG and bool(flags & MORE_TO_COME)


def _mongo_sections(message: bytes) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """An ``OP_MSG``'s body and its document sequences (``documents``, ``updates``... by identifier)."""
    flags = struct.unpack("<I", message[16:20])[0]
    end = len(message) - (4 if flags & CHECKSUM else 0)
    at, body, sequences = 20, {}, {}
    while at < end:
        kind, at = message[at], at + 1
        size = struct.unpack("<i", message[at : at + 4])[0]
        if kind == 0:
            body = bson.decode(message[at : at + size])
        else:
            name, start = _cstring(message, at + 4)
            sequences[name] = list(bson.decode_all(message[start : at + size]))
        at += size
    return body, sequences


def mongo_unit(message: bytes) -> Unit:
    """A request as a unit. Its text: the command's name and collection (``update agent_sessions``), then its
    body and document sequences in compact extended JSON (the session id, the fence, the update), without
    the driver's bookkeeping (``lsid``, ``$db``...)."""
    op_code = struct.unpack("<i", message[12:16])[0]
    if op_code == OP_QUERY:  # an old driver's handshake or command: flags, collection, skip, return, query
        at = _cstring(message, 20)[1] + 8
        body, sequences = bson.decode(message[at : at + struct.unpack("<i", message[at : at + 4])[0]]), {}
    elif op_code == OP_MSG:
        body, sequences = _mongo_sections(message)
    else:  # OP_COMPRESSED among them: the client must not negotiate compression with the server
        raise ValueError(f"MongoDB opCode {op_code}: the proxy reads OP_MSG and OP_QUERY only")
    name = next(iter(body), "?")
    target = body.get(name)
    rest = {k: v for k, v in body.items() if k != name and k not in _NOISE}
    text = f"{name} {target if isinstance(target, str) else ''} {_compact(rest)}"
    for ident, docs in sequences.items():
        text += f" {ident}: {_compact(docs)}"
    return Unit(message, [text], answered=not mongo_more_to_come(message), counted=name.lower() not in _HELLO)


def _compact(value: object) -> str:
    return json_util.dumps(value, separators=(",", ":"))
