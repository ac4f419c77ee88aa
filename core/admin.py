"""The admin's base for every model admin of the project, and Django's own user and group admins on it."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.auth import admin as auth_admin
from django.contrib.auth.models import Group, User
from django.http import HttpRequest


class ReadableFilters:
    """A change list whose query string filters on what the database cannot hold (a year past 9999:
    ``?created__year=99999``) is refused as any wrong filter is (the list again, with Django's note), not a 500:
    such a filter fails only when the list is read, past the checks Django makes of filters."""

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        try:
            return super().get_changelist_instance(request)  # type: ignore[misc]
        except (ValueError, OverflowError) as exc:
            raise IncorrectLookupParameters(exc) from exc


class ModelAdmin(ReadableFilters, admin.ModelAdmin):
    pass


class UserAdmin(ReadableFilters, auth_admin.UserAdmin):
    pass


class GroupAdmin(ReadableFilters, auth_admin.GroupAdmin):
    pass


def register_auth_admins() -> None:
    """Django's user and group admins, their lists filtered as the project's are."""
    for model, model_admin in ((User, UserAdmin), (Group, GroupAdmin)):
        if admin.site.is_registered(model):
            admin.site.unregister(model)
        admin.site.register(model, model_admin)
