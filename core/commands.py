"""The base of the operators' management commands."""

from __future__ import annotations

from django.core.checks import Tags
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError


class OperatorCommand(BaseCommand):
    """A command that works on the database and the models, not on requests: before it runs, the settings and model
    checks only. The URL and admin checks import every view and the API schema, most of a command's start-up time;
    ``check`` and ``serve`` run them."""

    requires_system_checks = [Tags.compatibility, Tags.models]


def refused(error: ValidationError, *, about: str = "") -> CommandError:
    """A value the admin's forms would refuse, as one line naming each field (``name: Ensure this value has at most
    200 characters``), after ``about`` (what was refused) when given."""
    if hasattr(error, "error_dict"):
        said = "; ".join(f"{field}: {' '.join(messages)}" for field, messages in error.message_dict.items())
    else:
        said = " ".join(error.messages)
    return CommandError(f"{about}: {said}" if about else said)
