"""agent-sessions: an agent loop whose state can live outside the process, so a run can be steered from
any process and resumed on any worker. Importing it loads no database driver."""

from . import endpoints, events, validate
from .endpoints import Endpoint
from .errors import (
    AgentError,
    ArgumentError,
    EndpointError,
    MessageError,
    RunFinished,
    StoreError,
    ToolError,
)
from .messages import Content, ContentType, Message, Role
from .runner import Result, Run, Runner, StopReason
from .session import Session, Store, StoreSession, open
from .spec import Pattern, Spec
from .tools import Tool, tool

__version__ = "0.1.0"

__all__ = [
    "AgentError",
    "ArgumentError",
    "Content",
    "ContentType",
    "Endpoint",
    "EndpointError",
    "Message",
    "MessageError",
    "Pattern",
    "Result",
    "Role",
    "Run",
    "RunFinished",
    "Runner",
    "Session",
    "Spec",
    "StopReason",
    "Store",
    "StoreError",
    "StoreSession",
    "Tool",
    "ToolError",
    "endpoints",
    "events",
    "open",
    "tool",
    "validate",
]
