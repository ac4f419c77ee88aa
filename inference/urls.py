from django.urls import path

from inference.api import views as api

urlpatterns = [
    path("models", api.ModelListView.as_view()),
    path("models/<path:model_id>", api.ModelDetailView.as_view()),
    path("chat/completions", api.ChatCompletionsView.as_view()),
    path("chat/completions/<path:completion_id>", api.StoredChatCompletionView.as_view()),
    path("responses", api.ResponsesView.as_view()),
    path("responses/input_tokens", api.ResponseInputTokensView.as_view()),
    path("responses/<path:response_id>", api.StoredResponseView.as_view()),
    path("usage", api.UsageView.as_view()),
]
