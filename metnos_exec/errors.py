"""One exception root with a stable machine-readable code and a sentence for a person.

Job failures (`MetnosError` subclasses) and host faults (`HostFault`) are different types:
a job failure is an honest verdict about a job; a host fault means the harness itself broke
and no verdict can be given. Code that catches one must never turn it into the other.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = (
    "AutonomyDenied",
    "ERROR_CODES",
    "BadArguments",
    "BadConfig",
    "BadManifest",
    "CheckpointUnknown",
    "BadMessage",
    "BadOutput",
    "BrokerAuth",
    "BrokerBusy",
    "BrokerCorrupt",
    "BrokerError",
    "BrokerFull",
    "BrokerGone",
    "BrokerReadOnly",
    "BrokerUnavailable",
    "SubmitOutcomeUnknown",
    "CapabilityDenied",
    "CommitConflict",
    "HostFault",
    "IdempotencyConflict",
    "MetnosError",
    "MissingFolder",
    "SandboxDenied",
    "SandboxRequired",
    "ServerPinned",
    "SignatureError",
    "SymlinkedFolder",
    "ToolUnavailable",
    "UnknownExecutor",
    "UndoConflict",
    "UndoUnavailable",
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


class MissingFolder(MetnosError):
    """A vetted path lies under an ``fs:*`` hint whose folder does not exist.

    The kernel wall mounts each hint's folder; a missing one cannot be mounted, so the
    guest would meet a read-only or absent tree. Refused before launch with the fix.
    """

    code = "E_MISSING_FOLDER"


class SymlinkedFolder(MetnosError):
    """A folder the job would mount (an ``fs:*`` hint's, a skill's home, the executor's)
    is reached through a symlink, so it is not the folder it claims to be.

    Mounting it would hand the job whatever the link points at (another job may have
    planted it). Refused before anything runs; the message names the link.
    """

    code = "E_SYMLINKED_FOLDER"


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


class ServerPinned(MetnosError):
    """The executor may only run on a server worker (not packable, or provider authority):
    refused at submit for a device target when the broker knows the executor, and by a
    device worker that leases such a job anyway."""

    code = "E_SERVER_PINNED"


class SignatureError(MetnosError):
    """An executor's signature is missing, by an untrusted key, or does not match its files
    (the message names the file that differs); the job is refused before it is planned."""

    code = "E_SIGNATURE"


class UndoConflict(MetnosError):
    """An undo would overwrite changes made after the job; nothing was changed. The
    message names the files."""

    code = "E_UNDO_CONFLICT"


class UndoUnavailable(MetnosError):
    """There is nothing to undo for that job here: no result yet, no recorded change, its
    entries were purged, it was already undone, or it was made on another device."""

    code = "E_UNDO_UNAVAILABLE"


class CheckpointUnknown(MetnosError):
    """No checkpoint of that name on that device (never made, or made on another)."""

    code = "E_CHECKPOINT_UNKNOWN"


class CommitConflict(MetnosError):
    """A staged job's changes were not committed because the host changed a target while
    it ran; nothing was applied. The message names the files."""

    code = "E_COMMIT_CONFLICT"


class ApprovalUnavailable(MetnosError):
    """No approval gate of that job can be answered here: it is not awaiting approval
    (unknown, still running, already approved, rejected or expired), or its staged changes
    are not kept on this worker (the message says why); nothing was changed."""

    code = "E_APPROVAL_UNAVAILABLE"


class ApprovalRefused(MetnosError):
    """A job's gate was rejected (``E_APPROVAL_REJECTED``) or expired unanswered
    (``E_APPROVAL_EXPIRED``): its staged changes were discarded, nothing was committed."""

    code = "E_APPROVAL_REJECTED"


class BadConfig(MetnosError):
    """An operator setting (environment variable, worker option) is invalid; nothing ran."""

    code = "E_CONFIG"


class IdempotencyConflict(MetnosError):
    """An idempotency key was reused for a different executor or different arguments.

    Attributes:
        original_job_id: the job the key already names.
    """

    code = "E_IDEMPOTENCY_CONFLICT"

    def __init__(self, message: str, *, original_job_id: str = "") -> None:
        super().__init__(message)
        self.original_job_id = original_job_id


class BrokerError(MetnosError):
    """The broker's store failed; no job verdict is implied (root of the ``E_BROKER_*``).

    Every broker raises only these for a store failure, never its client library's own
    exceptions (``sqlite3.OperationalError``, a Redis connection error, ...).

    Attributes:
        retry: worth trying the same operation again later (a lock, a full disk, a
            restarting server); a worker then keeps its results and backs off.
        fatal: the store this broker was opened on is no longer there or no longer
            readable; a worker stops rather than serve it.
    """

    code = "E_BROKER_UNAVAILABLE"
    retry: ClassVar[bool] = True
    fatal: ClassVar[bool] = False


class BrokerUnavailable(BrokerError):
    """The store cannot be reached or used (cannot open, I/O error, closed, too old)."""

    code = "E_BROKER_UNAVAILABLE"


class SubmitOutcomeUnknown(BrokerUnavailable):
    """A submit was sent and its answer never came (a timeout, a connection dropped
    mid-call): the job may or may not be queued. Its id (`job_id`) is its idempotency
    key: submitting the same id again queues nothing twice, and the result or `status`
    of that id says what happened.

    Attributes:
        job_id: the id the job was sent with (the first one, for several).
    """

    code = "E_SUBMIT_UNKNOWN"

    def __init__(self, message: str, job_id: str = "") -> None:
        super().__init__(message)
        self.job_id = job_id


class BrokerBusy(BrokerError):
    """Another process held the store's write lock longer than the broker waits."""

    code = "E_BROKER_BUSY"


class BrokerFull(BrokerError):
    """The store is out of space (disk, quota, file size limit, Redis maxmemory)."""

    code = "E_BROKER_FULL"


class BrokerReadOnly(BrokerError):
    """The store refuses writes (read-only file or file system, a read-only replica)."""

    code = "E_BROKER_READONLY"


class BrokerAuth(BrokerError):
    """The store refused this client: a wrong or missing password, an unknown or disabled
    user, or an ACL that forbids a command or key the queue needs (Redis ``WRONGPASS``,
    ``NOAUTH``, ``NOPERM``). The message never holds the password.

    Retried like an outage: the server's credentials may be fixed while a worker waits
    (a worker keeps its results and says it once, with reminders)."""

    code = "E_BROKER_AUTH"


class BrokerGone(BrokerError):
    """The store was deleted or replaced under the broker (the path names another file).

    Serving on would write to a file nobody else sees (split brain): fatal.
    """

    code = "E_BROKER_GONE"
    retry = False
    fatal = True


class BrokerCorrupt(BrokerError):
    """The store holds data that cannot be read (a damaged file, a foreign write)."""

    code = "E_BROKER_CORRUPT"
    retry = False
    fatal = True


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


#: Every error code metnos-exec can emit (in a `Result`, a dead letter, a log record or an
#: exception), with one line on what it means. ``metnos-exec codes`` prints this table; a
#: test keeps it in step with the ``"E_..."`` literals in the package source.
ERROR_CODES: dict[str, str] = {
    # refused before anything ran
    "E_BAD_MESSAGE": "the job message is malformed (not JSON, wrong field types, bad version)",
    "E_BAD_ARGS": "the arguments do not fit the executor's schema",
    "E_UNKNOWN_EXECUTOR": "no worker on the queue serves an executor of that name",
    "E_BAD_MANIFEST": "an executor's manifest could not be loaded",
    "E_AUTONOMY": "the autonomy level refuses this executor (or is unknown)",
    "E_CAPABILITY_DENIED": "argument vetting refused the job (a path or URL outside its hints)",
    "E_MISSING_FOLDER": "a path argument's fs hint folder does not exist, so it cannot be mounted",
    "E_SYMLINKED_FOLDER": "a folder the job would mount is reached through a symlink",
    "E_SANDBOX_REQUIRED": "policy forbids running without the kernel sandbox, which is down",
    "E_SANDBOX_DENIED": "the sandbox refused what the guest asked for at set-up",
    "E_TOOL_UNAVAILABLE": "the arm's engine (e.g. wasmtime) is not installed on this worker",
    "E_RUNTIME_MISMATCH": "the module does not match the runtime its manifest declares",
    "E_SERVER_PINNED": "the executor may only run on a server worker, not on this device",
    "E_SIGNATURE": "the executor is unsigned, signed by an untrusted key, or changed since signing",
    # the job ran and ended badly
    "E_EXIT": "the executor exited with a non-zero code",
    "E_KILLED": "the executor was killed by a signal (a limit, or from outside)",
    "E_TIMEOUT": "the executor exceeded its wall-time budget",
    "E_MEMORY": "the executor exceeded its memory budget",
    "E_FUEL": "the wasm guest ran out of fuel (its CPU budget)",
    "E_TRAP": "the guest trapped (a wasm trap, or a native guest that tampered with its sandbox)",
    "E_FAILED": "the executor ended in an unexpected way",
    "E_BAD_OUTPUT": "the executor's stdout is not the JSON its result must be",
    "E_TEMPFAIL": "a transient failure; the job is retried with backoff",
    "E_CANCELLED": "the job was cancelled on request",
    "E_LEASE_EXPIRED": "the job's worker was lost on its last allowed attempt",
    "E_DISK": "the job exceeded its disk budget (limits.disk_mb); nothing was committed",
    "E_COMMIT_CONFLICT": "a file the job changed was changed on the host while it ran; "
    "nothing was committed",
    "E_UNDO_CONFLICT": "an undo would overwrite changes made after the job; nothing changed",
    "E_UNDO_UNAVAILABLE": "nothing to undo: no result, no recorded change, purged, already "
    "undone, or another device's",
    "E_CHECKPOINT_UNKNOWN": "no checkpoint of that name on that device (never made there)",
    "E_APPROVAL_UNAVAILABLE": "no approval gate to answer here (not awaiting, not kept), or "
    "a gated job cannot be staged",
    "E_APPROVAL_REJECTED": "the job's changes were rejected (or another branch approved); "
    "nothing committed",
    "E_APPROVAL_EXPIRED": "nobody answered the job's approval gate in time; its changes were "
    "discarded",
    # configuration, queue and host
    "E_CONFIG": "an operator setting (environment variable, worker option) is invalid",
    "E_BAD_BROKER_URL": "the broker URL names no known broker or is malformed",
    "E_BROKER_UNAVAILABLE": "the broker's store cannot be reached or used (missing, I/O error)",
    "E_SUBMIT_UNKNOWN": "a submit's answer was lost: the job may be queued (resubmit its id: "
    "no duplicate)",
    "E_BROKER_BUSY": "another process held the queue's write lock longer than the broker waits",
    "E_BROKER_FULL": "the broker's store is out of space (disk full, quota, file size limit)",
    "E_BROKER_READONLY": "the broker's store refuses writes (read-only file or file system)",
    "E_BROKER_AUTH": "the broker refused this client: wrong or missing password, unknown user, "
    "or an ACL",
    "E_BROKER_GONE": "the queue file was deleted or replaced while in use; the worker stopped",
    "E_BROKER_CORRUPT": "the broker's store holds data that cannot be read (damaged file?)",
    "E_IDEMPOTENCY_CONFLICT": "an idempotency key was reused for a different job",
    "E_NOT_IMPLEMENTED": "the operation is part of the interface but not built yet",
    "E_FETCH": "a download never matched its pinned SHA-256 (hashes named), or kept failing",
    "E_HOST_FAULT": "the harness itself broke; no verdict about the job could be given",
    "E_INTERNAL": "an unexpected error inside metnos-exec (a bug; please report it)",
    # the live view's answers (metnos-exec web: HTTP refusals, never a job's result)
    "E_NOT_FOUND": "the live view knows no job of that id in its queue",
    "E_WEB_TOKEN": "the live view's token is missing or wrong (open it as URL/#token=TOKEN)",
    "E_WEB_READ_ONLY": "the live view is read-only: start it with --allow-actions and a token",
    "E_WEB_ORIGIN": "an action came from another page than the live view's (cross-site)",
    "E_WEB_HOST": "a request named a host the live view does not answer to (DNS rebinding)",
    "E_RETRY_UNAVAILABLE": "the live view was asked to retry a job that is no dead letter "
    "with a readable job message",
}
