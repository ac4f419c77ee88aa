"""The demo instance command, the prune command, and what operators see and edit in the admin."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from io import StringIO

import pytest
from asgiref.sync import sync_to_async
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client

from agents.admin import DocumentForm
from agents.guardrails import Guardrails
from agents.models import AgentInstance, Feedback, FirstStep, Guardrail, StoredResponse
from inference.models import CatalogEntry
from orgs.models import Organization
from tests.conftest import ROOT
from tests.inference.test_catalog_admin import form_data

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.database]


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out, stderr=StringIO())
    return out.getvalue()


@pytest.mark.parametrize("command", ["create_demo_instance", "prune_agent_responses"])
def test_each_command_explains_itself_with_help(command: str) -> None:
    result = subprocess.run([sys.executable, "manage.py", command, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and "usage:" in result.stdout


def test_create_demo_instance_prints_the_id_alone_and_updates_rather_than_duplicates(
    organization: Organization, catalog_model: CatalogEntry
) -> None:
    assert run("create_demo_instance", "acme") == "support.agent.spare-parts\n"
    Organization.objects.create(slug="globex", name="Globex")
    assert run("create_demo_instance", "globex") == "support.agent.spare-parts\n"

    instance = AgentInstance.objects.get()
    assert sorted(instance.organizations.values_list("slug", flat=True)) == ["acme", "globex"]
    assert (instance.tools, instance.first_step, instance.model) == (
        ["knowledge_search"],
        FirstStep.SEARCH,
        catalog_model,
    )
    assert instance.documents.count() == 3 and instance.guardrails.count() == 1


@pytest.mark.parametrize("question", ["What is my password?", "Where are my passwords?", "Keep my credit cards."])
async def test_the_demo_guardrail_refuses_its_terms_singular_or_plural(
    organization: Organization, catalog_model: CatalogEntry, question: str
) -> None:
    await sync_to_async(run)("create_demo_instance", "acme")
    instance = await AgentInstance.objects.aget()
    guardrails = await sync_to_async(lambda: Guardrails.of(instance.guardrails.all()))()

    assert await guardrails.check_input([question]) is not None
    assert await guardrails.check_input(["Which parts fit machine 4711?"]) is None


def test_create_demo_instance_refuses_an_unknown_organization(catalog_model: CatalogEntry) -> None:
    with pytest.raises(CommandError, match="No organization"):
        run("create_demo_instance", "nobody")


def test_prune_agent_responses_reports_what_it_deleted(transactional_db: None) -> None:
    assert run("prune_agent_responses").startswith("0 stored response(s) deleted")


# --- the admin -------------------------------------------------------------------------------------------


@pytest.fixture
def staff(admin_client: Client) -> Client:
    return admin_client


def test_an_instance_is_edited_with_its_tools_documents_and_guardrails(
    staff: Client, make_instance: Callable[..., AgentInstance]
) -> None:
    instance = make_instance("acme.agent", documents=True)

    page = staff.get(f"/admin/agents/agentinstance/{instance.pk}/change/")

    assert page.status_code == 200
    html = page.content.decode()
    assert 'value="knowledge_search"' in html and "Machine 4711: compatible spare parts" in html
    assert "guardrails-TOTAL_FORMS" in html and "documents-TOTAL_FORMS" in html
    assert staff.get("/admin/agents/agentinstance/").status_code == 200


def test_disabling_the_model_of_an_instance_warns_that_the_instances_requests_get_503(
    staff: Client, make_instance: Callable[..., AgentInstance]
) -> None:
    instance = make_instance("acme.agent")
    entry = instance.model
    data = {key: value for key, value in form_data(entry).items() if key != "enabled"}

    page = staff.post(f"/admin/inference/catalogentry/{entry.pk}/change/", data, follow=True)

    assert "The agent instances acme.agent run on " in page.content.decode()
    entry.refresh_from_db()
    assert not entry.enabled


def test_an_admin_creates_an_instance_with_a_document_and_a_guardrail_for_a_tenant(
    staff: Client, organization: Organization, catalog_model: CatalogEntry
) -> None:
    inline = {"TOTAL_FORMS": "1", "INITIAL_FORMS": "0", "MIN_NUM_FORMS": "0", "MAX_NUM_FORMS": "1000"}
    form = {
        "instance_id": "support.agent.new",
        "name": "New",
        "enabled": "on",
        "model": str(catalog_model.pk),
        "organizations": [str(organization.pk)],
        "instructions": "Be brief.",
        "tools": ["knowledge_search"],
        "first_step": "search",
        **{f"documents-{key}": value for key, value in inline.items()},
        "documents-0-title": "Belt",
        "documents-0-url": "https://docs.example.com/belt",
        "documents-0-text": "Replace the belt every 2000 hours.",
        **{f"guardrails-{key}": value for key, value in inline.items()},
        "guardrails-0-name": "secrets",
        "guardrails-0-enabled": "on",
        "guardrails-0-applies_to": "both",
        "guardrails-0-kind": "terms",
        "guardrails-0-patterns": "password",
        "guardrails-0-refusal": "Not that.",
    }

    response = staff.post("/admin/agents/agentinstance/add/", form)

    assert response.status_code == 302, response.content.decode()[:3000]
    instance = AgentInstance.objects.get(instance_id="support.agent.new")
    assert (instance.tools, instance.first_step) == (["knowledge_search"], "search")
    assert list(instance.organizations.all()) == [organization]
    assert instance.documents.get().title == "Belt" and instance.guardrails.get().patterns == "password"


def test_an_organization_id_past_what_the_database_holds_is_no_valid_choice_not_a_server_error(
    staff: Client, organization: Organization, catalog_model: CatalogEntry
) -> None:
    form = {"instance_id": "support.agent.new", "model": str(catalog_model.pk), "first_step": "model"}
    inline = {"TOTAL_FORMS": "0", "INITIAL_FORMS": "0", "MIN_NUM_FORMS": "0", "MAX_NUM_FORMS": "1000"}
    inlines = {f"{name}-{key}": value for name in ("documents", "guardrails") for key, value in inline.items()}

    page = staff.post("/admin/agents/agentinstance/add/", {**form, **inlines, "organizations": ["9" * 23]})

    assert page.status_code == 200 and "Select a valid choice." in page.content.decode()
    assert not AgentInstance.objects.filter(instance_id="support.agent.new").exists()


def test_an_instance_is_refused_tools_that_do_not_exist_or_a_first_step_it_cannot_take(
    make_instance: Callable[..., AgentInstance],
) -> None:
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError, match="Unknown tools"):
        make_instance("a.agent", tools=["teleport"])
    with pytest.raises(ValidationError, match="knowledge_search"):
        make_instance("b.agent", first_step=FirstStep.SEARCH)
    with pytest.raises(ValidationError, match="does not reason"):
        make_instance("c.agent", reasons=True)


def test_an_instance_is_refused_an_answer_budget_of_no_tokens(make_instance: Callable[..., AgentInstance]) -> None:
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError, match="max_output_tokens"):
        make_instance("d.agent", max_output_tokens=0)
    assert make_instance("e.agent", max_output_tokens=1).max_output_tokens == 1


@pytest.mark.parametrize("repeats", [1700, 20_000])
def test_an_instance_is_refused_instructions_that_leave_no_room_for_a_conversation(
    make_instance: Callable[..., AgentInstance], catalog_model: CatalogEntry, repeats: int
) -> None:
    # Every turn of such an instance failed with context_length_exceeded, blaming the client's input.
    from django.core.exceptions import ValidationError

    assert catalog_model.context_length == 8192
    with pytest.raises(ValidationError, match="tokens of the catalog model .* context of 8192: no conversation would"):
        make_instance("f.agent", instructions="Answer in plain English. " * repeats)
    assert make_instance("g.agent", instructions="Answer in plain English. " * 1000).full_clean() is None


def test_an_instance_is_refused_instructions_its_models_chat_template_refuses(
    make_instance: Callable[..., AgentInstance], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A template that takes no system message (Gemma's, Mistral's) raised through the admin: a 500.
    from django.core.exceptions import ValidationError
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from inference.engine import execution

    def refuse(*args: object, **kwargs: object) -> None:
        raise ValueError("System role not supported")

    execution._renderers.clear()
    monkeypatch.setattr(Jinja2ChatFormatter, "__call__", refuse)
    try:
        with pytest.raises(ValidationError, match="chat template refuses them: System role not supported"):
            make_instance("h.agent", instructions="Answer briefly.")
    finally:
        execution._renderers.clear()


def test_a_guardrail_with_a_broken_regular_expression_is_refused(make_instance: Callable[..., AgentInstance]) -> None:
    from django.core.exceptions import ValidationError

    guardrail = Guardrail(instance=make_instance("a.agent"), name="x", kind="regex", patterns="(unclosed")
    with pytest.raises(ValidationError, match="not a regular expression"):
        guardrail.full_clean()


def test_a_guardrails_terms_match_whole_words_in_any_case(make_instance: Callable[..., AgentInstance]) -> None:
    (pattern,) = Guardrail(instance=make_instance("a.agent"), name="x", patterns="credit card\npass").compiled()

    assert pattern.search("my CREDIT  card".replace("  ", " ")) and pattern.search("the pass, please")
    assert pattern.search("no: credit-card") and pattern.search("a creditcard")
    assert not pattern.search("a passport") and not pattern.search("credit cards? no: discredit card")


def test_a_document_can_be_uploaded_as_a_text_file() -> None:
    upload = SimpleUploadedFile("belt.md", b"# Belt\nReplace it every 2000 hours.")
    form = DocumentForm(data={"title": "Belt", "url": "https://docs.example.com/belt"}, files={"upload": upload})

    assert form.is_valid(), form.errors
    assert form.cleaned_data["text"] == "# Belt\nReplace it every 2000 hours."
    empty = DocumentForm(data={"title": "Belt", "url": "https://docs.example.com/belt"})
    assert not empty.is_valid() and "text" in empty.errors


def test_a_document_saved_back_untouched_from_a_browser_keeps_its_text_as_it_was(
    make_instance: Callable[..., AgentInstance],
) -> None:
    text = "  an indented first line\nline two\n\n"
    document = make_instance("acme.agent").documents.create(title="Belt", url="https://docs.example.com/b", text=text)
    posted = {"title": "Belt", "url": "https://docs.example.com/b", "text": text.replace("\n", "\r\n")}  # as sent

    form = DocumentForm(data=posted, instance=document)

    assert form.is_valid(), form.errors
    assert not form.has_changed() and form.cleaned_data["text"] == text


def test_a_long_document_is_shown_not_posted_back_with_every_save_of_its_instance(
    make_instance: Callable[..., AgentInstance],
) -> None:
    # Each was posted whole: a few megabytes of documents made any save of the page pass the body's bound.
    text = "Replace the belt every 2000 hours. " * 4000
    document = make_instance("acme.agent").documents.create(title="Belt", url="https://docs.example.com/b", text=text)

    form = DocumentForm(data={"title": "Belt", "url": "https://docs.example.com/b"}, instance=document)

    assert form.is_valid(), form.errors
    assert form.cleaned_data["text"] == text and "upload a file to replace them" in str(form["text"])
    assert len(str(form["text"])) < 3000


def test_an_uploaded_file_holding_a_nul_character_is_refused_by_name() -> None:
    upload = SimpleUploadedFile("belt.md", b"Belt\x00")

    form = DocumentForm(data={"title": "Belt", "url": "https://docs.example.com/belt"}, files={"upload": upload})

    assert not form.is_valid() and "NUL character" in str(form.errors["upload"])


def test_operators_see_a_stored_turn_with_its_tool_run_and_its_feedback(
    staff: Client, make_instance: Callable[..., AgentInstance], organization: Organization
) -> None:
    response = StoredResponse.objects.create(
        response_id="resp_1",
        organization=organization,
        instance=make_instance("acme.agent"),
        thread="resp_1",
        status="completed",
        input_items=[{"type": "message", "role": "user", "content": "Which belt fits?"}],
        output_items=[
            {
                "type": "agent_runtime:function_call",
                "name": "knowledge_search",
                "arguments": '{"query": "belt"}',
                "status": "failed",
                "output": None,
                "error": "The index is down.",
            },
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "The B-220."}]},
        ],
    )
    Feedback.objects.create(response=response, rating="negative", comment="Wrong belt")

    page = staff.get(f"/admin/agents/storedresponse/{response.pk}/change/").content.decode()
    listing = staff.get("/admin/agents/storedresponse/").content.decode()
    feedback = staff.get("/admin/agents/feedback/").content.decode()

    assert "Which belt fits?" in page and "The B-220." in page and "error: The index is down." in page
    assert "Wrong belt" in page and "negative" in listing
    assert "Wrong belt" in feedback and "resp_1" in feedback
