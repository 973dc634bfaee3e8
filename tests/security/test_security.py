"""--web.config.file (exporter-toolkit format) and token files: rotation without a restart, bad files refused."""

from __future__ import annotations

import base64
import contextlib
import os
import secrets
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import bcrypt
import pytest

from exporter.config.settings import Settings
from exporter.flags.option import SettingsError
from exporter.security.auth import Credentials
from exporter.security.web_config import load_web_config, watched_web_config
from tests.helpers.exposition import samples
from tests.helpers.figures import record
from tests.helpers.http import MSGPACK, Reply, request
from tests.helpers.ready_responses import ready_response
from tests.helpers.tls import der_of, make_certificate, served_certificate
from tests.probe.hostile import cpu_seconds
from tests.support import ExporterProcess, wait_until

BODY = ready_response(0, 42, 2)
INGEST = "/api/v1/deployments/web-config/ready"
RELOADED = "cache_config_exporter_config_last_reload_successful"


def bcrypt_hash(password: str) -> str:
    """A bcrypt hash as `htpasswd -nBC 4` would write it (the lowest cost, to keep the test fast)."""
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()


def collected_bcrypt_hash(password: str) -> str:
    """``bcrypt_hash`` with a fixed salt, for a test's parameters: they name the test, and every pytest-xdist worker
    must collect the same names."""
    return bcrypt.hashpw(password.encode(), b"$2b$04$" + b"." * 22).decode()


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def scrape_status(exporter: ExporterProcess, headers: dict[str, str]) -> int:
    return request(exporter.url, "GET", "/metrics", headers=headers, tls=exporter.tls).status


def reload_gauge(exporter: ExporterProcess, headers: dict[str, str], file: Path) -> float:
    reply = request(exporter.url, "GET", "/metrics", headers=headers, tls=exporter.tls)
    assert reply.status == 200
    (sample,) = [sample for sample in samples(reply.body.decode(), RELOADED) if sample.labels["file"] == str(file)]
    return sample.value


def test_passwords_and_headers_rotate_without_a_restart(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    old, new = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    web_config = tmp_path / "web.yml"
    web_config.write_text(
        "basic_auth_users:\n"
        f"  prometheus: {bcrypt_hash(old)}\n"
        "http_server_config:\n"
        "  headers:\n"
        "    X-Frame-Options: deny\n"
        "    X-Content-Type-Options: nosniff\n"
    )
    exporter = start_exporter("--web.config.file", str(web_config))
    assert scrape_status(exporter, basic("prometheus", old)) == 200
    for wrong in (basic("prometheus", new), basic("nobody", old), {}):
        refused = request(exporter.url, "GET", "/metrics", headers=wrong)
        assert refused.status == 401 and refused.headers["www-authenticate"] == 'Basic realm="metrics"'
    assert request(exporter.url, "GET", "/").status == 401, "the status page shows the state: it needs a reader"
    healthy = request(exporter.url, "GET", "/-/healthy")
    assert healthy.status == 200, "probes stay open"
    assert healthy.headers["x-frame-options"] == "deny" and healthy.headers["x-content-type-options"] == "nosniff"

    web_config.write_text(
        f"basic_auth_users:\n  prometheus: {bcrypt_hash(new)}\n"
        "http_server_config:\n  headers:\n    Strict-Transport-Security: max-age=31536000\n"
    )
    wait_until(lambda: scrape_status(exporter, basic("prometheus", new)) == 200)
    assert scrape_status(exporter, basic("prometheus", old)) == 401
    headers = request(exporter.url, "GET", "/-/healthy").headers
    assert headers["strict-transport-security"] == "max-age=31536000" and "x-frame-options" not in headers
    assert reload_gauge(exporter, basic("prometheus", new), web_config) == 1.0
    assert "reloaded" in exporter.log.read_text()


def serving_one_user(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path
) -> tuple[ExporterProcess, Path, str]:
    """An exporter whose web config has the user ``prometheus``: it, its web config and the password."""
    password = secrets.token_urlsafe(16)
    web_config = tmp_path / "web.yml"
    web_config.write_text(f"basic_auth_users:\n  prometheus: {bcrypt_hash(password)}\n")
    return start_exporter("--web.config.file", str(web_config)), web_config, password


def test_a_broken_reload_keeps_the_last_good_config_and_says_so(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    exporter, web_config, password = serving_one_user(start_exporter, tmp_path)
    good = web_config.read_text()
    right = basic("prometheus", password)
    leaked = "$2b$04$" + "x" * 20
    web_config.write_text(f"basic_auth_users:\n  prometheus: {leaked}\n")  # not a bcrypt hash
    wait_until(lambda: reload_gauge(exporter, right, web_config) == 0.0)
    assert scrape_status(exporter, right) == 200, "the last good users stay in force"
    log = exporter.log.read_text()
    assert f"--web.config.file {web_config}: reload failed, keeping the last good content" in log
    assert "$.basic_auth_users.prometheus is not a bcrypt hash" in log
    assert leaked not in log
    assert log.count("reload failed") == 1, "one broken file is logged once, not on every request"

    web_config.write_text(good + "\n")
    wait_until(lambda: reload_gauge(exporter, right, web_config) == 1.0)


@pytest.mark.parametrize(
    ("content", "where", "message"),
    [
        ("basic_auth_users:\n  a: b\n  c: [d\n", "line 4", "is not valid YAML"),
        ("tls_server_config:\n  cert_file: c.pem\n", "$.tls_server_config.key_file:", "missing required field"),
        ("http_server_config:\n  headers:\n    Server: x\n", "$.http_server_config.headers.Server", "cannot be set"),
        (
            "http_server_config:\n  headers:\n    X-Frame-Options: allow\n",
            "$.http_server_config.headers.X-Frame-Options",
            "must be one of deny, sameorigin",
        ),
        ("\nbasic_auth_user:\n  a: b\n", "$.basic_auth_user:", "unknown field"),
        (
            "tls_server_config:\n  cert_file: c\n  key_file: k\n  client_ca_file: ca\n",
            "$.tls_server_config.client_ca_file",
            "is not supported",
        ),
        (
            "tls_server_config:\n  cert_file: c\n  key_file: k\n  extra: x\n",
            "$.tls_server_config.extra:",
            "unknown field",
        ),
        ("basic_auth_users:\n  a: $2y$10$x\n", "$.basic_auth_users.a", "is not a bcrypt hash"),
        (
            "basic_auth_users:\n  a: " + collected_bcrypt_hash("p") + "x\n",
            "$.basic_auth_users.a",
            "is not a bcrypt hash",
        ),
        ("basic_auth_users:\n  a: 12\n", "$.basic_auth_users.a", "is not a bcrypt hash"),
        ("basic_auth_users:\n  a: $2y$15$" + "a" * 53 + "\n", "$.basic_auth_users.a", "cost 15, more than the 14"),
        ("basic_auth_users:\n  a: $2y$99$" + "a" * 53 + "\n", "$.basic_auth_users.a", "cost 99, more than the 14"),
        ("basic_auth_users:\n  a: $2b$03$" + "a" * 53 + "\n", "$.basic_auth_users.a", "cost 3, less than the 4"),
        (
            "basic_auth_users:\n  a: " + collected_bcrypt_hash("p") + "\n  a: " + collected_bcrypt_hash("q") + "\n",
            "line 3",
            "'a' appears twice",
        ),
        ("tls_server_config:\n  cert_file: none.crt\n  key_file: none.key\n", "$.tls_server_config:", "cannot load"),
        (
            "tls_server_config:\n  cert_file: c\n  key_file: k\n  min_version: TLS14\n",
            "$.tls_server_config.min_version:",
            "TLS14",
        ),
        ("- a\n", "$:", "Expected `object | null`, got `array`"),
        ("basic_auth_users:\n  a: \x01\n", "the file", "special characters are not allowed"),
    ],
)
def test_a_wrong_web_config_names_the_path(tmp_path: Path, content: str, where: str, message: str) -> None:
    web_config = tmp_path / "web.yml"
    web_config.write_text(content)
    with pytest.raises(SettingsError) as error:
        Credentials.from_settings(Settings(storage_path=tmp_path / "x.db", web_config_file=web_config))
    assert f"--web.config.file {web_config}: {where} " in str(error.value)
    assert message in str(error.value)


def test_a_restricted_header_value_is_taken_in_any_case_and_sent_as_written(tmp_path: Path) -> None:
    web_config = tmp_path / "web.yml"
    web_config.write_text("http_server_config:\n  headers:\n    x-frame-options: DENY\n"
                          "    X-Content-Type-Options: NoSniff\n")  # fmt: skip
    config, _ = load_web_config(web_config)
    assert config.headers == ((b"x-frame-options", b"DENY"), (b"x-content-type-options", b"NoSniff"))


def test_an_unknown_user_is_checked_at_the_highest_cost_among_the_users(tmp_path: Path) -> None:
    """Checked at a lower cost than a real user's, an unknown user would answer faster: timing would tell."""
    web_config = tmp_path / "web.yml"
    web_config.write_text(
        f"basic_auth_users:\n  cheap: $2b$04${'a' * 53}\n  dear: $2y$12${'b' * 53}\n  middle: $2a$08${'c' * 53}\n"
    )
    config, _ = load_web_config(web_config)
    assert config.bcrypt_cost == 12


@pytest.mark.parametrize("cost", [4, 14])
def test_a_cost_at_either_bound_is_taken(tmp_path: Path, cost: int) -> None:
    web_config = tmp_path / "web.yml"
    web_config.write_text(f"basic_auth_users:\n  a: $2y${cost:02d}${'a' * 53}\n")
    config, _ = load_web_config(web_config)
    assert config.bcrypt_cost == cost


def test_a_cost_past_the_bound_stops_start_up_in_one_line_naming_the_file_and_user(tmp_path: Path) -> None:
    """At cost 31 one anonymous guess held a core for hours: the file is refused before anything is served."""
    web_config = tmp_path / "web.yml"
    web_config.write_text(f"basic_auth_users:\n  prometheus: $2y$31${'a' * 53}\n")
    result = subprocess.run(
        [sys.executable, "-m", "exporter", "serve", "--storage.path", str(tmp_path / "x.db"),
         "--web.config.file", str(web_config), "--web.listen-address", "127.0.0.1:0"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert f"--web.config.file {web_config}: $.basic_auth_users.prometheus has cost 31" in line


def test_a_reload_past_the_cost_bound_keeps_the_last_good_users_and_says_so(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    exporter, web_config, password = serving_one_user(start_exporter, tmp_path)
    right = basic("prometheus", password)
    web_config.write_text(f"{web_config.read_text()}  mallory: $2y$31${'a' * 53}\n")
    wait_until(lambda: reload_gauge(exporter, right, web_config) == 0.0)
    assert scrape_status(exporter, basic("nobody", "guess")) == 401, "an unknown user is checked at the old cost"
    assert scrape_status(exporter, right) == 200
    log = exporter.log.read_text()
    assert f"--web.config.file {web_config}: reload failed, keeping the last good content" in log
    assert "$.basic_auth_users.mallory has cost 31" in log


@pytest.mark.slow  # checks at cost 14, about 1.5 s each on the project machine
def test_sigterm_during_checks_at_the_highest_cost_ends_within_the_shutdown_timeout(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path, record_property: Callable[[str, object], None]
) -> None:
    """Checks at the highest cost taken, an unknown user's among them, in flight when SIGTERM comes: no 500,
    and the exporter is gone within its shutdown timeout and the check in progress (one check's time measured
    here, in the same run, about 1.5 s on the project machine)."""
    web_config = tmp_path / "web.yml"
    hashed = bcrypt.hashpw(b"right", bcrypt.gensalt(rounds=14)).decode()
    timed = time.monotonic()
    bcrypt.checkpw(b"wrong", hashed.encode())
    check_seconds = time.monotonic() - timed
    web_config.write_text(f"basic_auth_users:\n  prometheus: {hashed}\n")
    exporter = start_exporter("--web.config.file", str(web_config), "--web.shutdown-timeout", "1")
    assert scrape_status(exporter, basic("nobody", "guess")) == 401
    before = cpu_seconds(exporter.process.pid)
    guesses = [threading.Thread(target=guess, args=(exporter,), daemon=True) for _ in range(6)]
    for thread in guesses:
        thread.start()
    wait_until(lambda: cpu_seconds(exporter.process.pid) - before > 0.3)  # a check is running
    started = time.monotonic()
    exporter.process.send_signal(signal.SIGTERM)
    exporter.process.wait(timeout=30)
    ended = time.monotonic() - started
    record(record_property, "sigterm_during_cost_14_checks", guesses=len(guesses), exit_seconds=round(ended, 2),
           check_seconds=round(check_seconds, 2))  # fmt: skip
    assert ended < 1 + 2 * check_seconds + 1, "the shutdown timeout, a check begun as it ended, and a margin"


def guess(exporter: ExporterProcess) -> None:
    with contextlib.suppress(OSError):  # the connection closed by the shutdown
        request(exporter.url, "GET", "/metrics", headers=basic("nobody", "guess"), timeout=30)


def written_an_hour_ago(path: Path, content: bytes) -> None:
    """``cp -p`` of a file made an hour ago: new content, an old modification time."""
    path.write_bytes(content)
    an_hour_ago = time.time() - 3600
    os.utime(path, (an_hour_ago, an_hour_ago))


def test_a_certificate_then_its_key_copied_with_old_timestamps_are_both_taken(tmp_path: Path) -> None:
    """The key is watched as the certificate is: replacing the certificate first (which does not fit the old key)
    and then the key ends on the new pair, however old their timestamps."""
    first_cert, first_key = make_certificate(tmp_path, "first")
    second_cert, second_key = make_certificate(tmp_path, "second")
    served = tmp_path / "served"
    served.mkdir()
    written_an_hour_ago(served / "tls.crt", first_cert.read_bytes())
    written_an_hour_ago(served / "tls.key", first_key.read_bytes())
    written_an_hour_ago(served / "web.yml", b"tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\n")
    watched = watched_web_config(served / "web.yml")

    def serves() -> bytes:
        tls = watched.current().tls
        assert tls is not None
        return served_certificate(tls)

    assert serves() == der_of(first_cert)
    written_an_hour_ago(served / "tls.crt", second_cert.read_bytes())
    assert serves() == der_of(first_cert) and not watched.last_reload_successful
    written_an_hour_ago(served / "tls.key", second_key.read_bytes())
    assert serves() == der_of(second_cert) and watched.last_reload_successful


def test_a_wrong_web_config_stops_start_up(tmp_path: Path) -> None:
    web_config = tmp_path / "web.yml"
    web_config.write_text("basic_auth_users:\n  prometheus: plain-text-password\n")
    result = subprocess.run(
        [sys.executable, "-m", "exporter", "serve", "--storage.path", str(tmp_path / "x.db"),
         "--web.config.file", str(web_config)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "$.basic_auth_users.prometheus is not a bcrypt hash" in result.stderr
    assert "plain-text-password" not in result.stderr + result.stdout


def test_certificates_rotate_without_a_restart(start_exporter: Callable[..., ExporterProcess], tmp_path: Path) -> None:
    first_cert, first_key = make_certificate(tmp_path, "first")
    second_cert, second_key = make_certificate(tmp_path, "second")
    served_cert, served_key = tmp_path / "tls" / "served.crt", tmp_path / "tls" / "served.key"
    served_cert.parent.mkdir()
    served_cert.write_bytes(first_cert.read_bytes())
    served_key.write_bytes(first_key.read_bytes())
    web_config = tmp_path / "tls" / "web.yml"
    # Relative file names are relative to the web config file, as in exporter-toolkit.
    web_config.write_text("tls_server_config:\n  cert_file: served.crt\n  key_file: served.key\n")
    trusts_first = ssl.create_default_context(cafile=str(first_cert))
    trusts_second = ssl.create_default_context(cafile=str(second_cert))
    exporter = start_exporter("--web.config.file", str(web_config), tls=trusts_first)

    def reaches(context: ssl.SSLContext) -> bool:
        try:
            return request(exporter.url, "GET", "/-/healthy", tls=context).status == 200
        except ssl.SSLError:
            return False

    assert reaches(trusts_first) and not reaches(trusts_second)
    served_key.write_bytes(second_key.read_bytes())
    served_cert.write_bytes(second_cert.read_bytes())
    wait_until(lambda: reaches(trusts_second))
    assert not reaches(trusts_first)

    served_cert.write_bytes(first_cert.read_bytes())  # a certificate that does not fit the key
    exporter.tls = trusts_second
    wait_until(lambda: reload_gauge(exporter, {}, web_config) == 0.0)
    assert reaches(trusts_second), "the last good certificate is still served"
    assert "reload failed" in exporter.log.read_text()


def test_the_old_tls_flags_keep_working_and_reload_too(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    first_cert, first_key = make_certificate(tmp_path, "first")
    second_cert, second_key = make_certificate(tmp_path, "second")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_bytes(first_cert.read_bytes())
    key.write_bytes(first_key.read_bytes())
    trusts_second = ssl.create_default_context(cafile=str(second_cert))
    exporter = start_exporter(
        "--web.tls-cert-file", str(cert), "--web.tls-key-file", str(key),
        tls=ssl.create_default_context(cafile=str(first_cert)),
    )  # fmt: skip
    key.write_bytes(second_key.read_bytes())
    cert.write_bytes(second_cert.read_bytes())

    def reaches_second() -> bool:
        try:
            return request(exporter.url, "GET", "/-/healthy", tls=trusts_second).status == 200
        except ssl.SSLError:
            return False

    wait_until(reaches_second)


def ingest(exporter: ExporterProcess, token: str) -> Reply:
    return request(exporter.url, "POST", INGEST, BODY, {**MSGPACK, "Authorization": f"Bearer {token}"})


def test_ingest_tokens_overlap_during_a_rotation(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    old, new = secrets.token_hex(32), secrets.token_hex(32)
    tokens = tmp_path / "ingest.token"
    tokens.write_text(f"{old}\n")
    exporter = start_exporter("--web.ingest-token-file", str(tokens))
    assert ingest(exporter, old).status == 200
    assert ingest(exporter, new).status == 401
    # Step 1 of a rotation: both tokens, while the senders move to the new one.
    tokens.write_text(f"# rotated in\n{new}\n{old}\n")
    wait_until(lambda: ingest(exporter, new).status == 200)
    assert ingest(exporter, old).status == 200
    # Step 2: the old one is gone.
    tokens.write_text(f"{new}\n")
    wait_until(lambda: ingest(exporter, old).status == 401)
    assert ingest(exporter, new).status == 200
    # An emptied file is a mistake: the last good tokens stay.
    tokens.write_text("\n")
    wait_until(lambda: reload_gauge(exporter, {}, tokens) == 0.0)
    assert ingest(exporter, new).status == 200
    log = exporter.log.read_text()
    assert "--web.ingest-token-file" in log and "reload failed" in log
    assert old not in log and new not in log


@pytest.mark.parametrize(
    ("flag", "replacement"),
    [("--web.tls-cert-file", "tls_server_config"), ("--web.metrics-basic-auth-file", "basic_auth_users")],
)
def test_old_flags_with_the_web_config_fail_naming_the_replacement(tmp_path: Path, flag: str, replacement: str) -> None:
    web_config = tmp_path / "web.yml"
    web_config.write_text("")
    extra = ["--web.tls-key-file", "k.pem"] if flag == "--web.tls-cert-file" else []
    result = subprocess.run(
        [sys.executable, "-m", "exporter", "serve", "--storage.path", str(tmp_path / "x.db"),
         "--web.config.file", str(web_config), flag, "x", *extra],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert flag in result.stderr and replacement in result.stderr


def test_the_plain_text_basic_auth_file_still_works_and_says_it_is_deprecated(
    start_exporter: Callable[..., ExporterProcess], tmp_path: Path
) -> None:
    password = secrets.token_urlsafe(16)
    users = tmp_path / "users"
    users.write_text(f"prometheus:{password}\n")
    exporter = start_exporter("--web.metrics-basic-auth-file", str(users))
    assert scrape_status(exporter, basic("prometheus", password)) == 200
    assert scrape_status(exporter, basic("prometheus", "wrong")) == 401
    assert "deprecated" in exporter.log.read_text() and "basic_auth_users" in exporter.log.read_text()
