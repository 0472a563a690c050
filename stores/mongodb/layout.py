"""How a transcript lies in MongoDB: its last few messages in the session's document (the tail, under
``PAGE``), the older ones in pages of up to ``PAGE`` messages and ``PAGE_BYTES`` in ``agent_pages``, and the
version, in the document, that names them (``Layout``). An event log lies the same way (``EVENT_LIMITS``: its
tail in the document, its pages in ``agent_event_pages``; events.py).

The version is ``"<generation>:<length>:<in pages>:<pages>"``. A rewrite starts a new generation; within one,
messages only ever follow those committed, and page ``k`` is written once, so a version names one transcript.
Pages of a generation a rewrite replaced are deleted after it commits; a page a writer left behind when it
died before committing is harmless (no version reaches it).

Only what lies where: reading and writing it is ``pages.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

PAGE = 32
"""Messages a page holds at most. The tail stays under it, so an append rewrites at most this many on the
server."""
PAGE_BYTES = 4 * 2**20
"""Bytes of stored JSON a page holds at most (a larger message gets a page of its own): a document is at
most 16 MB."""
TAIL_BYTES = 4 * 2**20
"""Bytes of stored JSON the session document's tail holds at most, beside its steers and journal."""
MAX_MESSAGE_BYTES = 15 * 2**20
"""The largest stored message (its JSON): alone in a page, under the 16 MB document limit."""


@dataclass(frozen=True, slots=True)
class Layout:
    """What a version names: a generation of pages, the transcript's length, how many of its messages are
    in pages (the rest are the document's tail) and in how many pages. Written ``"g:length:base:pages"``;
    0.1's ``"g:length"`` had pages of exactly ``PAGE`` messages."""

    generation: str
    length: int
    base: int
    pages: int

    @classmethod
    def of(cls, version: str) -> Layout:
        generation, *numbers = version.split(":")
        if len(numbers) == 1:
            length = int(numbers[0])
            base = length - length % PAGE
            return cls(generation, length, base, base // PAGE)
        length, base, pages = (int(n) for n in numbers)
        return cls(generation, length, base, pages)

    def version(self) -> str:
        return f"{self.generation}:{self.length}:{self.base}:{self.pages}"


@dataclass(frozen=True, slots=True)
class Limits:
    """How many items, and bytes, a page and a document's tail hold: the tail stays under ``page`` items and
    at most ``tail_bytes``; a page holds up to ``page`` items and ``page_bytes`` (or one larger item alone)."""

    page: int
    page_bytes: int
    tail_bytes: int
    size: Callable[[str], int] = len

    def overflows(self, tail: list[str]) -> bool:
        """Would the tail hold too much: ``page`` items, or more than ``tail_bytes``?"""
        return len(tail) >= self.page or sum(self.size(b) for b in tail) > self.tail_bytes

    def cut(self, bodies: list[str]) -> tuple[list[list[str]], list[str]]:
        """Pages from the front of ``bodies`` until what is left fits the tail."""
        pages: list[list[str]] = []
        rest = bodies
        while self.overflows(rest):
            size, n = 0, 0
            while n < len(rest) and n < self.page and (n == 0 or size + self.size(rest[n]) <= self.page_bytes):
                size += self.size(rest[n])
                n += 1
            pages.append(rest[:n])
            rest = rest[n:]
        return pages, rest


def utf8_size(text: str) -> int:
    """The bytes ``text`` takes in BSON (UTF-8): an event is opaque text, not necessarily ASCII."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


MESSAGE_LIMITS = Limits(PAGE, PAGE_BYTES, TAIL_BYTES)
"""The transcript's: its messages are ASCII JSON, so a character is a byte."""

EVENT_PAGE = 32
"""Events an event page holds at most; the session document's events tail stays under it."""
EVENT_PAGE_BYTES = 4 * 2**20
"""Bytes of event text an event page holds at most (a larger event gets a page of its own)."""
EVENT_TAIL_BYTES = 256 * 2**10
"""Bytes of event text the session document's events tail holds at most: every update of the document
rewrites it (on mongoeco, and in WiredTiger), so it stays small beside the transcript's tail."""
EVENT_LIMITS = Limits(EVENT_PAGE, EVENT_PAGE_BYTES, EVENT_TAIL_BYTES, utf8_size)

