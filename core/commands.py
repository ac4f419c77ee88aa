"""The base of the operators' management commands."""

from __future__ import annotations

from django.core.checks import Tags
from django.core.management.base import BaseCommand


class OperatorCommand(BaseCommand):
    """A command that works on the database and the models, not on requests: before it runs, the settings and model
    checks only. The URL and admin checks import every view and the API schema, most of a command's start-up time;
    ``check`` and ``serve`` run them."""

    requires_system_checks = [Tags.compatibility, Tags.models]
