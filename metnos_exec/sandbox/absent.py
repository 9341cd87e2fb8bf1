"""The absent arm: the product's answer when an arm's engine is not installed here.

Absence is a verdict, never a stand-in that pretends a guest ran: every `run` raises
`ToolUnavailable` naming the missing arm and the arm(s) that could serve instead.
"""

from __future__ import annotations

from typing import final

from ..errors import ToolUnavailable
from ._types import AxisVerdict, ContainmentReport, SandboxJob, SandboxOutcome

__all__ = ("AbsentSandbox",)

_NOTHING_RAN = AxisVerdict("kept", "nothing runs: the arm is not installed")


@final
class AbsentSandbox:
    """Stands where an arm's engine is missing; refuses every job.

    Args:
        missing: the arm that would have served (e.g. ``"wasm"``).
        instead: arms that could serve this runtime instead (may be empty).
        hint: how to install the missing arm, for the person reading the error.
    """

    name = "absent"

    def __init__(self, missing: str, *, instead: tuple[str, ...] = (), hint: str = "") -> None:
        self.missing = missing
        self.instead = instead
        self.hint = hint

    def message(self) -> str:
        alt = (
            f"arm(s) that could serve instead: {', '.join(self.instead)}"
            if self.instead
            else "no other arm can serve this runtime"
        )
        tail = f" ({self.hint})" if self.hint else ""
        return f"the {self.missing} arm is not available here{tail}; {alt}"

    def containment(self, job: SandboxJob) -> ContainmentReport:
        """Every axis is trivially kept: no guest ever runs."""
        return ContainmentReport(
            sandbox="absent",
            files=_NOTHING_RAN,
            network=_NOTHING_RAN,
            process_tree=_NOTHING_RAN,
            user=_NOTHING_RAN,
            resources=_NOTHING_RAN,
        )

    async def run(self, job: SandboxJob) -> SandboxOutcome:
        """Refuse.

        Raises:
            ToolUnavailable: always.
        """
        raise ToolUnavailable(self.message())
