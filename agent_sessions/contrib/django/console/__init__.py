"""The operator's console in the Django admin (docs/django.md): pages (``views``) over what the library's
public API reads (``reading``), and actions (``actions``), each a POST behind its own permission and
recorded in the admin's ``LogEntry``. Through the public API alone, so it works on any store; nothing it
reads grows with the store's size (a page of the indexed listing, a transcript page read from its end).
"""
