"""Integrations of agent-sessions with frameworks, on top of the core and the stores.

Each subpackage imports its framework and the stores it builds; ``import agent_sessions`` imports none of
them (the core still loads no driver and no framework: setup.cfg's import contracts), so install a
subpackage's extra before using it: ``agent_sessions.contrib.django`` needs ``pip install
'stored-agent-sessions[django,sqlite]'`` (or ``postgres``, ``mysql``); ``agent_sessions.contrib.celery``
(the turn task, the sweep, each worker's watch) the ``celery`` extra and the broker's own.
"""
