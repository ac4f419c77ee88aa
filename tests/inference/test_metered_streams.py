"""The one metered stream: however a stream ends, its slot is released and it is recorded once, as what it was."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import pytest

from inference.models import UsageRecord
from inference.serving.metered import Metered, StreamOutcome
from inference.usage import records as usage
from orgs import admission
from orgs.models import Limit, Organization

pytestmark = pytest.mark.django_db(transaction=True)


async def admitted(organization: Organization) -> admission.Grant:
    return await admission.admit(organization_id=organization.pk, model_pk=None, tokens=10)


def meter(organization: Organization) -> usage.Meter:
    return usage.Meter(organization.pk, organization.slug, None, "m", "chat.completions", "node", "req_metered")


def served(ran_to_end: bool) -> StreamOutcome:
    return StreamOutcome(200 if ran_to_end else 499, "" if ran_to_end else "client_disconnected", 7, 3)


async def one_request_in_flight(organization: Organization) -> Metered[str]:
    """The stream of the one request ``organization`` may have in flight, from a source that fails."""
    await Limit.objects.acreate(organization=organization, requests_in_flight=1)
    admission.clear_limits_cache()
    return Metered(
        a_source_that_fails_after_its_first_chunk(),
        grant=await admitted(organization),
        meter=meter(organization),
        outcome=served,
    )


async def a_source_that_fails_after_its_first_chunk() -> AsyncGenerator[str, None]:
    yield "data: {}\n\n"
    raise RuntimeError("a fault in the service")


async def test_a_stream_whose_source_raises_is_recorded_as_the_services_fault_and_frees_its_slot(
    organization: Organization,
) -> None:
    stream = await one_request_in_flight(organization)

    with pytest.raises(RuntimeError):
        async for _ in stream:
            pass

    usage.flush()
    record = await UsageRecord.objects.aget(request_id="req_metered")
    assert (record.status, record.error_code) == (500, "internal_error")
    assert (record.input_tokens, record.output_tokens) == (7, 3)
    await admitted(organization)  # LimitExceeded, were its one slot still held


async def test_a_client_that_goes_away_is_recorded_as_gone(organization: Organization) -> None:
    stream = Metered(
        a_source_that_fails_after_its_first_chunk(),
        grant=await admitted(organization),
        meter=meter(organization),
        outcome=served,
    )

    await anext(stream)
    await stream.aclose()

    usage.flush()
    record = await UsageRecord.objects.aget(request_id="req_metered")
    assert (record.status, record.error_code) == (499, "client_disconnected")


async def test_a_stream_closed_before_it_started_frees_its_slot_and_is_recorded_as_gone(
    organization: Organization,
) -> None:
    # Its client went away just as the response was to be sent: the server closes it without ever iterating it.
    stream = await one_request_in_flight(organization)

    await stream.aclose()

    usage.flush()
    record = await UsageRecord.objects.aget(request_id="req_metered")
    assert (record.status, record.error_code) == (499, "client_disconnected")
    await admitted(organization)  # LimitExceeded, were its one slot still held
