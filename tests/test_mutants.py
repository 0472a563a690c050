"""Every hand-made mutant (tests/mutants.py) still applies to the code as it is: a change to the code a
mutant patches makes this fail, so the mutant is brought along rather than silently dropped."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import mutants


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.name)
def test_the_mutant_applies_exactly_once_and_compiles(mutant: mutants.Mutant, tmp_path: Path) -> None:
    for edit in mutant.edits:
        target = tmp_path / edit.path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text((mutants.ROOT / edit.path).read_text())
    mutants.apply(mutant, tmp_path)


def test_mutant_names_are_unique() -> None:
    names = [m.name for m in mutants.MUTANTS]
    assert len(names) == len(set(names))
