"""Integrations of agent-sessions with frameworks, on top of the core and the stores. ``import
agent_sessions`` imports none of them; install a subpackage's extra before using it (``django`` with a
store's, ``celery`` with the broker's).
"""
