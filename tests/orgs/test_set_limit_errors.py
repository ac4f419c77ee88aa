"""set_limit names what it takes when a number is not one."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("value", ["-5", "abc", "1.5"])
def test_set_limit_refuses_a_limit_that_is_not_a_whole_number_and_says_what_one_is(value: str) -> None:
    with pytest.raises(CommandError, match=f"a limit is a whole number of 0 or more, or 'none', not '{value}'"):
        call_command("set_limit", "acme", f"--rpm={value}")
