"""One subpackage per backend. Each takes the connection its caller already has; none is imported by
``agent_sessions``, so the core never loads a driver."""

import logging

logging.getLogger(__name__).addHandler(logging.NullHandler())  # silent unless the application configures logging
