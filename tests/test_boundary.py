"""The core loads no database driver, and storetest depends on no store."""

from __future__ import annotations

import subprocess
import sys

DRIVERS = ("sqlalchemy", "psycopg", "pymysql", "pymongo", "bson", "sqlite3")


def loaded_after(statement: str) -> list[str]:
    code = (
        f"import sys; {statement}; "
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120).stdout  # an import takes a second; a bound, not a budget
    return out.split()


def test_importing_the_core_loads_no_driver() -> None:
    loaded = loaded_after("import agent_sessions, agent_sessions.endpoints")
    assert "agent_sessions" in loaded
    assert [m for m in DRIVERS if m in loaded] == []


def test_importing_storetest_loads_no_store_and_no_driver() -> None:
    loaded = loaded_after("import storetest")
    assert "stores" not in loaded
    assert [m for m in DRIVERS if m in loaded] == []


def test_a_missing_driver_says_which_extra_to_install() -> None:
    # Hide SQLAlchemy, as a venv without the extra would.
    code = (
        "import sys; sys.modules['sqlalchemy'] = None\n"
        "try:\n    import stores.sqlite\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    assert "pip install 'agent-sessions[sqlite]'" in out
