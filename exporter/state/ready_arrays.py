"""One replica's engines' ready responses taken in an array's order, at a cost linear in their number.

An array (up to 1,024 engines of a replica, a data-parallel server's start) is taken as if each response came
alone, in order: a new ``instance_id`` drops the engines before it, an engine's later response replaces its
earlier one, a refused one changes nothing and the next ones go on. Taken literally, each response would be a
sync and a measure of the whole replica: quadratic, seconds of the writer thread for a large array, and every
read waiting for the writer waits with it. So one pass (``ReadyArray.take``) checks what can refuse a response
against running totals, each check in constant time:

- the caps (``Limits``): a count of the engines, and whether the replica is new;
- the engines' agreement, the sync's only refusal (``check_agreement``): the ``agreement`` values of their sync
  inputs are counted, one engine standing for each distinct set of them, so a check looks at a handful of inputs;
  engines that agree have few such sets;
- the byte budget (``within_budget``): the replica the pass makes is measured once. Only past the budget is the
  array cut where it crosses: the replica of its first *k* responses taken is measured for a few *k* (``crossing``:
  the first guessed, as an engine's lines take about as much as the next one's; then steps of one, two, four...
  responses from it; then bisection), until *k* fits and *k* + 1 does not. Response *k* + 1 is refused as taking
  the replica past the budget, and every later one the other checks would take as finding it at the budget.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from exporter.errors import Refused
from exporter.state.engine_inputs import EngineInputs
from exporter.state.limits import ByteBudget, Limits
from exporter.state.replicas import EngineReport, Replica, ReplicaKey, engine_report
from exporter.state.writer import Batch
from protocol import EngineCoreReadyResponse, EngineInput, InvalidPayload, check_agreement, engine_input, is_set

AgreementValues = tuple[object, ...]


class EngineReady(NamedTuple):
    """One engine's ready response as received: decoded, and its bytes with their wire format; ``shown``, the
    bytes as JSON when the decode made them (``decode_shown_ready_response``), so they are not made again."""

    engine: int
    response: EngineCoreReadyResponse
    payload: bytes
    wire_format: str
    shown: bytes | None = None


class Agreement:
    """The engines' agreement values, counted, with an engine's input standing for each distinct set: ``check``
    refuses as ``check_agreement`` over every engine would, looking only at those standing for them."""

    def __init__(self, inputs: Mapping[int, EngineInput]) -> None:
        self._values_of: dict[int, AgreementValues] = {}
        self._engines_with: Counter[AgreementValues] = Counter()
        self._standing: dict[AgreementValues, EngineInput] = {}
        for engine, held in inputs.items():
            self.put(engine, held)

    def check(self, engine: int, given: EngineInput) -> None:
        """Raise the protocol's ``SyncConflict`` where the other engines contradict ``given`` as ``engine``'s
        input. The engines taken agree, and so do the others: one with the same values adds none."""
        values, replaced = given.agreement, self._values_of.get(engine)
        if self._engines_with[values] - (values == replaced) > 0:
            return
        others = [self._standing[held] for held, count in self._engines_with.items()
                  if count - (held == replaced) > 0]  # fmt: skip
        check_agreement([*others, given])

    def put(self, engine: int, given: EngineInput) -> None:
        """``given`` is ``engine``'s input now, replacing its earlier one."""
        values, replaced = given.agreement, self._values_of.get(engine)
        if replaced is not None:
            self._engines_with[replaced] -= 1
            if not self._engines_with[replaced]:
                del self._engines_with[replaced], self._standing[replaced]
        self._values_of[engine] = values
        self._engines_with[values] += 1
        self._standing.setdefault(values, given)


@dataclass
class Taken:
    """What a pass over an array took: the replica's instance and engines after it (with their sync inputs once it
    took a response), the engines whose response it gave (to be stored, in the order first taken), and each refused
    engine's reason."""

    instance_id: str | None
    engines: dict[int, EngineReport]
    inputs: dict[int, EngineInput]
    refused: dict[int, Exception] = field(default_factory=dict)
    saved: dict[int, None] = field(default_factory=dict)
    accepted: int = 0
    # A restart (a new instance) dropped engines the store holds: their rows are deleted first.
    drops_stored: bool = False


class Cut(NamedTuple):
    """Where an array is cut at the byte budget: after ``most`` responses taken, the next one the other checks
    would take is refused with ``crossing``, every later one with ``after``."""

    most: int
    crossing: Exception
    after: Exception


class ReadyArray:
    """A replica's array of ready responses on a batch, taken in its order by ``take``; ``now`` is when they
    arrived (Unix seconds); ``inputs``, the writer's kept sync inputs of the engines the replica holds."""

    def __init__(
        self,
        limits: Limits,
        batch: Batch,
        key: ReplicaKey,
        reports: Sequence[EngineReady],
        now: float,
        inputs: EngineInputs,
    ) -> None:
        self.limits = limits
        self.batch = batch
        self.key = key
        self.reports = reports
        self.now = now
        self.current = batch.get(key)
        # The sync inputs of the replica's engines as committed: read once a pass needs them (for a response that
        # does not restart the replica), then the same in every pass. A restart (a server's start) drops them unread.
        self._held = inputs
        self._kept: dict[int, EngineInput] | None = None
        # Each response's sync input, and its engine's report once taken: the same in every pass.
        self._inputs = [engine_input(report.response) for report in reports]
        self._engine_reports: dict[int, EngineReport] = {}

    def take(self, cut: Cut | None = None) -> Taken:
        """One pass over the responses, each checked as if it came alone after those taken before it."""
        current = self.current
        taken = Taken(current.instance_id if current else None, dict(current.engines) if current else {}, {})
        # The engines' agreement: with the committed engines' inputs once a response that keeps them needs it.
        agreement: Agreement | None = None
        past_cut = 0
        for place, report in enumerate(self.reports):
            given = self._inputs[place]
            try:
                restart = self._restarts(taken, report)
                if not restart:
                    if agreement is None:
                        taken.inputs.update(self._kept_inputs())
                        agreement = Agreement(taken.inputs)
                    self._check(taken, agreement, report, given)
                if cut is not None and taken.accepted >= cut.most:
                    past_cut += 1
                    raise cut.crossing if past_cut == 1 else cut.after
            except (Refused, InvalidPayload) as error:
                taken.refused[report.engine] = error
                continue
            if restart:
                taken.instance_id = report.response.instance_id
                taken.drops_stored = taken.drops_stored or bool(current is not None and current.engines)
                taken.engines.clear()
                taken.inputs.clear()
                taken.saved.clear()
                agreement = Agreement({})
            taken.engines[report.engine] = self._engine_report(place)
            taken.inputs[report.engine] = given
            taken.saved[report.engine] = None
            assert agreement is not None  # a restart made it, or the check of a response that keeps the engines
            agreement.put(report.engine, given)
            taken.accepted += 1
            taken.refused.pop(report.engine, None)
        return taken

    def _restarts(self, taken: Taken, report: EngineReady) -> bool:
        """Whether ``report`` restarts the replica (a new instance); refused where taking it next would be as a new
        replica or its first engine."""
        if self.current is None and not taken.accepted:
            self.limits.check_new_replica(self.batch, self.key)
        instance_id = report.response.instance_id
        if is_set(instance_id) and instance_id != taken.instance_id:  # it alone is left: it agrees with itself
            self.limits.check_new_engine(self.key, 0)
            return True
        return False

    def _check(self, taken: Taken, agreement: Agreement, report: EngineReady, given: EngineInput) -> None:
        """Refuse ``report``, which keeps the replica's engines, where taking it next would be refused."""
        if report.engine not in taken.engines:
            self.limits.check_new_engine(self.key, len(taken.engines))
        agreement.check(report.engine, given)

    def _kept_inputs(self) -> dict[int, EngineInput]:
        if self._kept is None:
            self._kept = self._held.of(self.key, self.current.engines) if self.current else {}
        return self._kept

    def _engine_report(self, place: int) -> EngineReport:
        report = self._engine_reports.get(place)
        if report is None:
            ready = self.reports[place]
            report = self._engine_reports[place] = engine_report(ready.engine, self.now, ready.payload,
                                                                 ready.wire_format, ready.shown)  # fmt: skip
        return report


class Measured(NamedTuple):
    """The replica of an array cut after ``most`` responses taken (``None``: nothing taken) and what it takes."""

    most: int
    replica: Replica | None
    size: int


def within_budget(
    budget: ByteBudget, array: ReadyArray, taken: Taken, replica_of: Callable[[Taken], Replica]
) -> tuple[Taken, Replica | None, int]:
    """The pass ``taken``, its replica and what that takes, when it fits the budget; else the same of the array
    cut where it crosses the budget (see the module's docstring). The replica is ``None`` when nothing fits."""
    batch, key = array.batch, array.key
    updated = replica_of(taken)
    room = budget.room(batch, key)
    whole = Measured(taken.accepted, updated, budget.measure(updated))
    if whole.size <= room:
        return taken, updated, whole.size

    def measured(most: int) -> Measured:
        replica = replica_of(array.take(Cut(most, budget.full(batch, key), budget.full(batch, key))))
        return Measured(most, replica, budget.measure(replica))

    fits, crosses = crossing(Measured(0, None, batch.size(key)), whole, room, measured)
    cut = array.take(Cut(fits.most, budget.past(batch, key, crosses.size), budget.full(batch, key)))
    return cut, fits.replica, fits.size


def crossing(
    fits: Measured, crosses: Measured, room: int, measured: Callable[[int], Measured]
) -> tuple[Measured, Measured]:
    """Where the sizes cross ``room`` between ``fits`` (within it) and ``crosses`` (past it): a cut that fits and
    the one a response later that does not, measuring about 2 log2 of the responses between them at most.

    The first cut measured is guessed, the sizes taken to grow evenly from one to the other (two measures, when
    the guess is right); from it, the cuts one, two, four... responses further on its side of the crossing until
    one is on the other side; then bisection between the two."""
    most = fits.most + (room - fits.size) * (crosses.most - fits.most) // (crosses.size - fits.size)
    step, galloping, upwards = 1, True, None
    while crosses.most - fits.most > 1:
        probe = measured(min(max(most, fits.most + 1), crosses.most - 1))
        fit = probe.size <= room
        if fit:
            fits = probe
        else:
            crosses = probe
        upwards = fit if upwards is None else upwards
        galloping = galloping and fit == upwards
        if galloping:
            most, step = (fits.most + step if upwards else crosses.most - step), step * 2
        else:
            most = (fits.most + crosses.most) // 2
    return fits, crosses
