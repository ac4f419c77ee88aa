from django.apps import AppConfig


class AgentsConfig(AppConfig):
    name = "agents"
    verbose_name = "Agent runtime"

    def ready(self) -> None:
        from .tools import knowledge  # noqa: F401  (registers the built-in server tools)
