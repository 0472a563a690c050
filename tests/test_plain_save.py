"""A plain save (``BackedStore.save``, "the stored transcript becomes ``msgs``") writes only what is new when
``msgs`` extend what the same store object last saved or read of the transcript whole, guarded by the
incarnation, edits and length it had then; else the whole transcript. The rule is the library's: checked
here on the memory store and SQLite, through the backend's writes."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import agent_sessions as agent
from agent_sessions import Message
from agent_sessions.backed import BackedStore
from agent_sessions.backend import Change, Guard, Written
from stores import memory, sqlite
from storetest.mixin import stand_in

SYSTEM = Message.user("You are terse.")
"""A message a program makes once and puts at the start of every conversation."""


@pytest.fixture(params=["memory", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BackedStore]:
    made: BackedStore = memory.Store() if request.param == "memory" else sqlite.open(tmp_path / "s.db")
    yield made
    made.close()


class _Noted:
    """The store's backend, noting each write's change."""

    def __init__(self, backend: Any) -> None:
        self.backend, self.changes = backend, list[Change]()

    def write(self, session: str, guard: Guard, change: Change) -> Written:
        self.changes.append(change)
        return self.backend.write(session, guard, change)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.backend, name)


def test_a_save_extending_what_was_saved_or_read_writes_only_the_new_messages(store: BackedStore) -> None:
    first = [Message.user("q"), Message.assistant("a")]
    more, most, other = Message.user("more"), Message.assistant("most"), Message.user("other")
    store.save("s", first)
    noted = _Noted(store.backend)
    with stand_in(store, noted):
        store.save("s", [*first, more])  # its last save, and more
        store.save("s", [*store.messages("s"), most])  # a whole read, and more
        store.save("s", [Message.user("q"), other])  # not an extension: written whole
        store.save("s", [Message.user("q"), other, more])  # equal messages extend too
    assert [c.splice for c in noted.changes] == [(2, (more.to_json(),)), (3, (most.to_json(),)),
                                                 (0, (Message.user("q").to_json(), other.to_json())),
                                                 (2, (more.to_json(),))]
    assert store.messages("s") == [Message.user("q"), other, more]


def test_a_save_after_another_store_object_changed_the_transcript_writes_it_whole(tmp_path: Path) -> None:
    mine, theirs = sqlite.open(tmp_path / "s.db"), sqlite.open(tmp_path / "s.db")
    mine.save("s", [SYSTEM, Message.user("q")])
    theirs.save("s", [SYSTEM, Message.user("other")])  # same length, another transcript
    mine.save("s", [SYSTEM, Message.user("q"), Message.assistant("a")])
    assert theirs.messages("s") == [SYSTEM, Message.user("q"), Message.assistant("a")]
    assert theirs.delete("s")
    mine.save("s", [SYSTEM, Message.user("q"), Message.assistant("a"), Message.user("next")])  # a new session
    assert mine.messages("s") == [SYSTEM, Message.user("q"), Message.assistant("a"), Message.user("next")]


def test_a_run_after_a_delete_starts_anew_with_messages_a_plain_save_wrote(store: BackedStore) -> None:
    """Saving marks no message as read: a message saved before (a program's constant, or the very list) is
    no message read from the erased conversation, so a run after a delete takes it."""
    convo = [SYSTEM, Message.user("first question")]
    store.save("s", convo)
    assert store.delete("s")
    agent.Runner().run(agent.Spec(session=agent.open("s", store)), [SYSTEM, Message.user("again")], _Answer())
    assert [m.text for m in store.messages("s")] == [SYSTEM.text, "again", "hi"]
    assert store.delete("s")
    agent.Runner().run(agent.Spec(session=agent.open("s", store)), convo, _Answer())
    assert [m.text for m in store.messages("s")] == [SYSTEM.text, "first question", "hi"]


def test_messages_read_from_a_copy_of_the_database_are_saved_whole_to_the_original(tmp_path: Path) -> None:
    """A copy keeps the database's identity and the session's incarnation: what was read there is not what
    this store object saved or read here."""
    original = sqlite.open(tmp_path / "a.db")
    original.save("s", [Message.user("q"), Message.assistant("a")])
    original.close()
    shutil.copy(tmp_path / "a.db", tmp_path / "copy.db")
    original, copy = sqlite.open(tmp_path / "a.db"), sqlite.open(tmp_path / "copy.db")
    original.save("s", [Message.user("x"), Message.assistant("y"), Message.user("z")])
    copy.save("s", [*copy.messages("s"), Message.user("from the copy")])
    msgs = [*copy.messages("s"), Message.assistant("answer")]
    original.save("s", msgs)
    assert original.messages("s") == msgs


class _Answer:
    def complete(self, system: str, messages: Any, tools: Any) -> Message:
        return Message.assistant("hi")
