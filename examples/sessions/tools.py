"""The tools the example's agent has: it may list and read the small code tree beside this file."""

from __future__ import annotations

from pathlib import Path

import agent_sessions as agent

CODEBASE = Path(__file__).parent / "codebase"


@agent.tool
def list_files() -> str:
    """List the files of the code under review."""
    return "\n".join(sorted(p.name for p in CODEBASE.iterdir() if p.is_file()))


@agent.tool
def read_file(path: str) -> str:
    """Read one file of the code under review, with line numbers.

    Args:
        path: the file's name, as list_files gives it
    """
    target = (CODEBASE / path).resolve()
    if target.parent != CODEBASE.resolve() or not target.is_file():
        raise agent.ToolError(f"no file {path!r}; list_files says what there is")
    lines = target.read_text().splitlines()
    return "\n".join(f"{i:3d}  {line}" for i, line in enumerate(lines, 1))


TOOLS = [list_files, read_file]
