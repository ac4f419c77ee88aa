from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model

from core.commands import OperatorCommand
from orgs.exceptions import InvalidAPIKey
from orgs.models import Organization
from orgs.services import authenticate_key, create_api_key, create_organization

DEMO_ORG = "demo"


def _remembered(path: Path) -> str | None:
    return path.read_text().strip() if path.exists() else None


def _remember(path: Path, value: str) -> None:
    path.write_text(value + "\n")
    path.chmod(0o600)


class Command(OperatorCommand):
    help = (
        "Make sure the demo organization, a working demo key and an admin login exist, and print them. "
        "For local use: the demo key and admin password are kept in var/ so that each run prints the same ones."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        org, _ = create_organization(slug=DEMO_ORG, name="Demo organization")
        if not org.active:
            Organization.objects.filter(pk=org.pk).update(active=True)
        key_file = settings.VAR_DIR / "demo-api-key"
        key = _remembered(key_file)
        try:
            if key is None:
                raise InvalidAPIKey("none yet")
            authenticate_key(raw_key=key)
        except InvalidAPIKey:
            key = create_api_key(organization=org, name="demo")
            _remember(key_file, key)

        password_file = settings.VAR_DIR / "admin-password"
        user_model = get_user_model()
        password = _remembered(password_file)
        user = user_model.objects.filter(username="admin").first()
        if user is None or password is None or not user.check_password(password):
            password = secrets.token_urlsafe(12)
            if user is None:
                user_model.objects.create_superuser("admin", "admin@localhost", password)
            else:
                user.set_password(password)
                user.is_staff = user.is_superuser = user.is_active = True
                user.save()
            _remember(password_file, password)

        self.stdout.write(f"Demo organization: {org.slug}")
        self.stdout.write(f"Demo API key:      {key}")
        self.stdout.write(f"Admin login:       admin / {password}")
