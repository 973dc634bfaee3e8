"""What the probe reads of a vLLM server's ``/metrics`` (exporter/probe/): which series are engines, and which of
several served model names names the deployment."""

from __future__ import annotations

from collections.abc import Callable

from starlette.testclient import TestClient

from tests.helpers.exposition import info_labels
from tests.probe.test_probe import (  # noqa: F401  (serve_target: a fixture)
    TargetServer,
    failed,
    probed,
    prober,
    recorded_line,
    serve_target,
    serving,
    vllm_metrics,
)


def test_an_engine_label_of_more_than_five_digits_is_no_engine_index(
    prober: TestClient,  # noqa: F811
    serve_target: Callable[..., TargetServer],  # noqa: F811
) -> None:
    """vLLM numbers its engines from 0 within a server: a six-digit index is a broken or hostile target."""
    line = recorded_line("llama").replace('engine="0"', 'engine="123456"')
    target = serve_target(serving(vllm_metrics(line))).target
    failed(prober, target)


def test_of_several_served_model_names_the_first_in_order_names_the_deployment(
    prober: TestClient,  # noqa: F811
    serve_target: Callable[..., TargetServer],  # noqa: F811
) -> None:
    """The same server probed again is the same deployment, whichever order its series come in."""
    other_model = b'vllm:num_requests_waiting{engine="0",model_name="alpha-model"} 0.0\n'
    for body in (
        vllm_metrics(recorded_line("llama"), model_name="zeta-model") + other_model,
        other_model + vllm_metrics(recorded_line("llama"), model_name="zeta-model"),
    ):
        target = serve_target(serving(body)).target
        assert set(info_labels(probed(prober, target), "alpha-model")) == {"0"}
