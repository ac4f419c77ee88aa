from django.apps import AppConfig
from django.db.models.signals import post_delete, post_save


class OrgsConfig(AppConfig):
    name = "orgs"
    verbose_name = "Organizations and keys"

    def ready(self) -> None:
        from . import keycache
        from .models import APIKey, Organization

        # A key's last use is written with a queryset update that sends no signal, so every save here is a
        # change to who may use a key.
        def changed(sender: object, **kwargs: object) -> None:
            keycache.bump()

        for model in (APIKey, Organization):
            post_save.connect(changed, sender=model, weak=False, dispatch_uid=f"keycache-{model.__name__}-save")
            post_delete.connect(changed, sender=model, weak=False, dispatch_uid=f"keycache-{model.__name__}-delete")
