"""The core loads no database driver and no OpenTelemetry, and storetest depends on no store."""

from __future__ import annotations

import subprocess
import sys

import pytest

DRIVERS = ("sqlalchemy", "psycopg", "pymysql", "pymongo", "bson", "sqlite3")
EXTRAS = ("opentelemetry", "django", "celery", "kombu")
"""Optional packages only a module of their own loads (agent_sessions.otel, agent_sessions.contrib): never
the core, and not the command line."""


def loaded_after(statement: str) -> list[str]:
    code = (
        f"import sys; {statement}; "
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120).stdout  # an import takes a second; a bound, not a budget
    return out.split()


def test_importing_the_core_loads_no_driver() -> None:
    loaded = loaded_after("import agent_sessions, agent_sessions.endpoints, agent_sessions.run.react, "
                          "agent_sessions.cli, agent_sessions.contrib")
    assert "agent_sessions" in loaded
    assert [m for m in (*DRIVERS, *EXTRAS) if m in loaded] == []


def test_importing_storetest_loads_no_store_and_no_driver() -> None:
    loaded = loaded_after("import storetest")
    assert "stores" not in loaded
    assert [m for m in (*DRIVERS, *EXTRAS) if m in loaded] == []


def test_tracing_loads_opentelemetry_and_without_it_says_which_extra_to_install() -> None:
    assert "opentelemetry" in loaded_after("import agent_sessions.otel")
    code = ("import sys; sys.modules['opentelemetry'] = None\n"
            "try:\n    import agent_sessions.otel\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    assert f"pip install '{DIST}[otel]'" in out


DIST = "stored-agent-sessions"  # the name on the index; `agent-sessions` there is an unrelated project


@pytest.mark.parametrize(("store", "driver", "extra"), [
    ("sqlite", "sqlalchemy", "sqlite"),
    ("postgres", "sqlalchemy", "postgres"),
    ("mysql", "sqlalchemy", "mysql"),
    ("mongodb", "pymongo", "mongodb"),
])
def test_a_missing_driver_says_which_extra_to_install(store: str, driver: str, extra: str) -> None:
    # Hide the driver, as a venv without the extra would.
    code = (
        f"import sys; sys.modules[{driver!r}] = None\n"
        f"try:\n    import stores.{store}\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    assert f"pip install '{DIST}[{extra}]'" in out


@pytest.mark.parametrize("tool", ["pytest", "hypothesis"])
def test_storetest_without_its_extra_says_which_to_install(tool: str) -> None:
    code = (
        f"import sys; sys.modules[{tool!r}] = None\n"
        "try:\n    import storetest\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    assert f"pip install '{DIST}[storetest]'" in out
