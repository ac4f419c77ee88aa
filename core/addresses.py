"""The address a request came from, for the admin login's lockout."""

from __future__ import annotations

from ipaddress import ip_address

from django.http import HttpRequest


def client_address(request: HttpRequest) -> str | None:
    """The connection's own address; behind a proxy on this host (deploy/'s balancer, which appends the address it
    was reached from to ``X-Forwarded-For``), that last entry. Entries before it are the client's to forge, and so
    is the header itself from anywhere but this host."""
    remote = request.META.get("REMOTE_ADDR")
    forwarded = request.META.get("HTTP_X_FORWARDED_FOR", "")
    if not remote or not forwarded or not _loopback(remote):
        return remote
    last = forwarded.rsplit(",", 1)[-1].strip()
    try:
        return str(ip_address(last))
    except ValueError:
        return remote


def _loopback(address: str) -> bool:
    try:
        return ip_address(address).is_loopback
    except ValueError:
        return False
