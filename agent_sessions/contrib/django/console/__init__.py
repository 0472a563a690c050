"""The operator's console in the Django admin (docs/django.md): pages (``views``) over what the library's
public API reads (``reading``), so it works on any store, and actions (``actions``)."""
