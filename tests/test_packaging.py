"""What a user of the index gets: the sdist and the wheel built as a release would build them, the wheel
installed with no extra into a fresh venv, and scripts/example on a fresh copy of the tree.

pip installs nothing from the network here: one `pip download`, pinned to the versions in this venv (so its
files come from pip's cache; only the index pages may be fetched), fills a wheelhouse, and every install
after it runs with --no-index from that wheelhouse and no pip configuration."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sqlite3
import subprocess
import sys
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DIST = "stored-agent-sessions"
PACKAGES = ("agent_sessions", "stores", "storetest")
DRIVERS = ("sqlalchemy", "psycopg", "pymysql", "pymongo", "bson", "sqlite3", "opentelemetry")
# What the tree holds that is not source: venvs, build output, caches, databases.
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", ".venv-*", ".tox", "build", "dist", "*.egg-info", "__pycache__",
                                    ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis", "*.db", "*.db-*",
                                    "results")


def run(cmd: list[str], *, timeout: float, cwd: Path | None = None,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    if out.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {out.returncode}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}")
    return out


def offline_env(wheelhouse: Path) -> dict[str, str]:
    """No pip configuration of this machine, no index: only the wheelhouse."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheelhouse),
               PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


def package_files(tree: Path) -> set[str]:
    return {p.relative_to(tree).as_posix() for pkg in PACKAGES for p in (tree / pkg).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tree as a clean checkout has it (a build in the working tree would read its stale egg-info)."""
    tree = tmp_path_factory.mktemp("source") / "tree"
    shutil.copytree(ROOT, tree, ignore=NOT_SOURCE)
    return tree


@pytest.fixture(scope="module")
def dist(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python -m build`: the sdist, then the wheel built from the unpacked sdist (so the sdist is enough to
    build it). Without isolation, on this venv's setuptools, so no index is needed."""
    out = tmp_path_factory.mktemp("dist")
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)], timeout=300)
    return out


@pytest.fixture(scope="module")
def wheel(dist: Path) -> Path:
    [built] = dist.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def sdist(dist: Path) -> Path:
    [built] = dist.glob("*.tar.gz")
    return built


@pytest.fixture(scope="module")
def wheelhouse(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel's dependencies with its sqlite extra, and setuptools for an editable build, at exactly the
    versions installed in this venv."""
    house = tmp_path_factory.mktemp("wheelhouse")
    frozen = run([sys.executable, "-m", "pip", "freeze", "--all", "--exclude-editable"], timeout=120).stdout
    pins = [line for line in frozen.splitlines() if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==\S+", line)]
    constraints = house / "constraints.txt"
    constraints.write_text("\n".join(pins) + "\n")
    run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--only-binary", ":all:",
         "--dest", str(house), "--constraint", str(constraints), f"{wheel}[sqlite]", "setuptools"], timeout=300)
    return house


@pytest.fixture(scope="module")
def venv(wheel: Path, wheelhouse: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv, without pip, holding the wheel with no extra: its python."""
    home = tmp_path_factory.mktemp("venv") / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(home)], timeout=120)
    python = home / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", str(python), "install", str(wheel)], timeout=300,
        env=offline_env(wheelhouse))
    return python


def in_venv(python: Path, code: str) -> str:
    """Run code in the venv in isolated mode (-I): neither this tree nor PYTHONPATH is on its path."""
    return run([str(python), "-I", "-c", code], timeout=120, cwd=python.parent).stdout


def import_error(python: Path, module: str) -> str:
    return in_venv(python, f"try:\n    import {module}\nexcept ImportError as e:\n    print(e)\n"
                           "else:\n    print('imported')")


def test_the_wheel_is_the_three_typed_packages_under_the_new_name(wheel: Path, source: Path) -> None:
    assert wheel.name.startswith("stored_agent_sessions-")
    names = set(zipfile.ZipFile(wheel).namelist())
    info = {n.split("/")[0] for n in names} - set(PACKAGES)
    assert len(info) == 1 and info.pop().endswith(".dist-info"), sorted({n.split("/")[0] for n in names})
    assert {n for n in names if n.split("/")[0] in PACKAGES} == package_files(source)
    for pkg in PACKAGES:
        assert f"{pkg}/py.typed" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)

    [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
    fields = zipfile.ZipFile(wheel).read(metadata).decode().split("\n\n", 1)[0].splitlines()
    assert f"Name: {DIST}" in fields
    assert "License: MIT" in fields and "License-File: LICENSE" in fields
    # One dependency without an extra.
    assert [f for f in fields if f.startswith("Requires-Dist:") and "extra ==" not in f] == \
        ["Requires-Dist: requests>=2.31", "Requires-Dist: urllib3>=2.0"]  # the HTTP retries use urllib3 2's Retry


def test_the_sdist_is_the_library_with_license_and_changelog_and_no_tests(sdist: Path, source: Path) -> None:
    with tarfile.open(sdist) as tar:
        top, *_ = tar.getnames()
        names = {n.removeprefix(f"{top}/") for n in tar.getnames() if n != top}
        license = tar.extractfile(f"{top}/LICENSE")
        assert license is not None and license.read() == (source / "LICENSE").read_bytes()
    # The tests need examples/, scripts/ and database servers; the sdist carries none of them, nor the tests.
    assert {n.split("/")[0] for n in names} == {
        "LICENSE", "CHANGELOG.md", "README.md", "MANIFEST.in", "setup.cfg", "pyproject.toml", "PKG-INFO",
        "stored_agent_sessions.egg-info", *PACKAGES}
    assert package_files(source) <= names


def test_the_core_imports_without_any_extra_and_loads_no_driver(venv: Path) -> None:
    """Nor ``requests`` until an HTTP endpoint is first named (the CLI and a store's process never do)."""
    out = in_venv(venv, "import sys, agent_sessions, agent_sessions.endpoints, agent_sessions.cli\n"
                        "print(agent_sessions.__file__)\n"
                        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
                        "from agent_sessions.endpoints import OpenAIChat\n"
                        "print(OpenAIChat.__module__, 'requests' in sys.modules)")
    where, modules, endpoint = out.splitlines()
    assert Path(where).is_relative_to(venv.parent.parent)
    assert [m for m in DRIVERS if m in modules.split()] == [] and "requests" not in modules.split()
    assert endpoint == "agent_sessions.endpoints.openai True"


@pytest.mark.parametrize("store", ["sqlite", "postgres", "mysql", "mongodb"])
def test_a_store_without_its_extra_names_the_distribution_and_the_extra(venv: Path, store: str) -> None:
    assert f"pip install '{DIST}[{store}]'" in import_error(venv, f"stores.{store}")


def test_storetest_without_its_extra_names_it(venv: Path) -> None:
    assert f"pip install '{DIST}[storetest]'" in import_error(venv, "storetest")


def test_tracing_without_its_extra_names_it(venv: Path) -> None:
    assert f"pip install '{DIST}[otel]'" in import_error(venv, "agent_sessions.otel")


def test_the_memory_store_needs_no_extra(venv: Path) -> None:
    assert in_venv(venv, "from stores import memory; print(type(memory.Store()).__name__)").strip() == "Store"


# What `pip install -e '.[sqlite]'` may bring into a fresh venv (pip and setuptools come with it).
EXAMPLE_NEEDS = {DIST, "requests", "charset-normalizer", "idna", "urllib3", "certifi", "sqlalchemy", "greenlet",
                 "typing-extensions", "pip", "setuptools"}


def test_scripts_example_installs_only_the_sqlite_extra_and_prints_only_the_story(
        wheelhouse: Path, tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, ignore=NOT_SOURCE)
    env = offline_env(wheelhouse)

    first = run([str(tree / "scripts" / "example")], timeout=600, cwd=tree, env=env)
    assert first.stderr == "bootstrap: installing .[sqlite] into .venv-example (once)\n"
    assert first.stdout.startswith("model       a scripted OpenAI-compatible server")
    assert "steers      0 left in the store: it was handed over exactly once" in first.stdout.splitlines()

    names = run([str(tree / ".venv-example" / "bin" / "python"), "-I", "-c",
                 "import importlib.metadata as m; print('\\n'.join(d.metadata['Name'] for d in m.distributions()))"],
                timeout=120).stdout.split()
    installed = {re.sub(r"[-_.]+", "-", n).lower() for n in names}
    assert {DIST, "sqlalchemy"} <= installed
    assert installed <= EXAMPLE_NEEDS, installed - EXAMPLE_NEEDS
    assert not (tree / ".venv").exists()

    again = run([str(tree / "scripts" / "example")], timeout=300, cwd=tree, env=env)
    assert again.stderr == ""
    assert again.stdout.startswith("model       a scripted OpenAI-compatible server")


def readme_block(section: str, language: str) -> str:
    """The first ```language block under README.md's ``## section``, as the page has it."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    found = re.search(rf"^```{language}\n(.*?)^```$", text[start:end], re.MULTILINE | re.DOTALL)
    assert found, f"README.md's {section} has no ```{language} block"
    return found.group(1)


def test_the_readme_quick_start_runs_twice_in_a_fresh_venv_with_the_bundled_model_server(
        wheel: Path, wheelhouse: Path, tmp_path: Path) -> None:
    """What a new user does: install the wheel with its sqlite extra into a new venv, start the model server
    the README's quick start says to start, and run the quick start's code, twice (a quick start runs as
    often as a user runs it): both exit 0, the second carries the conversation on, and no steer is left
    waiting. The server listens on a free port rather than 8080, which another run may hold."""
    home = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(home)], timeout=120)
    python = home / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", str(python), "install", f"{wheel}[sqlite]"], timeout=300,
        env=offline_env(wheelhouse))

    [start] = [line for line in readme_block("Quick start", "sh").splitlines() if "model_server" in line]
    argv = shlex.split(start.partition("#")[0])
    assert argv[0] == "python", start
    work = tmp_path / "work"
    work.mkdir()
    server = subprocess.Popen([str(python), "-I", *argv[1:], "--port", "0"], cwd=work, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.append(server.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(60)
        assert said and said[0].startswith("listening on http://127.0.0.1:"), (said, server.poll())
        url = said[0].split()[-1]

        code = readme_block("Quick start", "python")
        assert code.count("http://127.0.0.1:8080/v1") == 1
        (work / "quickstart.py").write_text(code.replace("http://127.0.0.1:8080/v1", url))
        lengths = []
        for _ in range(2):
            ran = run([str(python), "-I", "quickstart.py"], timeout=120, cwd=work)  # fails the test unless exit 0
            assert ran.stdout.count("answered ") == 2 and ran.stderr == "", ran
            with sqlite3.connect(work / "sessions.db") as conn:
                assert conn.execute("SELECT count(*) FROM agent_steers").fetchone()[0] == 0
                lengths.append(conn.execute("SELECT count(*) FROM agent_messages").fetchone()[0])
        assert 0 < lengths[0] < lengths[1], lengths
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(10)
