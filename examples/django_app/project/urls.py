from django.urls import path

from examples.django_app.turns import views

urlpatterns = [
    path("sessions/<str:session_id>/turn", views.turn),
    path("sessions/<str:session_id>", views.transcript),
]
