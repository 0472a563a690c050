"""The run: the layer that drives one agent run over the contract (``runner``: ``Runner`` and the handle
``Run``; ``react``: the loop; ``persistence``, ``writes``, ``calls``, ``publisher``: how a run keeps its
transcript, journal and events; ``turns``, ``busy``: a turn safe to repeat, and a message for a busy session).
Nothing below this layer imports it. Its public names are importable from ``agent_sessions``.
"""
