from django.urls import path

from . import api

urlpatterns = [
    path("responses", api.ResponsesView.as_view()),
    path("responses/<path:response_id>", api.StoredResponseView.as_view()),
    path("instances", api.InstancesView.as_view()),
    path("feedback", api.FeedbackView.as_view()),
]
