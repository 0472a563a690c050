from django.urls import include, path

from examples.django_app.turns import views

urlpatterns = [
    path("sessions/<str:session_id>/turn", views.turn),
    path("sessions/<str:session_id>", views.transcript),
    # GET /sessions/<id>/events: the session's events as server-sent events (the app's view). This example
    # has no users; a real project includes it behind its own authorization (docs/django.md).
    path("", include("agent_sessions.contrib.django.urls")),
]
