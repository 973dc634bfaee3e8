"""Certificates made with the openssl command, and TLS handshakes in memory: what a server context really serves."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

from tests.support import require_binary


def make_certificate(directory: Path, name: str = "cert", subject_alt_names: str = "IP:127.0.0.1") -> tuple[Path, Path]:
    """A self-signed P-256 certificate and its key, ``name.crt`` and ``name.key`` in ``directory``."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    made = subprocess.run(
        [require_binary("openssl"), "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-subj", f"/CN={name}", "-addext", f"subjectAltName={subject_alt_names}", "-days", "1",
         "-keyout", str(key), "-out", str(cert)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    return cert, key


def client_context(minimum: ssl.TLSVersion, maximum: ssl.TLSVersion) -> ssl.SSLContext:
    """A client speaking only the versions from ``minimum`` to ``maximum``, verifying nothing: it only looks."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.minimum_version, context.maximum_version = minimum, maximum
    return context


def handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> ssl.SSLObject:
    """The client's side of a whole handshake with ``server``, over memory; ``ssl.SSLError`` when none is agreed."""
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    client_side = client.wrap_bio(to_client, to_server)
    server_to_client, client_to_server = ssl.MemoryBIO(), ssl.MemoryBIO()
    server_side = server.wrap_bio(client_to_server, server_to_client, server_side=True)
    done = {client_side: False, server_side: False}
    for _ in range(10):  # a TLS 1.2 or 1.3 handshake takes two or three flights each way
        for side in done:
            if not done[side]:
                try:
                    side.do_handshake()
                    done[side] = True
                except ssl.SSLWantReadError:
                    pass
        client_to_server.write(to_server.read())
        to_client.write(server_to_client.read())
        if all(done.values()):
            return client_side
    raise AssertionError("the handshake did not end")


def served_certificate(server: ssl.SSLContext) -> bytes:
    """The DER certificate ``server`` presents to a client of any version it allows."""
    shown = handshake(server, client_context(ssl.TLSVersion.MINIMUM_SUPPORTED, ssl.TLSVersion.MAXIMUM_SUPPORTED))
    certificate = shown.getpeercert(binary_form=True)
    assert certificate is not None
    return certificate


def der_of(cert: Path) -> bytes:
    """A PEM certificate file's DER bytes: what a handshake shows of it."""
    return ssl.PEM_cert_to_DER_cert(cert.read_text())
