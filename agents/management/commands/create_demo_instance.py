from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import transaction

from agents.models import AgentInstance, Document, FirstStep, Guardrail, MatchKind, Stage
from core.commands import OperatorCommand
from inference.models import CatalogEntry
from orgs.models import Organization

DEMO_ID = "support.agent.spare-parts"
DEMO_MODEL = "b3os/smollm2-135m-instruct"
INSTRUCTIONS = (
    "You are the spare-parts assistant of a machine maker. Answer in one or two sentences, "
    "using the search results you are given."
)
DOCUMENTS = [
    (
        "Machine 4711: compatible spare parts",
        "https://docs.example.com/machines/4711/spare-parts",
        "Machine 4711 takes the A-104 Support Bracket, the B-220 Drive Belt and the C-31 Filter Cartridge. "
        "The A-104 replaces the older A-100 bracket; order both side brackets together.",
    ),
    (
        "Replacing the B-220 drive belt",
        "https://docs.example.com/parts/b-220/replacement",
        "Switch machine 4711 off and unplug it. Open the rear cover, slide the old belt off the pulleys and fit "
        "the new B-220 drive belt with the arrow pointing in the running direction. Replace it every 2000 hours.",
    ),
    (
        "C-31 filter cartridge: service intervals",
        "https://docs.example.com/parts/c-31/service",
        "The C-31 filter cartridge of machine 4711 is changed every 500 operating hours, or sooner when the "
        "pressure warning light turns on. Used cartridges go to general waste.",
    ),
]
GUARDRAIL = {
    "name": "No payment or account secrets",
    "applies_to": Stage.BOTH,
    "kind": MatchKind.TERMS,
    # Terms match whole words: each plural is a term of its own.
    "patterns": "password\npasswords\ncredit card\ncredit cards\ncard number\ncard numbers",
    "refusal": "I can't help with passwords or payment details. Please contact our support team directly.",
}


class Command(OperatorCommand):
    help = (
        "Create or update the demo agent instance (a few documents, the knowledge-search tool, one guardrail), "
        "let the organization use it, and print its id alone on stdout."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("org_slug", help="The organization (tenant) that may use the instance")
        parser.add_argument("--id", default=DEMO_ID, help=f"The instance id (default {DEMO_ID})")
        parser.add_argument("--model", default=DEMO_MODEL, help=f"The catalog model it runs on (default {DEMO_MODEL})")

    @transaction.atomic
    def handle(self, *args: Any, org_slug: str, id: str, model: str, **options: Any) -> None:
        organization = Organization.objects.filter(slug=org_slug).first()
        if organization is None:
            raise CommandError(f"No organization {org_slug!r}. Create it with: manage.py create_org {org_slug}")
        entry = CatalogEntry.objects.filter(public_id=model).first()
        if entry is None:
            raise CommandError(f"No catalog model {model!r}.")
        instance, created = AgentInstance.objects.update_or_create(
            instance_id=id,
            defaults={
                "name": "Spare parts assistant (demo)",
                "model": entry,
                "instructions": INSTRUCTIONS,
                "tools": ["knowledge_search"],
                # The demo model is tiny: searching first makes every answer grounded and cited.
                "first_step": FirstStep.SEARCH,
                "reasons": False,
                # SmolLM2-135M rambles when it samples: greedy, and bounded.
                "temperature": 0.0,
                "max_output_tokens": 160,
                "enabled": True,
            },
        )
        instance.full_clean()
        instance.organizations.add(organization)
        for title, url, text in DOCUMENTS:
            Document.objects.update_or_create(instance=instance, url=url, defaults={"title": title, "text": text})
        Guardrail.objects.update_or_create(instance=instance, name=GUARDRAIL["name"], defaults=GUARDRAIL)
        self.stderr.write(f"{'Created' if created else 'Updated'}: agent instance {instance} for {organization}")
        self.stdout.write(instance.instance_id)
