"""One chaos scenario's result as a table row: the counts, what clients saw, the checks."""

from __future__ import annotations

from dataclasses import dataclass, field

from loadtest.chaos_load import Tally

HEADER = (
    "| scenario | sent | succeeded | failed | hung | what clients saw | checks | verdict |\n"
    "|---|---:|---:|---:|---:|---|---|---|"
)


@dataclass(slots=True)
class Row:
    """A scenario's counts and checks; it passed when every check held."""

    scenario: str
    sent: int
    succeeded: int
    failed: int
    hung: int
    client_saw: str
    checks: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # the checks that did not hold
    examples: dict[str, str] = field(default_factory=dict)  # what came back, per failure kind
    seen: dict[str, int] = field(default_factory=dict)  # everything clients saw, counted
    seconds: float = 0.0

    @classmethod
    def of(cls, scenario: str, tally: Tally) -> Row:
        row = tally.row()
        return cls(
            scenario,
            int(row["sent"]),
            int(row["succeeded"]),
            int(row["failed"]),
            int(row["hung"]),
            str(row["client saw"]),
            examples=tally.examples(),
            seen=dict(tally.seen()),
        )

    def check(self, holds: bool, fact: str) -> None:
        self.checks.append(fact)
        if not holds:
            self.failures.append(fact)

    def markdown(self) -> str:
        verdict = "pass" if not self.failures else "FAIL: " + "; ".join(self.failures)
        cells = [self.scenario, self.sent, self.succeeded, self.failed, self.hung]
        cells += [self.client_saw or "—", "; ".join(self.checks), verdict]
        return "| " + " | ".join(" ".join(str(c).replace("|", "/").split()) for c in cells) + " |"
