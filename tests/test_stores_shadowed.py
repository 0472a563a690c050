"""A project with a package of its own named ``stores`` (a shop's app), first on the path: the CLI, the
Django app's system check and an import of a store module each say that a foreign ``stores`` hides the
library's, naming its file, instead of advising an extra that is installed (issue 28, item 2). Each runs
in a process of its own, as a user's would, from the project's directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = """\
SECRET_KEY = "test-only"
INSTALLED_APPS = ["agent_sessions.contrib.django", "stores"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "db.sqlite3"}}
USE_TZ = True
"""


def run(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "DJANGO_", "AGENT_SESSIONS_STORE"))}
    env["PYTHONPATH"] = str(project)  # first on the path, as a project's directory is under manage.py
    return subprocess.run([sys.executable, *args], cwd=project, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(params=["shop", "plain"])
def project(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, Path | None]:
    """A project directory with a Django settings module; with ``shop``, also its own ``stores`` package."""
    (tmp_path / "site_settings.py").write_text(SETTINGS if request.param == "shop" else
                                               SETTINGS.replace(', "stores"', ""))
    if request.param == "plain":
        return tmp_path, None
    (tmp_path / "stores").mkdir()
    (tmp_path / "stores" / "__init__.py").write_text('"""The shop\'s stores: a Django app."""\n')
    return tmp_path, tmp_path / "stores" / "__init__.py"


def test_the_cli_names_the_foreign_stores_instead_of_an_extra(project: tuple[Path, Path | None]) -> None:
    home, foreign = project
    out = run(home, "-m", "agent_sessions", "--store", str(home / "none.db"), "list")
    if foreign is None:
        assert out.returncode == 4 and "no SQLite store" in out.stderr, out.stderr  # got as far as the file
        return
    assert out.returncode == 3, out.stderr
    assert f"the package 'stores' that Python imports is {foreign}" in out.stderr
    assert str(ROOT / "stores" / "__init__.py") in out.stderr and "rename the project's package" in out.stderr
    assert "pip install" not in out.stderr and "Traceback" not in out.stderr


def test_the_django_app_reports_it_as_a_system_check_error(project: tuple[Path, Path | None]) -> None:
    home, foreign = project
    out = run(home, "-m", "django", "check", "--settings", "site_settings")
    if foreign is None:
        assert out.returncode == 0 and "no issues" in out.stdout, out.stderr
        return
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"(agent_sessions.E001) a package named 'stores' ({foreign}) hides agent-sessions' stores" in out.stderr
    assert "HINT: Rename the project's 'stores' package" in out.stderr


@pytest.mark.parametrize("module", ["memory", "redis", "urls"])
def test_importing_a_store_module_raises_the_librarys_error(project: tuple[Path, Path | None], module: str) -> None:
    """Every module the library's ``stores`` ships, whichever it is: the finder reads them from its directory."""
    home, foreign = project
    code = ("import agent_sessions\n"
            f"try:\n    from stores import {module} as found\n"
            "except agent_sessions.StoresShadowed as e:\n    print('shadowed', e.found)\n"
            "else:\n    print('imported', found.__file__)\n")
    out = run(home, "-c", code)
    assert out.returncode == 0, out.stderr
    if foreign is None:
        shipped = ROOT / "stores" / module / "__init__.py"
        assert out.stdout == f"imported {shipped if shipped.is_file() else ROOT / 'stores' / f'{module}.py'}\n"
    else:
        assert out.stdout == f"shadowed {foreign}\n"


def test_the_django_command_exits_as_the_cli_does(project: tuple[Path, Path | None]) -> None:
    """``manage.py agent_sessions`` is the CLI on the app's store: a foreign ``stores`` is its exit 3 too, with
    the same words, not "unexpected StoresShadowed" (exit 4)."""
    home, foreign = project
    out = run(home, "-m", "django", "agent_sessions", "list", "--settings", "site_settings")
    if foreign is None:
        assert (out.returncode, out.stdout) == (0, "no sessions\n"), out.stderr
        return
    assert out.returncode == 3, out.stderr
    assert f"the package 'stores' that Python imports is {foreign}" in out.stderr
    assert "unexpected" not in out.stderr and "Traceback" not in out.stderr
