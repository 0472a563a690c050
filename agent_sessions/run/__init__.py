"""The run: the layer that drives one agent run over the contract and its capabilities.

- ``runner``: ``Runner`` starts runs (``run``, ``turn``, ``start``); ``Run`` is the handle of one in flight.
- ``react``: the ReAct loop itself (``Spec.pattern``).
- ``persistence``: how a run keeps its transcript (not at all, a plain session, a leased and fenced one),
  chosen once per run.
- ``publisher``: a run's events to its session's log (``Spec(publish_events=True)``).
- ``steerbox``: the in-memory steer box a ``Run`` owns.
- ``turns``: a turn that is safe to repeat (``Runner.turn``).

Nothing below this layer imports it; ``session`` (``StoreSession``, ``open``) and the applications sit
above it. Its public names are importable from ``agent_sessions``.
"""
