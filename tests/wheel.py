"""The library as a pip user gets it: the wheel built from this tree, installed with its extras into a fresh
venv, for the tests that must not see the tree (a Django project and its Celery workers, the docs' code).

Nothing comes from the network but the registry pip already uses: one ``pip download``, pinned to the
versions in this venv (pip's cache or the machine's index), fills a wheelhouse, and the install runs with
--no-index from it. Built once per test session (``tests/conftest.py``'s ``wheel_python``)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ("agent_sessions", "stores", "storetest", "setup.cfg", "pyproject.toml", "README.md", "LICENSE",
          "MANIFEST.in", "CHANGELOG.md")
EXTRAS = "django,sqlite,postgres,mysql,mongodb,celery,otel,test"
"""Every extra, and the test tools the docs' pages use (pytest, OpenTelemetry's SDK, Redis for Celery)."""


class Failed(Exception):
    pass


def run(cmd: list[str], *, timeout: float = 300, cwd: Path | None = None, env: dict[str, str] | None = None,
        code: int = 0) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    if out.returncode != code:
        raise Failed(f"{' '.join(cmd)} exited {out.returncode}, not {code}\n--- stdout\n{out.stdout[-6000:]}\n"
                     f"--- stderr\n{out.stderr[-6000:]}")
    return out


def clean_env(**extra: str) -> dict[str, str]:
    """No pip configuration, no PYTHONPATH, no settings module of this process."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV", "DJANGO_", "CELERY_"))}
    env.update(extra)
    return env


def build(base: Path, extras: str = EXTRAS) -> Path:
    """Build the wheel from a clean copy of the tree (a build in the working tree would read its stale
    egg-info) and install it with ``extras`` into a fresh venv under ``base``: that venv's python."""
    tree = base / "tree"
    tree.mkdir(parents=True)
    for name in SOURCE:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, tree / name)
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
         str(base / "dist"), str(tree)])
    [wheel] = (base / "dist").glob("stored_agent_sessions-*.whl")

    frozen = run([sys.executable, "-m", "pip", "freeze", "--all", "--exclude-editable"]).stdout
    pins = [line for line in frozen.splitlines() if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==\S+", line)]
    house = base / "wheelhouse"
    house.mkdir()
    (house / "constraints.txt").write_text("\n".join(pins) + "\n")
    run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--only-binary", ":all:",
         "--dest", str(house), "--constraint", str(house / "constraints.txt"), f"{wheel}[{extras}]"], timeout=600)

    home = base / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(home)])
    python = home / "bin" / "python"
    offline = clean_env(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(house),
                        PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", f"{wheel}[{extras}]"],
        timeout=600, env=offline)
    return python
