"""The bearer token of `dipaco serve` and the refusal to expose an unauthenticated server."""

import hashlib
import http.client
import json
import socket

import pytest
from test_serve import call, needs_web, running

from dipaco.cli import main
from dipaco.errors import DipacoError
from dipaco.serve import auth
from dipaco.serve.auth import check_exposure, is_loopback, resolve_token
from dipaco.serve.http import create_app
from dipaco.serve.pipeline import Pipeline

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def port(served_run):
    needs_web()
    with running(create_app(Pipeline.from_run(served_run.run.dir), token=TOKEN)) as port:
        yield port


def request(port: int, method: str, path: str, headers: dict, body: dict | None = None) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        payload = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=payload, headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, dict(resp.getheaders()), json.loads(data) if data.startswith(b"{") else {}
    finally:
        conn.close()


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {TOKEN}x"}, {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": TOKEN}, {"Authorization": "Bearer "},
])
@pytest.mark.parametrize("method,path", [("POST", "/v1/generate"), ("POST", "/v1/route"), ("GET", "/v1/paths"),
                                         ("GET", "/metrics"), ("GET", "/docs"), ("GET", "/openapi.json")])
def test_a_missing_or_wrong_token_is_401(port, headers, method, path):
    body = {"prompt": "hello", "max_new_tokens": 2} if path == "/v1/generate" else {"text": "hello"}
    status, reply_headers, reply = request(port, method, path, headers, body if method == "POST" else None)
    assert status == 401
    assert "Authorization: Bearer" in reply["detail"]
    assert reply_headers.get("www-authenticate", "").startswith("Bearer")


def test_the_right_token_is_served_and_healthz_needs_none(port):
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    assert request(port, "POST", "/v1/generate", bearer, {"prompt": "hello", "max_new_tokens": 2})[0] == 200
    assert request(port, "POST", "/v1/route", {"Authorization": f"bearer {TOKEN}"}, {"text": "hello"})[0] == 200
    assert request(port, "GET", "/metrics", bearer)[0] == 200
    assert call(port, "GET", "/healthz")[0] == 200  # a load balancer's check carries no credentials


def test_a_large_body_without_the_token_is_refused_before_it_is_read(port):
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        sock.sendall(b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 50000000\r\n\r\n{\"prompt\": ")
        assert sock.recv(4096).startswith(b"HTTP/1.1 401")
    finally:
        sock.close()


def test_two_authorization_headers_are_refused(port):
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        sock.sendall(f"GET /v1/paths HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                     f"Authorization: Bearer other\r\n\r\n".encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 401")
    finally:
        sock.close()


def test_tokens_are_compared_as_digests_in_constant_time(monkeypatch):
    compared = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: compared.append((a, b)) or real(a, b))
    guard = auth.BearerToken(app=None, token=TOKEN)
    assert guard.authorized([(b"authorization", f"Bearer {TOKEN}".encode())])
    assert not guard.authorized([(b"authorization", b"Bearer s")])
    # Both sides are SHA-256 digests: equal lengths, whatever the client sent.
    assert compared and all(len(a) == len(b) == 32 for a, b in compared)
    assert compared[0][1] == hashlib.sha256(TOKEN.encode()).digest()


def test_a_non_loopback_host_without_a_token_is_refused_with_one_line(tmp_path, capsys, monkeypatch):
    """Refused before the run is loaded or the port bound: the message is about the host, not the run."""
    needs_web()
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    assert main(["serve", "--run", str(tmp_path / "missing"), "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --host 0.0.0.0 is not a loopback address") and err.count("\n") == 1
    assert "--token" in err and "DIPACO_SERVE_TOKEN" in err and "--allow-unauthenticated" in err
    # With a token, or with --allow-unauthenticated, the host is accepted (and the missing run is the error).
    assert main(["serve", "--run", str(tmp_path / "missing"), "--host", "0.0.0.0", "--port", "0", "--token", "t"]) == 2
    assert "run directory not found" in capsys.readouterr().err
    monkeypatch.setenv(auth.TOKEN_ENV, "from-the-environment")
    assert main(["serve", "--run", str(tmp_path / "missing"), "--host", "0.0.0.0", "--port", "0"]) == 2
    assert "run directory not found" in capsys.readouterr().err
    monkeypatch.delenv(auth.TOKEN_ENV)
    assert main(["serve", "--run", str(tmp_path / "missing"), "--host", "0.0.0.0", "--port", "0",
                 "--allow-unauthenticated"]) == 2
    assert "run directory not found" in capsys.readouterr().err


def test_loopback_hosts_need_no_token():
    for host in ("127.0.0.1", "localhost", "127.0.0.2"):
        assert is_loopback(host)
        check_exposure(host, None, allow_unauthenticated=False)
    for host in ("0.0.0.0", ""):
        assert not is_loopback(host)
    check_exposure("0.0.0.0", TOKEN, allow_unauthenticated=False)
    check_exposure("0.0.0.0", None, allow_unauthenticated=True)


def test_the_token_comes_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    assert resolve_token(None) is None
    monkeypatch.setenv(auth.TOKEN_ENV, "env-token")
    assert resolve_token(None) == "env-token" and resolve_token("flag-token") == "flag-token"
    for bad, match in [("", "--token is empty"), ("  ", "--token is empty"), (" padded", "whitespace")]:
        with pytest.raises(DipacoError, match=match):
            resolve_token(bad)
    monkeypatch.setenv(auth.TOKEN_ENV, "")
    with pytest.raises(DipacoError, match="DIPACO_SERVE_TOKEN is empty"):
        resolve_token(None)
