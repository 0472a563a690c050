"""One subpackage per backend. Each takes the connection its caller already has; none is imported by
``agent_sessions``, so the core never loads a driver."""
