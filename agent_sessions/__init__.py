"""agent-sessions: an agent loop whose state can live outside the process, so a run can be steered from
any process and resumed on any worker. Importing it loads no database driver."""

import logging

from . import approvals, contract, endpoints, eventlog, events, lifecycle, shadowing, validate
from .contract import (
    ApprovalStore,
    CancelWatch,
    CancelWatcher,
    EventStore,
    LifecycleStore,
    QueueStore,
    RunSession,
    RunStore,
    Session,
    SteerKeyStore,
    Store,
    TailStore,
)
from .endpoints import Endpoint
from .errors import (
    AgentError,
    AlreadyDecided,
    ArgumentError,
    AwaitingApproval,
    BadStoreURL,
    Conflict,
    ContextOverflow,
    EndpointError,
    LeaseLost,
    MessageError,
    OutcomeUnknown,
    RunFinished,
    SchemaMismatch,
    SessionBusy,
    SessionExists,
    SessionLocked,
    StillQueued,
    StoreError,
    StoresShadowed,
    ToolError,
    TranscriptConflict,
    TranscriptDeleted,
    UnknownApproval,
    Unsupported,
)
from .messages import Content, ContentType, Message, Role, Tail, orphaned_tool_calls
from .result import Result, StopReason
from .run.runner import Run, Runner
from .session import StoreSession, open
from .spec import Pattern, Spec
from .stranded import Recovered, recover
from .tools import Tool, tool
from .values import Decision, Holder, PendingApproval, Saved, SessionInfo, SessionPage, StoredEvent

__version__ = "0.1.0"

logging.getLogger(__name__).addHandler(logging.NullHandler())  # silent unless the application configures logging
shadowing.install_finder()  # a store import under a project's own `stores` says so (shadowing.py)

__all__ = [
    "AgentError",
    "AlreadyDecided",
    "ApprovalStore",
    "ArgumentError",
    "AwaitingApproval",
    "BadStoreURL",
    "CancelWatch",
    "CancelWatcher",
    "Conflict",
    "Content",
    "ContentType",
    "ContextOverflow",
    "Decision",
    "Endpoint",
    "EndpointError",
    "EventStore",
    "Holder",
    "LeaseLost",
    "LifecycleStore",
    "Message",
    "MessageError",
    "OutcomeUnknown",
    "Pattern",
    "PendingApproval",
    "QueueStore",
    "Recovered",
    "Result",
    "Role",
    "Run",
    "RunFinished",
    "RunSession",
    "RunStore",
    "Runner",
    "Saved",
    "SchemaMismatch",
    "Session",
    "SessionBusy",
    "SessionExists",
    "SessionInfo",
    "SessionLocked",
    "SessionPage",
    "Spec",
    "SteerKeyStore",
    "StillQueued",
    "StopReason",
    "Store",
    "StoreError",
    "StoreSession",
    "StoredEvent",
    "StoresShadowed",
    "Tail",
    "TailStore",
    "Tool",
    "ToolError",
    "TranscriptConflict",
    "TranscriptDeleted",
    "UnknownApproval",
    "Unsupported",
    "approvals",
    "contract",
    "endpoints",
    "eventlog",
    "events",
    "lifecycle",
    "open",
    "orphaned_tool_calls",
    "recover",
    "tool",
    "validate",
]
