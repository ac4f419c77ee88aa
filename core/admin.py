"""The admin's base for every model admin of the project, and Django's own user and group admins on it."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.auth import admin as auth_admin
from django.contrib.auth.models import Group, User
from django.core.validators import MinValueValidator
from django.db.models import Field, IntegerField
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
    def formfield_for_dbfield(self, db_field: Field[Any, Any], request: HttpRequest, **kwargs: Any) -> Any:
        """A number's form field with the model's least value (a count of at least 1), so that a number below it is
        told that least, not the 0 of a positive integer's form field."""
        least = [v.limit_value for v in db_field.validators if isinstance(v, MinValueValidator)]
        if isinstance(db_field, IntegerField) and all(isinstance(value, int) for value in least) and least:
            kwargs.setdefault("min_value", max(least))
        return super().formfield_for_dbfield(db_field, request, **kwargs)


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
