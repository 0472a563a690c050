"""The console's models: no table (``managed = False``, never queried), only what Django's permissions,
admin log (``LogEntry``) and admin index hang on, since the store's sessions are not ORM rows.
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
"""One per action, each checked on the server for every request that acts; ``view_session`` and
``delete_session`` are also the admin's own view and delete permissions of the model."""


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
    """The approvals inbox on the admin index; seeing it takes ``view_session``, deciding ``decide_session``."""

    id = models.CharField(primary_key=True, max_length=255)

    class Meta:
        managed = False
        default_permissions = ()
        verbose_name = "approval waiting"
        verbose_name_plural = "approvals waiting"

    def __str__(self) -> str:
        return str(self.id)
