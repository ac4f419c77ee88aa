"""An embedded deployment is one serving process, but not the only process opening its database: a management
command or a shell changing a key is seen by the server at its next request."""

from __future__ import annotations

import httpx

from tests.conftest import LiveServer

REVOKE = """
from orgs.models import APIKey
APIKey.objects.get(prefix={prefix!r}).revoke()
"""


def test_a_key_revoked_by_another_process_is_refused_at_the_servers_next_request(node_server: LiveServer) -> None:
    key = node_server.new_key("revoked-elsewhere")
    headers = {"Authorization": f"Bearer {key}"}
    models = f"{node_server.base_url}/models"
    assert httpx.get(models, headers=headers).status_code == 200  # now remembered by the server
    assert httpx.get(models, headers=headers).status_code == 200

    node_server.manage("shell", "-v0", "-c", REVOKE.format(prefix=key.split("_")[1]))

    refused = httpx.get(models, headers=headers)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
