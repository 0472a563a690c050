"""How a transcript lies in MongoDB: its last few messages in the session's document (the tail, under
``PAGE``), the older ones in pages of up to ``PAGE`` messages and ``PAGE_BYTES`` in ``agent_pages``, and the
version, in the document, that names them (``Layout``).

The version is ``"<generation>:<length>:<in pages>:<pages>"``. A rewrite starts a new generation; within one,
messages only ever follow those committed, and page ``k`` is written once, so a version names one transcript.
Pages of a generation a rewrite replaced are deleted after it commits; a page a writer left behind when it
died before committing is harmless (no version reaches it).

Only what lies where: reading and writing it is ``pages.py``'s.
"""

from __future__ import annotations

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


def overflows(tail: list[str]) -> bool:
    """Would the document's tail hold too much: ``PAGE`` messages, or more than ``TAIL_BYTES``?"""
    return len(tail) >= PAGE or sum(len(b) for b in tail) > TAIL_BYTES


def cut(bodies: list[str]) -> tuple[list[list[str]], list[str]]:
    """Pages from the front of ``bodies`` (each up to ``PAGE`` messages and ``PAGE_BYTES``, or one larger
    message alone) until what is left fits the tail."""
    pages: list[list[str]] = []
    rest = bodies
    while overflows(rest):
        size, n = 0, 0
        while n < len(rest) and n < PAGE and (n == 0 or size + len(rest[n]) <= PAGE_BYTES):
            size += len(rest[n])
            n += 1
        pages.append(rest[:n])
        rest = rest[n:]
    return pages, rest
