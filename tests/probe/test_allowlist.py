"""Which targets ``--probe.allowed-targets`` lets the exporter fetch (exporter/probe/allowlist.py), as Prometheus
writes them."""

from __future__ import annotations

from collections.abc import Callable

from starlette.testclient import TestClient

from tests.probe.test_probe import (  # noqa: F401  (serve_target: a fixture)
    TargetServer,
    probed,
    recorded_line,
    serve_target,
    vllm_target,
)


def test_a_name_pattern_permits_the_name_in_any_case(
    make_client: Callable[..., TestClient],
    serve_target: Callable[..., TargetServer],  # noqa: F811
) -> None:
    """DNS names know no case: a target written in capitals (as a service discovery may) is the same name."""
    port = vllm_target(serve_target, recorded_line("llama")).rpartition(":")[2]
    client = make_client(probe_allowed_targets=("localhost:*",))
    probed(client, f"LocalHost:{port}")
