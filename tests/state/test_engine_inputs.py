"""The writer's kept sync inputs (``exporter/state/engine_inputs.py``): a ready response of one engine of a DP=8
replica reads no sibling's response again and works out no sibling's figures again, and the replica it makes is the
one a sync from scratch makes. Driven on a writer batch directly, with fake clocks (``tests/helpers/batches.py``)."""

from __future__ import annotations

import pytest

from exporter.state import changes, engine_inputs
from exporter.state.changes import Rules
from exporter.state.engine_inputs import EngineInputs
from exporter.state.replicas import build_replica, engine_report
from protocol import EngineInput, engine_input
from tests.helpers.batches import KEY, RANK0, Clock, Fleet, ready

DP = 8
RANK0_RESPONSE = ready(0).response


def rules() -> Rules:
    return Rules({}, wall=Clock(1_800_000_000.0), monotonic=Clock(5_000.0))


def read(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The kept engines' responses read again from their bytes from now on (a miss of the kept inputs)."""
    calls: list[object] = []

    def counting(response: object) -> EngineInput:
        calls.append(response)
        return engine_input(response)  # type: ignore[arg-type]

    monkeypatch.setattr(engine_inputs, "engine_input", counting)
    return calls


def test_one_engines_response_reads_and_works_out_that_engine_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = Fleet(rules())
    before = fleet.ready(KEY, *(ready(rank, data_parallel_rank=rank, data_parallel_size=DP) for rank in range(DP)))
    assert before.replica is not None
    reads = read(monkeypatch)
    after = fleet.ready(KEY, ready(3, data_parallel_rank=3, data_parallel_size=DP, num_gpu_blocks=2500)).replica
    assert after is not None and reads == []
    kept = [rank for rank in range(DP) if after.synced.engines[rank] is before.replica.synced.engines[rank]]
    assert kept == [0, 1, 2, 4, 5, 6, 7]
    assert after.synced.engines[3].num_gpu_blocks == 2500
    scratch = build_replica(KEY, after.instance_id, dict(after.static_labels), after.heartbeat_seconds,
                            after.last_seen, after.engines, {}, seen=after.seen)  # fmt: skip
    assert after.synced == scratch.synced


def test_a_changed_static_label_works_out_every_engine_again() -> None:
    """The static labels move the replica-wide rule (here the configured mamba_block_size): no figure is kept."""
    fleet = Fleet(rules())
    before = fleet.ready(KEY, *(ready(rank, data_parallel_rank=rank, data_parallel_size=DP) for rank in range(DP)))
    assert before.replica is not None
    after = fleet.run(changes.static_labels, KEY, {"mamba_cache_mode": "none", "mamba_block_size": "4096"}, None)
    assert all(after.synced.engines[rank] is not before.replica.synced.engines[rank] for rank in range(DP))
    assert {figures.mamba_block_size for figures in after.synced.engines.values()} == {4096}


def test_the_same_static_labels_again_keep_the_replicas_config_and_engines_as_they_were() -> None:
    """A frontend sends its labels on every start, mostly unchanged: its replica keeps the same synced config and
    engines (the same objects), so its lines are not rendered again (``ReplicaLines`` keys them on both); a label
    that changes gives a new config."""
    fleet = Fleet(rules())
    labels = {"mamba_cache_mode": "none", "mamba_block_size": "4096"}
    fleet.run(changes.static_labels, KEY, labels, None)
    before = fleet.ready(KEY, *(ready(rank, data_parallel_rank=rank, data_parallel_size=DP) for rank in range(DP)))
    assert before.replica is not None
    again = fleet.run(changes.static_labels, KEY, dict(labels), None)
    assert again is not before.replica
    assert again.synced is before.replica.synced and again.engines is before.replica.engines
    changed = fleet.run(changes.static_labels, KEY, {**labels, "mamba_block_size": "2048"}, None)
    assert changed.synced != again.synced and changed.engines is again.engines
    assert {figures.mamba_block_size for figures in changed.synced.engines.values()} == {2048}


def test_the_inputs_kept_are_bounded_by_engines_the_replica_changed_longest_ago_going_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At the bound every replica's inputs stay; one engine past it, those of the replica kept first go."""
    kept = EngineInputs(kept=16)
    replicas = {name: {rank: engine_report(rank, 1.0, RANK0, "msgpack") for rank in range(count)}
                for name, count in (("a", 8), ("b", 8), ("c", 1))}  # fmt: skip
    for name in "ab":
        kept.keep(("d", name), replicas[name], {rank: engine_input(r.response()) for rank, r in replicas[name].items()})
    reads = read(monkeypatch)
    kept.of(("d", "a"), replicas["a"])
    kept.of(("d", "b"), replicas["b"])
    assert reads == [], "16 engines kept: every input is there"
    kept.keep(("d", "c"), replicas["c"], {0: engine_input(replicas["c"][0].response())})
    kept.of(("d", "b"), replicas["b"])
    assert reads == []
    kept.of(("d", "a"), replicas["a"])
    assert len(reads) == 8, "17 engines: the replica kept first went"


def test_an_input_is_read_again_once_its_engines_report_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    kept = EngineInputs()
    first = {0: engine_report(0, 1.0, RANK0, "msgpack")}
    kept.keep(KEY, first, {0: engine_input(first[0].response())})
    reads = read(monkeypatch)
    again = {0: engine_report(0, 2.0, RANK0, "msgpack")}  # the same bytes, heard again: another report
    assert kept.of(KEY, again) == {0: engine_input(RANK0_RESPONSE)}
    assert len(reads) == 1


def test_a_restart_reads_none_of_the_engines_it_drops(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server's start (a new instance) drops the replica's engines: their responses are not read, even where their
    inputs are no longer kept; a response of the same instance reads them."""
    fleet = Fleet(Rules({}, wall=Clock(1_800_000_000.0), monotonic=Clock(5_000.0), inputs=EngineInputs(kept=0)))
    fleet.ready(KEY, *(ready(rank, data_parallel_rank=rank, data_parallel_size=DP) for rank in range(DP)))
    reads = read(monkeypatch)
    restart = [ready(rank, data_parallel_rank=rank, data_parallel_size=DP, instance_id="run-1") for rank in range(DP)]
    assert fleet.ready(KEY, *restart).replica is not None
    assert reads == []
    fleet.ready(KEY, ready(2, data_parallel_rank=2, data_parallel_size=DP, instance_id="run-1", num_gpu_blocks=7))
    assert len(reads) == DP
