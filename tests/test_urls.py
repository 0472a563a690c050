"""``stores.urls``: a URL's scheme picks the store, the built-in ones and another package's (an entry point),
and the CLI opens every store through it: a Redis store is listed by ``--store redis://...`` with no line of
the CLI naming Redis."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
import redis as redis_py

import agent_sessions as agent
from stores import mongodb, mysql, postgres, redis, sqlite, urls
from tests import servers
from tests.test_cli import run_cli


def _saved(store: agent.Store, session: str) -> None:
    assert isinstance(store, agent.RunStore)
    store.save(session, [agent.Message.user("hello"), agent.Message.assistant("hi")])


def test_each_scheme_opens_its_store(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    sqlite.open(path).close()
    cases = [
        (str(path), sqlite.Store),
        (f"sqlite:///{path}", sqlite.Store),
        (servers.POSTGRES_URL.replace("postgresql+psycopg", "postgresql"), postgres.Store),
        (servers.POSTGRES_URL, postgres.Store),
        (servers.MYSQL_URL.replace("mysql+pymysql", "mariadb"), mysql.Store),
        (f"{servers.REDIS_URL}?prefix={servers.REDIS_KEY_PREFIX}urls:", redis.Store),
    ]
    for url, kind in cases:
        opened = urls.open_url(url)
        try:
            assert isinstance(opened.store, kind), url
        finally:
            opened.close()


def test_a_redis_url_keeps_its_prefix_apart() -> None:
    prefix = f"{servers.REDIS_KEY_PREFIX}urls{uuid.uuid4().hex[:6]}:"
    opened = urls.open_url(f"{servers.REDIS_URL}?prefix={prefix}")
    client = redis_py.Redis.from_url(servers.REDIS_URL)
    try:
        _saved(opened.store, "greeting")
        assert client.keys(f"{prefix}*")
    finally:
        opened.close()
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
        client.close()


def test_a_mongodb_url_names_its_database() -> None:
    base, _, query = servers.MONGO_URL.partition("?")
    opened = urls.open_url(f"{base.rstrip('/')}/{servers.database_name('urls')}?{query}")
    try:
        assert isinstance(opened.store, mongodb.Store)
    finally:
        opened.close()
    with pytest.raises(urls.BadStoreURL, match="names no database"):
        urls.open_url(servers.MONGO_URL)


@pytest.mark.parametrize("url, words", [
    ("", "empty"),
    ("ftp://host/x", "unknown store URL scheme 'ftp'"),
    ("postgresql+asyncpg://u:hunter2@h/db", "runs on psycopg"),
    ("sqlite://relative.db", "sqlite:///relative/path.db"),
    ("mysql+pymysql://u:p@ss@h/db", "escape each @"),
])
def test_a_bad_url_is_an_argument_error_without_its_password(url: str, words: str) -> None:
    with pytest.raises(agent.ArgumentError, match=words) as caught:
        urls.open_url(url)
    assert "hunter2" not in str(caught.value)


def test_another_package_joins_by_an_entry_point(tmp_path: Path) -> None:
    """A store of another distribution: its scheme found by ``importlib.metadata``, in the CLI too."""
    (tmp_path / "inmem_kind.py").write_text(textwrap.dedent('''
        from stores import memory, urls

        STORE = memory.Store()

        def _open(url, options):
            return urls.Opened(STORE, STORE.close, ())

        KIND = urls.Kind("inmem", "inmem", _open, lambda: "-- nothing to create\\n")
    '''))
    info = tmp_path / "inmem_store-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: inmem-store\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{urls.ENTRY_POINTS}]\ninmem = inmem_kind:KIND\n")
    code = textwrap.dedent('''
        import sys
        from stores import urls
        kind = urls.kind_of("inmem://anything")
        opened = urls.open_url("inmem://anything")
        print(kind.name, type(opened.store).__name__)
    ''')
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**_env(), "PYTHONPATH": f"{tmp_path}:{_root()}"})
    assert done.stdout.split() == ["inmem", "Store"], done.stderr
    ran = run_cli("schema", store="inmem://x", pythonpath=tmp_path)
    assert ran.code == 0 and ran.out == "-- nothing to create\n", ran
    ran = run_cli("list", store="inmem://x", pythonpath=tmp_path)
    assert ran.code == 0 and ran.out == "no sessions\n", ran


def test_the_cli_lists_a_redis_store() -> None:
    prefix = f"{servers.REDIS_KEY_PREFIX}cli{uuid.uuid4().hex[:6]}:"
    client = redis_py.Redis.from_url(servers.REDIS_URL)
    store = redis.Store(client, prefix=prefix)
    try:
        _saved(store, "chat-r")
        ran = run_cli("--json", "list", store=f"{servers.REDIS_URL}?prefix={prefix}")
        assert ran.code == 0, ran
        assert [s["id"] for s in ran.doc["sessions"]] == ["chat-r"]
        ran = run_cli("schema", store=f"{servers.REDIS_URL}?prefix={prefix}")
        assert ran.code == 1 and "creates what it needs itself" in ran.err, ran
    finally:
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
        client.close()


def _root() -> str:
    return str(Path(__file__).resolve().parent.parent)


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)
