"""One exception root with a stable machine-readable code and a sentence for a person.

Job failures (`MetnosError` subclasses) and host faults (`HostFault`) are different types:
a job failure is an honest verdict about a job; a host fault means the harness itself broke
and no verdict can be given. Code that catches one must never turn it into the other.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = (
    "AutonomyDenied",
    "BadArguments",
    "BadManifest",
    "BadMessage",
    "BadOutput",
    "CapabilityDenied",
    "HostFault",
    "MetnosError",
    "SandboxDenied",
    "SandboxRequired",
    "SignatureError",
    "ToolUnavailable",
    "UnknownExecutor",
    "UndoConflict",
)


class MetnosError(Exception):
    """Root of every error metnos-exec raises on purpose.

    Attributes:
        code: stable machine-readable code (``E_...``); scripts and agents match on it.
        message: one sentence a person can act on.
    """

    code: ClassVar[str] = "E_INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class BadManifest(MetnosError):
    """A manifest could not be loaded; the message names the file, the field and why."""

    code = "E_BAD_MANIFEST"


class BadArguments(MetnosError):
    """The job's arguments do not fit the executor's schema (unknown, missing, wrong type)."""

    code = "E_BAD_ARGS"


class AutonomyDenied(MetnosError):
    """The autonomy level refuses this executor (e.g. a mutating one under ``read_only``)."""

    code = "E_AUTONOMY"


class UnknownExecutor(MetnosError):
    code = "E_UNKNOWN_EXECUTOR"


class CapabilityDenied(MetnosError):
    """Argument vetting refused the job before anything was launched."""

    code = "E_CAPABILITY_DENIED"


class SandboxRequired(MetnosError):
    """Policy forbids running this executor without its kernel wall, and the wall is down."""

    code = "E_SANDBOX_REQUIRED"


class SandboxDenied(MetnosError):
    """The sandbox refused what the guest asked for at set-up (e.g. a wasm socket import)."""

    code = "E_SANDBOX_DENIED"


class ToolUnavailable(MetnosError):
    """The arm's engine is not installed here; the message names the arm(s) that could serve."""

    code = "E_TOOL_UNAVAILABLE"


class BadOutput(MetnosError):
    code = "E_BAD_OUTPUT"


class BadMessage(MetnosError):
    code = "E_BAD_MESSAGE"


class SignatureError(MetnosError):
    code = "E_SIGNATURE"


class UndoConflict(MetnosError):
    code = "E_UNDO_CONFLICT"


class HostFault(Exception):
    """The harness itself broke (a pipe it cannot read, a counter it cannot read, ...).

    Never converted into a default value: "empty output" or "not exhausted" invented to
    cover a failure is a lie to whoever trusts the result.
    """

    code: ClassVar[str] = "E_HOST_FAULT"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"
