"""What a wide probe target costs the exporter's memory: at most eight times its body at the peak (the answer
of 1,024 engines of 128 labels is half as large again as the body), kept for the next probe rather than grown
again (a real exporter process, its ``/proc`` figures; stand-in targets on loopback)."""

from __future__ import annotations

import string
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers.exposition import single_value
from tests.helpers.figures import record
from tests.helpers.processes import memory_kib
from tests.probe import hostile
from tests.probe.test_probe import recorded_line, vllm_metrics
from tests.support import ExporterProcess, wait_until

ENGINES = 1024
# The peak a probe may add, as a multiple of the body it reads (docs/probe.md states it).
PEAK_PER_BODY_BYTE = 8
# What the process may keep after the answer: allocator pages, not the probe's data.
KEPT_AFTER_KIB = 16 << 10


def wide_metrics(labels: int) -> bytes:
    """1,024 engines, each with its recorded ``vllm:cache_config_info`` labels and more up to ``labels``."""
    line = recorded_line("qwen3-next")
    names = (first + second for first in string.ascii_letters for second in string.ascii_letters + string.digits)
    more = "".join(f'{name}="",' for name, _ in zip(names, range(labels - line.count('="') + 1), strict=False))
    return vllm_metrics(*(recorded_line("qwen3-next", engine).replace("{", "{" + more, 1) for engine in range(ENGINES)))


@pytest.fixture
def exporter(start_exporter: Callable[..., ExporterProcess]) -> Iterator[ExporterProcess]:
    exporter = start_exporter("--probe.allowed-targets", "127.0.0.0/8")
    with hostile.hostile(hostile.serving(vllm_metrics(recorded_line("qwen3-next")))) as warm:
        assert hostile.probe(exporter.url, warm.target)[0].status == 200  # the probe's code paths loaded
    yield exporter


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM starts again from VmRSS


@pytest.mark.slow  # a real process probing bodies of 1.7 and 7.1 MB: about 5 s
@pytest.mark.parametrize(("labels", "success"), [(128, 1.0), (1000, 0.0)], ids=["128 labels", "1000 labels"])
def test_a_wide_target_costs_at_most_eight_times_its_body_and_keeps_little(
    exporter: ExporterProcess, labels: int, success: float, record_property: Callable[[str, object], None]
) -> None:
    """1,000 labels an engine (7.7 MB) is more than a label map may have: refused at its first line. 128 (the
    most) is read whole."""
    body = wide_metrics(labels)
    assert len(body) <= 8 << 20
    pid = exporter.process.pid
    with hostile.hostile(hostile.serving(body)) as wide:
        before = memory_kib(pid)["VmRSS"]
        reset_peak(pid)
        reply, seconds = hostile.probe(exporter.url, wide.target)
        assert single_value(reply.body.decode(), "cache_config_probe_success") == success
        peak = memory_kib(pid)["VmHWM"] - before
        wait_until(lambda: memory_kib(pid)["VmRSS"] - before <= KEPT_AFTER_KIB, timeout=10)
        kept = memory_kib(pid)["VmRSS"] - before
    record(record_property, f"probe_memory_{labels}_labels", body_mib=round(len(body) / 2**20, 2),
           peak_mib=round(peak / 1024, 1), kept_mib=round(kept / 1024, 1), seconds=round(seconds, 2))  # fmt: skip
    assert peak <= PEAK_PER_BODY_BYTE * len(body) / 1024, f"{peak} KiB at the peak for a {len(body)}-byte body"
