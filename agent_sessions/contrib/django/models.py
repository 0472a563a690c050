"""The console's models: no table, only what Django's permissions, admin log and admin index hang on.

The store's sessions are not ORM rows, yet the console needs what Django gives a model: a content type,
permissions to grant, ``LogEntry`` entries, a place on the admin index. So ``Session`` (one permission per
thing an operator may do) and ``Approval`` (the approvals inbox) are ``managed = False`` and never queried;
their migration creates nothing but the permissions.
"""

from __future__ import annotations

from django.db import models  # type: ignore[import-untyped]

PERMISSIONS = (
    ("view_session", "Can see sessions: transcripts, runs and what waits on them"),
    ("steer_session", "Can steer a session's run"),
    ("cancel_session", "Can cancel a session's turn"),
    ("decide_session", "Can approve or deny a session's tool calls"),
    ("recover_session", "Can recover a stranded session"),
    ("delete_session", "Can delete a session"),
)
"""The console's permissions, one per action, each checked on the server for every request that acts
(``agent_sessions.<codename>``). ``view_session`` is also the admin's own view permission of the model,
and ``delete_session`` its delete permission."""


class Session(models.Model):  # type: ignore[misc]
    """A session of the store, as the admin names it: never stored or queried as a row."""

    id = models.CharField(primary_key=True, max_length=255)

    class Meta:
        managed = False
        default_permissions = ()
        permissions = PERMISSIONS
        verbose_name = "session"
        verbose_name_plural = "sessions"

    def __str__(self) -> str:
        return str(self.id)


class Approval(models.Model):  # type: ignore[misc]
    """The approvals inbox on the admin index: every call waiting for a decision. No table, no permission
    of its own: seeing it takes ``view_session``, deciding ``decide_session``."""

    id = models.CharField(primary_key=True, max_length=255)

    class Meta:
        managed = False
        default_permissions = ()
        verbose_name = "approval waiting"
        verbose_name_plural = "approvals waiting"

    def __str__(self) -> str:
        return str(self.id)
