"""The operator's console: the store's sessions in the Django admin, and what an operator does to them.

Pages (``views``) over what the library's public API reads (``reading``): the sessions with their state at
a glance, one session's transcript newest first with what waits on it and its event log following live,
and the approvals inbox. Actions (``actions``), each a POST behind its own permission
(``agent_sessions.models.PERMISSIONS``) and recorded in the admin's ``LogEntry``: steer, cancel, approve
or deny a call, recover a stranded session, delete. ``agent_sessions.contrib.django.admin`` puts them on
the admin site.

It reads and writes only through ``agent_sessions`` and the store protocols of ``agent_sessions.contract``,
so it works on whichever store the app is configured with, and it reads nothing in proportion to the
store's size: the list is a page of the store's indexed listing, a transcript a page read from its end.
"""
