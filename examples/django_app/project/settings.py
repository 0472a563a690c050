"""Settings of the example project. The app agent_sessions.contrib.django builds the session store from
DATABASES below: SQLite by default, or PostgreSQL / MySQL when DJANGO_DB_URL names one (postgresql://...
or mysql://...); `manage.py migrate` creates its tables."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

BASE = Path(os.environ.get("DJANGO_APP_STATE", Path(__file__).resolve().parent.parent))
SECRET_KEY = "example-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
INSTALLED_APPS = ["agent_sessions.contrib.django", "examples.django_app.turns"]
AGENT_SESSIONS = {"DATABASE": "default"}  # the DATABASES alias holding the store's tables (the default)
ROOT_URLCONF = "examples.django_app.project.urls"
MIDDLEWARE: list[str] = []
USE_TZ = True

_url = urlparse(os.environ.get("DJANGO_DB_URL", ""))
if _url.scheme.startswith("postgres"):
    DATABASES = {"default": {"ENGINE": "django.db.backends.postgresql", "NAME": _url.path.lstrip("/"),
                             "USER": _url.username or "", "PASSWORD": _url.password or "",
                             "HOST": _url.hostname or "", "PORT": str(_url.port or "")}}
elif _url.scheme.startswith("mysql"):
    import pymysql  # Django's MySQL backend is written for mysqlclient; PyMySQL stands in for it here

    pymysql.install_as_MySQLdb()
    DATABASES = {"default": {"ENGINE": "django.db.backends.mysql", "NAME": _url.path.lstrip("/"),
                             "USER": _url.username or "", "PASSWORD": _url.password or "",
                             "HOST": _url.hostname or "", "PORT": str(_url.port or "")}}
else:
    DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(BASE / "django.sqlite3")}}

AGENT_MODEL_URL = os.environ.get("AGENT_MODEL_URL", "http://127.0.0.1:8080/v1")
AGENT_MODEL = os.environ.get("AGENT_MODEL", "local")
