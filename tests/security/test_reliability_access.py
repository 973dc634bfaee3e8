"""Access control: ingest token, the non-loopback rule, metrics auth, TLS, and secrets kept out of sight."""

from __future__ import annotations

import base64
import http.client
import secrets
import socket
import ssl
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from tests.helpers.figures import record
from tests.helpers.http import MSGPACK, Reply, request
from tests.helpers.ready_responses import ready_response
from tests.helpers.sqlite_file import read_only, rows
from tests.helpers.tls import make_certificate
from tests.support import ExporterProcess, free_port

BODY = ready_response(0, 42, 2)


def secret_file(directory: Path, name: str, content: str) -> Path:
    path = directory / name
    path.write_text(content + "\n")
    path.chmod(0o600)
    return path


MUTATIONS: list[tuple[str, str, dict[str, str] | None, bytes]] = [
    ("ingest", "POST", MSGPACK, BODY),
    ("default ingest", "POST", MSGPACK, BODY),
    ("static config", "PUT", {"Content-Type": "application/json"}, b'{"mamba_cache_mode": "align"}'),
    ("heartbeat", "POST", None, b""),
    ("forget engine", "DELETE", None, b""),
    ("forget deployment", "DELETE", None, b""),
]
PATHS = {
    "ingest": "/api/v1/deployments/guarded/ready",
    "default ingest": "/api/v1/ready",
    "static config": "/api/v1/deployments/guarded/cache-config",
    "heartbeat": "/api/v1/deployments/guarded/heartbeat?interval=30",
    "forget engine": "/api/v1/deployments/guarded/engines/0",
    "forget deployment": "/api/v1/deployments/guarded",
}


def test_every_change_needs_the_ingest_token(
    make_client: Callable[..., TestClient], tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    token = secrets.token_urlsafe(24)
    client = make_client(ingest_token_file=secret_file(tmp_path, "ingest.token", token))
    right = {"Authorization": f"Bearer {token}"}
    assert client.post(PATHS["ingest"], content=BODY, headers={**MSGPACK, **right}).status_code == 200
    wrong_ones = {
        "no header": {},
        "wrong token": {"Authorization": f"Bearer {secrets.token_urlsafe(24)}"},
        "token with a suffix": {"Authorization": f"Bearer {token}x"},
        "token prefix": {"Authorization": f"Bearer {token[:-1]}"},
        "token without scheme": {"Authorization": token},
        "token as basic": {"Authorization": "Basic " + base64.b64encode(f"user:{token}".encode()).decode()},
        "empty bearer": {"Authorization": "Bearer "},
    }
    db = read_only(tmp_path / "exporter.db")
    before = (client.get("/api/v1/deployments").content, rows(db))
    refused = 0
    for what, method, headers, body in MUTATIONS:
        for wrong in wrong_ones.values():
            reply = Reply.of(client.request(method, PATHS[what], content=body, headers={**(headers or {}), **wrong}))
            problem = reply.problem(401)
            assert reply.headers["www-authenticate"] == 'Bearer realm="ingest"'
            assert problem["field"] == "Authorization"
            refused += 1
    assert (client.get("/api/v1/deployments").content, rows(db)) == before, "a refused request changed something"
    for what, method, headers, body in MUTATIONS:
        response = client.request(method, PATHS[what], content=body, headers={**(headers or {}), **right})
        assert response.is_success, (what, response.status_code, response.text)
    lower_case_scheme = {**MSGPACK, "Authorization": f"bearer {token}"}
    assert client.post(PATHS["ingest"], content=BODY, headers=lower_case_scheme).status_code == 200
    assert client.get("/metrics").status_code == 200  # reading is open unless metrics auth is set
    db.close()
    record(record_property, "access_ingest_token", unauthorized_attempts=refused, changed_by_them=0)


@pytest.mark.parametrize("address", ["0.0.0.0:{port}", ":{port}", "[::]:{port}", "192.0.2.1:{port}"])
def test_a_non_loopback_address_without_a_token_is_refused_before_listening(address: str, tmp_path: Path) -> None:
    port = free_port()
    result = subprocess.run(
        [sys.executable, "-m", "exporter", "serve", "--storage.path", str(tmp_path / "x.db"),
         "--web.listen-address", address.format(port=port), "--log.level", "debug"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--web.ingest-token-file" in result.stderr and "--web.allow-unauthenticated-ingest" in result.stderr
    assert "Uvicorn running" not in result.stderr + result.stdout and "worker(s) on" not in result.stderr
    assert not (tmp_path / "x.db").exists(), "it opened its storage before refusing"
    with socket.socket() as probe:  # nothing took the port
        probe.bind(("127.0.0.1", port))


@pytest.mark.parametrize("way", ["--web.allow-unauthenticated-ingest", "--web.ingest-token-file"])
def test_a_non_loopback_address_starts_with_a_token_or_the_explicit_flag(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path, way: str
) -> None:
    token = secrets.token_urlsafe(24)
    flags = [way] if way.startswith("--web.allow") else [way, str(secret_file(tmp_path, "t", token))]
    exporter = start_exporter(*flags, host="0.0.0.0")  # reached on 127.0.0.1 only, and stopped at once
    try:
        headers = dict(MSGPACK)
        if way == "--web.ingest-token-file":
            assert request(exporter.url, "POST", PATHS["ingest"], BODY, headers).status == 401
            headers["Authorization"] = f"Bearer {token}"
        assert request(exporter.url, "POST", PATHS["ingest"], BODY, headers).status == 200
    finally:
        assert exporter.stop() == 0


READS = ["/metrics", "/api/v1/deployments", "/api/v1/deployments/guarded"]


@pytest.mark.parametrize("scheme", ["bearer", "basic"])
def test_metrics_and_state_can_be_protected(
    make_client: Callable[..., TestClient], tmp_path: Path, scheme: str
) -> None:
    token, password = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    if scheme == "bearer":
        client = make_client(metrics_token_file=secret_file(tmp_path, "metrics.token", token))
        right = f"Bearer {token}"
        wrong = [
            f"Bearer {password}",
            f"Bearer {token}x",
            "Basic " + base64.b64encode(f"prom:{token}".encode()).decode(),
        ]
    else:
        users = secret_file(tmp_path, "users", f"prometheus:{password}\ngrafana:{secrets.token_urlsafe(24)}")
        client = make_client(metrics_basic_auth_file=users)
        right = "Basic " + base64.b64encode(f"prometheus:{password}".encode()).decode()
        wrong = [
            "Basic " + base64.b64encode(f"prometheus:{password}x".encode()).decode(),
            "Basic " + base64.b64encode(f"nobody:{password}".encode()).decode(),
            "Basic " + base64.b64encode(f"grafana:{password}".encode()).decode(),
            "Basic !!!not-base64",
            f"Bearer {password}",
        ]
    assert client.post(PATHS["ingest"], content=BODY, headers=MSGPACK).status_code == 200
    challenge = 'Bearer realm="metrics"' if scheme == "bearer" else 'Basic realm="metrics"'
    for path in READS:
        for authorization in [None, *wrong]:
            headers = {"Authorization": authorization} if authorization else {}
            reply = Reply.of(client.get(path, headers=headers))
            reply.problem(401)
            assert reply.headers["www-authenticate"] == challenge
        assert client.get(path, headers={"Authorization": right}).status_code == 200
    for open_path in ("/-/healthy", "/-/ready"):  # probes of the orchestrator stay open
        assert client.get(open_path).status_code == 200


def test_tls_with_a_self_signed_certificate(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    cert, key = make_certificate(tmp_path)
    trusting = ssl.create_default_context(cafile=str(cert))
    exporter = start_exporter("--web.tls-cert-file", str(cert), "--web.tls-key-file", str(key), tls=trusting)
    assert exporter.url.startswith("https://")
    assert request(exporter.url, "POST", PATHS["ingest"], BODY, MSGPACK, tls=trusting).status == 200
    scrape = request(exporter.url, "GET", "/metrics", tls=trusting)
    assert scrape.status == 200 and b'deployment="guarded"' in scrape.body
    with pytest.raises(ssl.SSLCertVerificationError):  # it is really that certificate
        request(exporter.url, "GET", "/metrics", tls=ssl.create_default_context())
    plain = exporter.url.replace("https://", "http://")
    with pytest.raises((OSError, http.client.HTTPException)):  # and no plain HTTP on that port
        request(plain, "GET", "/metrics", timeout=5)
    assert exporter.stop() == 0
    record(record_property, "access_tls", https_requests=3, plain_http_refused=1)


def test_secrets_never_appear_in_logs_or_answers(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    ingest, metrics, password = (secrets.token_hex(20) for _ in range(3))
    guesses = [secrets.token_hex(20) for _ in range(3)]
    exporter = start_exporter(
        "--log.level", "debug",
        "--web.ingest-token-file", str(secret_file(tmp_path, "ingest", ingest)),
        "--web.metrics-token-file", str(secret_file(tmp_path, "metrics", metrics)),
        "--web.metrics-basic-auth-file", str(secret_file(tmp_path, "users", f"prometheus:{password}")),
    )  # fmt: skip
    basic = base64.b64encode(f"prometheus:{password}".encode()).decode()
    guessed_basic = base64.b64encode(f"prometheus:{guesses[2]}".encode()).decode()
    replies = []
    for authorization in (None, f"Bearer {guesses[0]}", f"Bearer {ingest}"):
        headers = {**MSGPACK, **({"Authorization": authorization} if authorization else {})}
        replies.append(request(exporter.url, "POST", PATHS["ingest"], BODY, headers))
    for authorization in (
        None,
        f"Bearer {guesses[1]}",
        f"Basic {guessed_basic}",
        f"Bearer {metrics}",
        f"Basic {basic}",
    ):
        replies.append(request(exporter.url, "GET", "/metrics", headers={"Authorization": authorization or ""}))
    assert [reply.status for reply in replies] == [401, 401, 200, 401, 401, 401, 200, 200]
    assert exporter.stop() == 0
    log = exporter.log.read_text()
    assert "GET /metrics" in log, "debug logging (the access log) is on"
    answers = "".join(reply.body.decode() + repr(reply.headers) for reply in replies)
    checked = (ingest, metrics, password, basic, *guesses, guessed_basic)
    for secret in checked:
        assert secret not in log and secret not in answers
    broken = secret_file(tmp_path, "broken-users", f"{password}")  # a line without USER:
    result = subprocess.run(
        [sys.executable, "-m", "exporter", "serve", "--storage.path", str(tmp_path / "y.db"),
         "--web.metrics-basic-auth-file", str(broken)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2 and "line 1" in result.stderr and password not in result.stderr + result.stdout
    record(record_property, "access_secrets", requests_sent=len(replies), secrets_checked=len(checked), secrets_found=0)
