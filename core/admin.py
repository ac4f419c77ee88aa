"""The admin's base for every model admin of the project, and Django's own user and group admins on it."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.auth import admin as auth_admin
from django.contrib.auth.models import Group, User
from django.core.exceptions import FieldDoesNotExist, ValidationError
from django.core.validators import MinValueValidator
from django.db.models import DateTimeField, Field, IntegerField, JSONField, ManyToManyField
from django.forms.fields import InvalidJSONInput
from django.http import HttpRequest
from django.utils import timezone
from django.utils.dateparse import parse_datetime


class ReadableFilters:
    """A change list whose query string filters on what the database cannot hold (a year past 9999:
    ``?created__year=99999``) is refused as any wrong filter is (the list again, with Django's note), not a 500:
    such a filter fails only when the list is read, past the checks Django makes of filters."""

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        try:
            return super().get_changelist_instance(request)  # type: ignore[misc]
        except (ValueError, OverflowError) as exc:
            raise IncorrectLookupParameters(exc) from exc


class ReadableJSONField(forms.JSONField):
    """JSON Python will not read is invalid JSON, as any other: an integer past 4,300 digits (a ``ValueError``) or
    nesting past Python's recursion limit (a ``RecursionError``, from about a thousand levels). Django's field lets
    both through, a server error when the form is checked and again when it is shown."""

    def to_python(self, value: Any) -> Any:
        try:
            return super().to_python(value)
        except (ValueError, RecursionError):
            raise ValidationError(self.error_messages["invalid"], code="invalid", params={"value": value}) from None

    def bound_data(self, data: Any, initial: Any) -> Any:
        try:
            return super().bound_data(data, initial)
        except (ValueError, RecursionError):
            return InvalidJSONInput(data)


class ReadableMultipleChoiceField(forms.ModelMultipleChoiceField):
    """An id past what the database holds is no valid choice, as any unknown id: Django's field looked it up and the
    database's driver refused it (SQLite: "Python int too large to convert"), a server error."""

    def _check_values(self, value: Any) -> Any:
        try:
            return super()._check_values(value)
        except OverflowError:
            raise ValidationError(self.error_messages["invalid_choice"], code="invalid_choice") from None


class ReadableFields:
    """Form fields that refuse what the database or Python cannot read with a field error, never a server error."""

    def formfield_for_dbfield(self, db_field: Field[Any, Any], request: HttpRequest, **kwargs: Any) -> Any:
        if isinstance(db_field, JSONField):
            kwargs.setdefault("form_class", ReadableJSONField)
        elif isinstance(db_field, ManyToManyField):
            kwargs.setdefault("form_class", ReadableMultipleChoiceField)
        return super().formfield_for_dbfield(db_field, request, **kwargs)  # type: ignore[misc]


class ReadableInitialData:
    """An add page opened with a time in its query string (``?expires_at=…``) shows that time when it reads as one,
    and an empty field when not: Django's split date and time widget takes the text as given for a time, a server
    error."""

    def get_changeform_initial_data(self, request: HttpRequest) -> dict[str, Any]:
        initial: dict[str, Any] = super().get_changeform_initial_data(request)  # type: ignore[misc]
        for name, value in list(initial.items()):
            try:
                field = self.model._meta.get_field(name)  # type: ignore[attr-defined]
            except FieldDoesNotExist:
                continue
            if isinstance(field, DateTimeField) and isinstance(value, str):
                try:
                    moment = parse_datetime(value)  # a date alone too, as midnight
                    if moment is None:
                        raise ValueError("not a time")
                    # Shown in the current time zone: a time at either end of the calendar may leave it.
                    initial[name] = timezone.localtime(
                        moment if timezone.is_aware(moment) else timezone.make_aware(moment)
                    )
                except (ValueError, OverflowError):  # not a time, or the shape of one with a 13th month
                    del initial[name]
        return initial


class ModelAdmin(ReadableInitialData, ReadableFields, ReadableFilters, admin.ModelAdmin):
    def formfield_for_dbfield(self, db_field: Field[Any, Any], request: HttpRequest, **kwargs: Any) -> Any:
        """A number's form field with the model's least value (a count of at least 1), so that a number below it is
        told that least, not the 0 of a positive integer's form field."""
        least = [v.limit_value for v in db_field.validators if isinstance(v, MinValueValidator)]
        if isinstance(db_field, IntegerField) and all(isinstance(value, int) for value in least) and least:
            kwargs.setdefault("min_value", max(least))
        return super().formfield_for_dbfield(db_field, request, **kwargs)


class UserAdmin(ReadableFields, ReadableFilters, auth_admin.UserAdmin):
    pass


class GroupAdmin(ReadableFields, ReadableFilters, auth_admin.GroupAdmin):
    pass


def register_auth_admins() -> None:
    """Django's user and group admins, their lists filtered as the project's are."""
    for model, model_admin in ((User, UserAdmin), (Group, GroupAdmin)):
        if admin.site.is_registered(model):
            admin.site.unregister(model)
        admin.site.register(model, model_admin)
