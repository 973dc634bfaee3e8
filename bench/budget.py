"""How many engines the byte budget holds: vLLM servers of DP=8 sent to an exporter until its ``--limits.bytes``
refuses one.

python -m bench.budget [--mib 16] [--fixture dp2-rank0 --fixture hybrid-tp4-post50809]

For each fixture (a ready response of ``tests/fixtures/vllm-ready/``) a fresh exporter with a budget of ``--mib``
MiB gets what the plugin sends as each server starts (its frontend's labels, then its eight engines' ready
responses as one msgpack array), one server after another, until a 429. Printed: the engines taken and the
engines a MiB of budget holds, from which the budget of a fleet follows.
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import msgspec

from bench.fleet import STATIC_LABELS, replica_names
from bench.load import DATA_PARALLEL, FIXTURE, MSGPACK
from bench.procs import HOST, Server

FIXTURES = FIXTURE.parent
# The bench's engine (dense) and a hybrid model's.
MEASURED = ["dp2-rank0", "hybrid-tp4-post50809"]
# More servers than any budget of a run holds: the run stops at the first 429 long before.
MOST_SERVERS = 1_000_000


def _ready_array(fixture: dict[str, object], server: int) -> bytes:
    """A DP=8 server's eight ready responses, as one msgpack array."""
    return msgspec.msgpack.encode(
        [
            {**fixture, "data_parallel_size": DATA_PARALLEL, "data_parallel_rank": rank, "instance_id": f"run-{server}"}
            for rank in range(DATA_PARALLEL)
        ]
    )


def engines_within(fixture: dict[str, object], budget: int, workdir: Path) -> tuple[int, str]:
    """The engines an exporter with ``budget`` bytes takes before refusing a server, and the refusal's detail."""
    command = [sys.executable, "-m", "exporter", "serve", "--storage.path", str(workdir / "budget.db"),
               "--log.level", "warning", "--limits.bytes", str(budget), "--web.listen-address"]  # fmt: skip
    with Server("exporter", lambda port: [*command, f"{HOST}:{port}"], "/-/healthy", workdir) as exporter:
        connection = http.client.HTTPConnection(HOST, exporter.port, timeout=60)
        labels = json.dumps(STATIC_LABELS).encode()
        for server, (deployment, replica) in enumerate(replica_names(MOST_SERVERS)):
            base = f"/api/v1/deployments/{deployment}"
            for method, path, headers, body in (
                ("PUT", f"{base}/cache-config?replica={replica}", {"Content-Type": "application/json"}, labels),
                ("POST", f"{base}/ready?replica={replica}", MSGPACK, _ready_array(fixture, server)),
            ):
                connection.request(method, path, body, headers)
                response = connection.getresponse()
                answer = response.read()
                if response.status == 429:
                    return server * DATA_PARALLEL, json.loads(answer).get("detail", "")
                if response.status != 200:
                    raise RuntimeError(f"{method} {path}: HTTP {response.status}: {answer[:300]!r}")
    raise RuntimeError(f"{MOST_SERVERS} servers fit in {budget} bytes")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.budget", description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=16, help="the budget of each exporter, MiB")
    parser.add_argument("--fixture", action="append", help=f"a fixture's name (default: {', '.join(MEASURED)})")
    args = parser.parse_args(argv)
    for name in args.fixture or MEASURED:
        fixture = msgspec.msgpack.decode((FIXTURES / f"{name}.msgpack").read_bytes())
        with tempfile.TemporaryDirectory(prefix="cce-budget-") as tmp:
            engines, detail = engines_within(fixture, args.mib << 20, Path(tmp))
        print(f"{name}: {engines} engines of DP=8 servers in {args.mib} MiB: {engines / args.mib:.0f} engines a MiB")
        print(f"  the 429: {detail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
