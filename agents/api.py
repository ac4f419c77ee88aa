"""The agent runtime's views: the tenant check, then validate, call one service, render."""

from __future__ import annotations

import hmac

from django.conf import settings
from django.http import HttpResponseBase
from rest_framework.request import Request
from rest_framework.response import Response

from core.db import db_task
from inference.api.base import AsyncAPIView
from inference.openai.errors import APIError, stored_responses_not_offered
from orgs.models import Organization

from . import protocol, services

TENANT_HEADER = "X-Tenant-ID"


def tenant(request: Request) -> Organization:
    """The key's organization, if ``X-Tenant-ID`` names it. An unknown tenant and another organization's get
    the same answer, so the header cannot be used to learn which organizations exist."""
    claimed = request.headers.get(TENANT_HEADER, "").strip()
    if not claimed:
        raise APIError(
            f"Missing tenant: send '{TENANT_HEADER}: <organization>' with the organization of your API key.",
            code="missing_tenant_id",
        )
    organization: Organization = request.user
    if not hmac.compare_digest(claimed.encode(), organization.slug.encode()):
        raise APIError(
            f"The tenant in {TENANT_HEADER} is not the organization of this API key.",
            code="tenant_mismatch",
            status=403,
        )
    return organization


class ResponsesView(AsyncAPIView):
    http_method_names = ["post"]

    async def post(self, request: Request) -> HttpResponseBase:
        tenant(request)
        params = await self.parse(request, protocol.AgentResponseRequest)
        self.names(request, params.param_names())
        caller = self.caller(request, route=services.ROUTE)
        return self.render_result(request, await services.create_response(params=params, caller=caller))


class StoredResponseView(AsyncAPIView):
    """``/responses/{id}`` and below (retrieve, delete, cancel, input items): not offered by the runtime."""

    http_method_names = ["get", "post", "delete"]

    async def get(self, request: Request, response_id: str) -> Response:
        tenant(request)
        if response_id.strip("/") == "input_tokens":
            raise stored_responses_not_offered(
                "The agent runtime does not count input tokens (POST /responses/input_tokens): an instance's prompt "
                "holds its own instructions and tools. Each response's usage gives the tokens its turn took."
            )
        days = settings.AGENT_RESPONSE_RETENTION_DAYS
        kept = f"deleted {days} days after their last turn" if days else "kept until an operator deletes them"
        raise stored_responses_not_offered(
            "The agent runtime does not offer retrieving, deleting or cancelling a stored response, nor listing its "
            "input items: go on with a conversation by its last response's id, as previous_response_id. Stored "
            f"conversations are {kept}."
        )

    post = delete = get


class InstancesView(AsyncAPIView):
    http_method_names = ["get"]

    async def get(self, request: Request) -> Response:
        organization = tenant(request)
        instances = await db_task(services.list_instances)(organization_id=organization.pk)
        return Response(
            protocol.instance_list(
                [
                    protocol.instance_object(
                        instance_id=instance.instance_id,
                        name=instance.name,
                        created=int(instance.created.timestamp()),
                        base_model=instance.model.public_id,
                        tools=list(instance.tools),
                        reasoning=instance.reasons,
                    )
                    for instance in instances
                ]
            )
        )


class FeedbackView(AsyncAPIView):
    http_method_names = ["post"]

    async def post(self, request: Request) -> Response:
        organization = tenant(request)
        params = await self.parse(request, protocol.FeedbackRequest)
        rated = await db_task(services.rate_response)(
            organization_id=organization.pk,
            api_key_id=request.auth.pk,
            message_id=params.meta.message_id,
            rating=params.rating,
            comment=params.comment or "",
            meta=params.meta.model_dump(mode="json"),
        )
        feedback = rated.feedback
        return Response(
            protocol.feedback_object(
                message_id=rated.message_id,
                rating=feedback.rating,
                comment=feedback.comment,
                created_at=int(feedback.created.timestamp()),
            )
        )
