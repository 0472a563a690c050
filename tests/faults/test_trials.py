"""The randomised fault trials in CI (tests/faults/trials.py): a fixed set of seeds per SQL store, each
replayable with ``python -m tests.faults.trials --store S --seed N``; more under ``scripts/soak --faults N``.
And a check that the trials' invariants do catch what they look for."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import agent_sessions as agent

from . import trials

SEEDS = list(range(25))
"""Seed 13 was intermittent while a failing run's way out could skip its release (test_failing_run_releases.py)."""


@pytest.fixture(scope="module", params=["postgres", "mysql"])
def backend(request: pytest.FixtureRequest) -> Iterator[trials.Backend]:
    b = trials.Backend(request.param)
    yield b
    b.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_a_seeded_fault_trial_keeps_every_invariant(backend: trials.Backend, seed: int) -> None:
    out = trials.trial(backend, seed)
    assert not out.violations, (f"replay: python -m tests.faults.trials --store {backend.name} --seed {seed}; "
                                f"fired {out.fired}: {out.violations}")
    assert out.checks >= 10


def test_the_checks_catch_a_doubled_steer_and_a_tool_run_twice(backend: trials.Backend) -> None:
    sid = "checked-doubled"
    backend.direct.save(sid, [agent.Message.user("question 0"), agent.Message.user("steer 0"),
                              agent.Message.user("steer 0"), agent.Message.user("question 1")])
    backend.paid[(sid, 0)] = 2
    out = trials.Outcome(0, backend.name)
    trials._check(out, backend, sid, ["steer 0"], ["question 0", "question 1"])
    assert any("'steer 0' is in the transcript 2 times" in v for v in out.violations)
    assert any("pay(0) ran 2 times" in v for v in out.violations)
