"""What the commands say when a value is one the admin's forms would refuse."""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError


def refused(error: ValidationError) -> CommandError:
    """The error as one line naming each field, e.g. ``name: Ensure this value has at most 200 characters``."""
    if hasattr(error, "error_dict"):
        return CommandError(
            "; ".join(f"{field}: {' '.join(messages)}" for field, messages in error.message_dict.items())
        )
    return CommandError(" ".join(error.messages))
