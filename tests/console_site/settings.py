"""A Django project with the admin and the operator's console on PostgreSQL (CONSOLE_DB_URL names the
database; SQLite in CONSOLE_STATE otherwise): what tests/test_console.py serves with `runserver`."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

STATE = Path(os.environ.get("CONSOLE_STATE", Path(__file__).resolve().parent))
SECRET_KEY = "console-tests-only-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "agent_sessions.contrib.django",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
ROOT_URLCONF = "tests.console_site.urls"
TEMPLATES = [{
    "BACKEND": "django.template.backends.django.DjangoTemplates",
    "DIRS": [],
    "APP_DIRS": True,
    "OPTIONS": {"context_processors": [
        "django.template.context_processors.request",
        "django.contrib.auth.context_processors.auth",
        "django.contrib.messages.context_processors.messages",
    ]},
}]
STATIC_URL = "/static/"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
# A page the browser keeps open follows the log through one response at a time; short ones keep the
# server's threads free between the tests.
AGENT_SESSIONS = {"DATABASE": "default", "RESOLVE": "tests.console_site.agent.resolve", "SSE_SECONDS": 10}

_url = urlparse(os.environ.get("CONSOLE_DB_URL", ""))
if _url.scheme.startswith("postgres"):
    DATABASES = {"default": {"ENGINE": "django.db.backends.postgresql", "NAME": _url.path.lstrip("/"),
                             "USER": _url.username or "", "PASSWORD": _url.password or "",
                             "HOST": _url.hostname or "", "PORT": str(_url.port or "")}}
else:
    DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": str(STATE / "console.sqlite3")}}
