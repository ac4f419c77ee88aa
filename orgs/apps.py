from django.apps import AppConfig
from django.db import transaction
from django.db.models.signals import post_delete, post_save


class OrgsConfig(AppConfig):
    name = "orgs"
    verbose_name = "Organizations and keys"

    def ready(self) -> None:
        from . import admission, keycache
        from .models import APIKey, Limit, Organization

        # A key's last use is written with a queryset update that sends no signal, so every save here is a
        # change to who may use a key: remembered keys are forgotten once it is committed.
        def changed(sender: object, **kwargs: object) -> None:
            keycache.bump_on_commit()

        for model in (APIKey, Organization):
            post_save.connect(changed, sender=model, weak=False, dispatch_uid=f"keycache-{model.__name__}-save")
            post_delete.connect(changed, sender=model, weak=False, dispatch_uid=f"keycache-{model.__name__}-delete")

        # A changed limit applies from the next request this process admits, not once its cached copy ages out
        # (embedded mode: the admin runs in the serving process). Other processes read it within
        # ``LIMITS_CACHE_SECONDS``.
        def limit_changed(sender: object, instance: Limit, **kwargs: object) -> None:
            transaction.on_commit(lambda: admission.limits_changed(instance.organization_id))

        post_save.connect(limit_changed, sender=Limit, weak=False, dispatch_uid="limits-cache-Limit-save")
        post_delete.connect(limit_changed, sender=Limit, weak=False, dispatch_uid="limits-cache-Limit-delete")
