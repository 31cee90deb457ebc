"""The Host header check that defeats DNS rebinding: a web page whose name an attacker re-points at 127.0.0.1 makes
the browser send it requests with its own name in Host (and the JSON-only guard in body.py does not stop a page
that reads answers from its own "origin"). So a server on a loopback address without an API key answers only
requests that name a local host, as Ollama does; --allowed-hosts adds names (a reverse proxy's, say)."""
from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from functools import cache

from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.server.errors import APIError


def parse_allowed_hosts(text: str) -> list[str]:
    """--allowed-hosts: comma-separated names; "*.example.com" also allows every name under example.com, "*" any."""
    names = [name.strip().lower().rstrip(".") for name in text.split(",")]
    bad = [name for name in names if not name or " " in name or "/" in name
           or (name != "*" and "*" in name.removeprefix("*."))]
    if bad:
        raise ValueError(f"--allowed-hosts must be comma-separated host names (e.g. 'box.lan,*.example.com' or "
                         f"'*'), got {text!r}")
    return names


def host_name(header: str) -> str:
    """The name in a Host header, without its port, brackets or trailing dot, in lower case."""
    header = header.strip().lower()
    if header.startswith("["):  # an IPv6 literal, maybe with a port
        return header[1:header.find("]")] if "]" in header else header
    name = header.rsplit(":", 1)[0] if header.count(":") == 1 else header
    return name.rstrip(".")


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def is_local_name(name: str) -> bool:
    """localhost, a name under .localhost (RFC 6761: resolved to loopback by the browser itself), a loopback
    address, or this machine's own name."""
    return name in ("localhost", _machine_name()) or name.endswith(".localhost") or is_loopback(name)


@cache
def _machine_name() -> str:
    return socket.gethostname().lower()


def is_allowed(name: str, allowed_hosts: Sequence[str]) -> bool:
    if not name or is_local_name(name):
        return True
    for pattern in allowed_hosts:
        if pattern == "*" or name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:])):
            return True
    return False


class HostCheck:
    """ASGI middleware: a request that reaches a server without an API key on a loopback address (a server on
    127.0.0.1, or a local client of one on 0.0.0.0) and whose Host is not allowed gets 403 `host_not_allowed`
    before any route runs."""

    def __init__(self, app: ASGIApp, api_key: str | None, allowed_hosts: Sequence[str] = ()):
        self.app = app
        self.enabled = api_key is None  # with a key, a rebinding page cannot authenticate anyway
        self.allowed_hosts = list(allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.enabled and scope["type"] in ("http", "websocket") and self._on_loopback(scope):
            header = dict(scope.get("headers", ())).get(b"host", b"").decode("latin-1")
            if not is_allowed(host_name(header), self.allowed_hosts):
                await _refusal(header)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    def _on_loopback(scope: Scope) -> bool:
        server = scope.get("server")
        return bool(server) and is_loopback(str(server[0]))


def _refusal(header: str):
    message = (f"the Host header {header!r} is not a local name; this server is reached on a loopback address "
               "without an API key, so it answers only localhost, *.localhost, loopback addresses and this machine's "
               "name (against DNS rebinding); start it with --allowed-hosts to add names, or with --api-key")
    return APIError(403, message, "host", "host_not_allowed").response()
