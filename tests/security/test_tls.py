"""The server's TLS versions (exporter/security/tls.py): ``min_version`` and ``max_version`` of the web config, as
exporter-toolkit has them, are what a client can really agree on."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from exporter.security.tls import tls_context
from tests.helpers.tls import client_context, handshake, make_certificate

TLS12, TLS13 = ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_certificate(tmp_path_factory.mktemp("tls"))


def test_by_default_a_client_gets_tls_1_3_and_one_of_tls_1_2_still_connects(certificate: tuple[Path, Path]) -> None:
    server = tls_context(*certificate, "test")
    assert handshake(server, client_context(TLS12, TLS13)).version() == "TLSv1.3"
    assert handshake(server, client_context(TLS12, TLS12)).version() == "TLSv1.2"


def test_min_version_tls13_refuses_a_tls_1_2_client(certificate: tuple[Path, Path]) -> None:
    server = tls_context(*certificate, "test", minimum="TLS13")
    assert handshake(server, client_context(TLS13, TLS13)).version() == "TLSv1.3"
    with pytest.raises(ssl.SSLError):
        handshake(server, client_context(TLS12, TLS12))


def test_max_version_tls12_keeps_a_client_to_tls_1_2(certificate: tuple[Path, Path]) -> None:
    server = tls_context(*certificate, "test", maximum="TLS12")
    assert handshake(server, client_context(TLS12, TLS13)).version() == "TLSv1.2"
    with pytest.raises(ssl.SSLError):
        handshake(server, client_context(TLS13, TLS13))
