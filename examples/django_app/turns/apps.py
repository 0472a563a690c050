from django.apps import AppConfig


class TurnsConfig(AppConfig):
    name = "examples.django_app.turns"
    default_auto_field = "django.db.models.AutoField"
