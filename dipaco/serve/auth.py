"""Who may use ``dipaco serve``: a bearer token for every endpoint but ``/healthz``, and no unauthenticated
server on an address other machines can reach.

- With a token (``--token`` or ``DIPACO_SERVE_TOKEN``), a request without ``Authorization: Bearer <token>``,
  or with another token, is a 401 before its body is read. The comparison is of SHA-256 digests with
  ``hmac.compare_digest``: constant time, and the digests have one length whatever was sent, so neither
  the token's bytes nor its length leak through timing.
- Binding a non-loopback address without a token is refused (one error line) unless the operator says
  ``--allow-unauthenticated``. Loopback means every address the host name resolves to is loopback
  (``127.0.0.0/8``, ``::1``): ``0.0.0.0``, ``::`` and a LAN address are not.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import socket

from dipaco.errors import DipacoError
from dipaco.serve.openai_api import error_body, is_openai_path

TOKEN_ENV = "DIPACO_SERVE_TOKEN"
OPEN_PATHS = frozenset({"/healthz"})  # a load balancer's health check carries no credentials


def resolve_token(flag: str | None) -> str | None:
    """The token from ``--token``, else from ``DIPACO_SERVE_TOKEN``; None when neither is set. An empty
    or blank one is an error, not "no token"."""
    source, token = ("--token", flag) if flag is not None else (TOKEN_ENV, os.environ.get(TOKEN_ENV))
    if token is None:
        return None
    if not token.strip():
        raise DipacoError(f"{source} is empty: give a token, or leave it unset for a loopback-only server")
    if token != token.strip() or any(c in token for c in "\r\n"):
        raise DipacoError(f"{source}: the token has leading/trailing whitespace or a line break, which an "
                          f"Authorization header cannot carry intact")
    return token


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to (as a listening address) is a loopback address."""
    try:
        infos = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise DipacoError(f"--host: cannot listen on {host!r}: {exc.strerror}") from None
    addresses = {str(info[4][0]).split("%")[0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def check_exposure(host: str, token: str | None, allow_unauthenticated: bool) -> None:
    """Refuses an unauthenticated server on an address other machines can reach."""
    if token is None and not allow_unauthenticated and not is_loopback(host):
        raise DipacoError(
            f"--host {host} is not a loopback address and the server has no token: anyone who can reach the "
            f"port could generate. Set one with --token or {TOKEN_ENV} (clients send 'Authorization: Bearer "
            f"<token>'), or pass --allow-unauthenticated")


class BearerToken:
    """ASGI middleware: every HTTP request outside ``OPEN_PATHS`` needs ``Authorization: Bearer <token>``."""

    def __init__(self, app, token: str) -> None:
        self.app = app
        self._digest = hashlib.sha256(token.encode("utf-8")).digest()

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        values = [value for key, value in headers if key == b"authorization"]
        if len(values) != 1:  # none, or several: which one a proxy would forward is ambiguous
            return False
        scheme, _, credential = values[0].strip().partition(b" ")
        presented = hashlib.sha256(credential.strip()).digest()
        return hmac.compare_digest(presented, self._digest) and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and not self.authorized(scope["headers"]):
            await self._unauthorized(scope, send)
            return
        await self.app(scope, receive, send)

    @staticmethod
    async def _unauthorized(scope, send) -> None:
        message = "missing or wrong token: send 'Authorization: Bearer <token>'"
        content = (error_body(401, message, code="invalid_api_key") if is_openai_path(scope["path"])
                   else {"detail": message})
        body = json.dumps(content).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b'Bearer realm="dipaco"')]})
        await send({"type": "http.response.body", "body": body})
