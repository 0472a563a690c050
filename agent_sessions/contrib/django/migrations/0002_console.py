"""The console's two models (agent_sessions.contrib.django.models): no table is created, since they are
unmanaged; the migration is what lets Django create their content types and the console's permissions
after ``migrate``, as for any model."""

from __future__ import annotations

from django.db import migrations, models  # type: ignore[import-untyped]


class Migration(migrations.Migration):  # type: ignore[misc]
    dependencies = [("agent_sessions", "0001_initial")]
    operations = [
        migrations.CreateModel(
            name="Session",
            fields=[("id", models.CharField(max_length=255, primary_key=True, serialize=False))],
            options={
                "verbose_name": "session",
                "verbose_name_plural": "sessions",
                "permissions": (
                    ("view_session", "Can see sessions: transcripts, runs and what waits on them"),
                    ("steer_session", "Can steer a session's run"),
                    ("cancel_session", "Can cancel a session's turn"),
                    ("decide_session", "Can approve or deny a session's tool calls"),
                    ("recover_session", "Can recover a stranded session"),
                    ("delete_session", "Can delete a session"),
                ),
                "managed": False,
                "default_permissions": (),
            },
        ),
        migrations.CreateModel(
            name="Approval",
            fields=[("id", models.CharField(max_length=255, primary_key=True, serialize=False))],
            options={
                "verbose_name": "approval waiting",
                "verbose_name_plural": "approvals waiting",
                "managed": False,
                "default_permissions": (),
            },
        ),
    ]
