"""The status page and /docs in a real headless Chromium (Debian's), driven by Playwright, with JavaScript
off and every request watched: what a person sees, offline. The screenshots are kept as test artifacts."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from playwright.sync_api import Page, sync_playwright
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from exporter.config.settings import Settings
from exporter.server.app import create_app
from tests.helpers.ready_responses import push_ready
from tests.support import FIXTURES, ExporterProcess, require_binary

ARTIFACTS = Path(os.environ.get("TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))


@pytest.fixture
def exporter(start_exporter: Callable[..., ExporterProcess]) -> ExporterProcess:
    """An exporter with a hybrid model and a two-engine deployment whose engines disagree on the block sizes."""
    exporter = start_exporter()
    push_ready(exporter.url, "Qwen/Qwen3.6-35B-A3B", (FIXTURES / "hybrid-tp1-post50809.msgpack").read_bytes())
    push_ready(exporter.url, "dp2", (FIXTURES / "dp2-rank0.msgpack").read_bytes())
    other = msgspec.msgpack.decode((FIXTURES / "dp2-rank1.msgpack").read_bytes())
    push_ready(exporter.url, "dp2", msgspec.msgpack.encode({**other, "block_size": 528, "mamba_block_size": 528}))
    return exporter


@pytest.fixture
def browser_page(exporter: ExporterProcess) -> Iterator[tuple[Page, list[str]]]:
    """A Chromium page with JavaScript disabled, and every URL it requested."""
    chromium = require_binary("chromium")
    requested: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        context = browser.new_context(java_script_enabled=False, viewport={"width": 1200, "height": 900})
        page = context.new_page()
        page.on("request", lambda request: requested.append(request.url))
        yield page, requested
        browser.close()


def test_the_status_page_shows_true_block_sizes_disagreements_and_links(
    exporter: ExporterProcess, browser_page: tuple[Page, list[str]]
) -> None:
    page, requested = browser_page
    page.goto(f"{exporter.url}/")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "status-page.png"), full_page=True)
    text = page.inner_text("body")
    assert "2 deployment(s), 2 replica(s), 3 engine(s)." in text
    disagreements = page.inner_text("#disagreements")
    assert "dp2 · default: block_size differs (engine 0: 1056, engine 1: 528)" in disagreements
    assert "the lowest engine index's 1056 is published" in disagreements
    qwen = page.locator("section.deployment", has_text="Qwen/Qwen3.6-35B-A3B")
    assert "block_size 1056, mamba_block_size 1056" in qwen.inner_text()
    assert "reporting: 1 of 1" in qwen.inner_text()
    assert qwen.locator("td").nth(1).inner_text() == "1056"
    assert "UTC" in qwen.locator("td time").inner_text()
    # The disagreeing engine's cells stand out (bold on red) for the reader.
    flagged = page.locator("section.deployment", has_text="dp2").locator("td.differs")
    assert flagged.all_inner_texts() == ["528", "528"]
    assert flagged.first.evaluate("cell => getComputedStyle(cell).fontWeight") == "700"

    qwen.get_by_role("link", name="JSON").click()
    assert '"block_size":"1056"' in page.inner_text("body")
    page.go_back()
    page.get_by_role("link", name="Metrics").click()
    metrics = page.inner_text("body")
    assert 'cache_config_block_size{deployment="Qwen/Qwen3.6-35B-A3B",replica="default",engine="0"} 1056.0' in metrics
    assert all(url.startswith(exporter.url) for url in requested), f"requests off the exporter: {requested}"


def test_docs_work_offline_without_javascript(exporter: ExporterProcess, browser_page: tuple[Page, list[str]]) -> None:
    page, requested = browser_page
    page.goto(f"{exporter.url}/docs")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "docs.png"), full_page=True)
    rows = page.locator("tr").all_inner_texts()
    assert any("POST" in row and "/api/v1/deployments/{deployment}/ready" in row for row in rows)
    assert len(rows) > 8
    page.get_by_role("link", name="OpenAPI document (JSON)").click()
    assert '"openapi"' in page.inner_text("body")
    assert all(url.startswith(exporter.url) for url in requested), f"requests off the exporter: {requested}"


def test_the_cached_page_follows_every_change_and_its_ages(tmp_path: Path) -> None:
    """The page is built once per state version and 5 s step (its "ago" texts), never served stale."""
    now = [1_000_000.0]
    settings = Settings(storage_path=tmp_path / "exporter.db")
    with TestClient(create_app(settings, registry=CollectorRegistry(), clock=lambda: now[0])) as client:
        payload = (FIXTURES / "hybrid-tp1-post50809.msgpack").read_bytes()
        headers = {"Content-Type": "application/msgpack"}
        assert client.post("/api/v1/deployments/first/ready", content=payload, headers=headers).status_code == 200
        page = client.get("/").text
        assert "first" in page and "(0 s ago)" in page
        assert client.get("/").text == page  # the same state and time: the same bytes
        assert client.post("/api/v1/deployments/second/ready", content=payload, headers=headers).status_code == 200
        assert "second" in client.get("/").text
        now[0] += 60
        assert "(60 s ago)" in client.get("/").text
        assert client.delete("/api/v1/deployments/first").status_code == 204
        assert "first" not in client.get("/").text
