"""The admin's base for every model admin of the project."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.http import HttpRequest


class ModelAdmin(admin.ModelAdmin):
    """A change list whose query string filters on what the database cannot hold (a year past 9999:
    ``?created__year=99999``) is refused as any wrong filter is (the list again, with Django's note), not a 500:
    such a filter fails only when the list is read, past the checks Django makes of filters."""

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        try:
            return super().get_changelist_instance(request)
        except (ValueError, OverflowError) as exc:
            raise IncorrectLookupParameters(exc) from exc
