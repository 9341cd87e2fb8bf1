"""The queue's messages: `Job` in, `Result` out, `DeadLetter` for what could not run.

Wire rules (the JSON Schemas in ``queue/schemas/`` are generated from these Structs by
``python -m metnos_exec._schemas``; a test fails when they are stale):

- Every message carries ``v`` (the wire version, currently 1). A new field always gets a
  default, so a reader built for an older ``v`` keeps decoding newer messages.
- Unknown fields are therefore **ignored**, not rejected, even at the producer edge: a
  producer one version ahead of the worker must still be served. What *is* enforced is the
  type and range of every known field (`msgspec.Meta` constraints), and the error names the
  path (``Expected `int`, got `str` - at `$.max_attempts```).
- Times are unix seconds as JSON numbers (``submitted_at``, ``not_before``, ...): cheap to
  compare in SQL and in Lua, and free of time-zone mistakes. Logs render them as ISO-8601.
- JSON is the default encoding; MessagePack is available through `encode_msgpack` /
  `decode_job_msgpack` for producers that prefer it.
- A job message is at most `MAX_JOB_BYTES` (1 MiB) encoded, and its ``args`` nest at most
  `MAX_ARGS_DEPTH` levels. Submitting a larger or deeper job is refused at once with
  ``E_BAD_MESSAGE`` naming the limit; one that reaches a worker anyway (written straight
  into a store) is dead-lettered with that code, like any message a reader cannot decode.
  Data that large belongs in a file the job is given the path of.

Every decoder here raises only `BadMessage`, whatever went wrong inside it (a recursion
limit, a bad UTF-8 byte, a number out of range, memory): a broker dead-letters what it
cannot read and never lets one message stop the ones behind it.

`UndoEntry` is stored by the brokers next to the results (see ``brokers/base.py``) and read
by the undo job (``executor = "metnos:undo"``, `UNDO_EXECUTOR`); its schema is in
``queue/schemas/undo_entry.json``. An entry is a list of operations, each taking one path
from the state the job left (``before``) back to the state it found (``after``): applied in
order, they undo the job; swapped, they redo it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Annotated, Any, Final, Literal

import msgspec

from ._wire_text import STDERR_CAP_BYTES, cap_text
from .changeset import APPROVE_EXECUTOR, REJECT_EXECUTOR, ChangeSet
from .errors import BadMessage
from .sandbox._types import ContainmentReport, SandboxExit, Usage
from .sandbox.egress import EgressRecord
from .trace_context import TraceContext

__all__ = (
    "CHECKPOINT_EXECUTOR",
    "UNDO_EXECUTOR",
    "Absent",
    "DirState",
    "FileState",
    "LinkState",
    "Move",
    "PathState",
    "Progress",
    "decode_progress",
    "describe_progress",
    "Put",
    "UndoEntry",
    "UndoOp",
    "decode_undo_entry",
    "writes_content",
    "E_CANCELLED",
    "E_LEASE_EXPIRED",
    "MAX_ARGS_DEPTH",
    "MAX_JOB_BYTES",
    "SERVER_DEVICE",
    "STDERR_CAP_BYTES",
    "APPROVE_EXECUTOR",
    "REJECT_EXECUTOR",
    "WIRE_VERSION",
    "Autonomy",
    "DeadLetter",
    "ErrorInfo",
    "Job",
    "Result",
    "TraceContext",
    "ResultStatus",
    "cap_text",
    "check_job_size",
    "decode_dead_letter",
    "decode_job",
    "decode_job_msgpack",
    "decode_result",
    "encode",
    "encode_job",
    "encode_msgpack",
    "new_job_id",
)

#: Current wire version written into ``v``.
WIRE_VERSION: Final = 1

#: The device id of workers that run on the server. Jobs with ``device=None`` go only to
#: server workers: a job must opt in to run on a user's device, never drift there.
SERVER_DEVICE: Final = "server"

#: The largest job message, encoded (JSON or MessagePack), in bytes. Part of the wire
#: contract: producers in other languages are held to it too (the SQLite inbox refuses a
#: larger body). Large inputs belong in files; the job carries their path.
MAX_JOB_BYTES: Final = 1024 * 1024

#: How deep a job's ``args`` may nest (objects and arrays). Far beyond what any tool's
#: arguments need, and far enough below the decoders' recursion limits (which depend on
#: the caller's own stack depth) that a job decodes the same in every process.
MAX_ARGS_DEPTH: Final = 100

#: A running job's lease expired `max_attempts` times (its workers kept dying).
E_LEASE_EXPIRED: Final = "E_LEASE_EXPIRED"
#: The job was cancelled on request.
E_CANCELLED: Final = "E_CANCELLED"

#: The reserved executor name of undo jobs (manifest names cannot hold ``:``). Its one
#: argument is ``job_id``: the job whose recorded file changes to undo.
UNDO_EXECUTOR: Final = "metnos:undo"
#: The reserved executor name of checkpoint jobs (`metnos_exec.undo.checkpoints`):
#: ``action`` (``create``, ``list``, ``diff``, ``restore``) and ``name``.
CHECKPOINT_EXECUTOR: Final = "metnos:checkpoint"

Autonomy = Literal["read_only", "supervised", "full"]
_FINAL = Literal["succeeded", "failed", "timed_out", "cancelled", "rejected", "dead"]
ResultStatus = _FINAL | Literal["awaiting_approval"]

_ID = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
_NAME = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


# --- ids ------------------------------------------------------------------------------

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_id_lock = threading.Lock()
_last_ms = -1
_last_rand = 0


def new_job_id() -> str:
    """A ULID: 26 Crockford base32 characters, 48-bit millisecond time + 80 random bits.

    Sortable by creation time. Within one millisecond in one process the random part is
    incremented rather than redrawn, so ids made here also sort in creation order (the
    ULID "monotonic" rule); across processes only the millisecond order holds.
    """
    global _last_ms, _last_rand
    ms = time.time_ns() // 1_000_000
    with _id_lock:
        if ms <= _last_ms:
            ms = _last_ms
            _last_rand = (_last_rand + 1) & ((1 << 80) - 1)
        else:
            _last_ms = ms
            _last_rand = int.from_bytes(os.urandom(10), "big")
        value = (ms << 80) | _last_rand
    out = []
    for _ in range(26):
        out.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(out))


# --- messages -------------------------------------------------------------------------


class ErrorInfo(msgspec.Struct, frozen=True, kw_only=True):
    """A machine-readable error code (``E_...``) and a sentence for a person."""

    code: str
    message: str


class Job(msgspec.Struct, frozen=True, kw_only=True):
    """A request to run one executor once (at least once, after a lost lease).

    Attributes:
        v: wire version.
        id: ULID (see `new_job_id`); generated when omitted.
        executor: the executor's manifest name.
        args: the executor's arguments (checked against its manifest by the worker).
        timeout_s: wall-clock budget; ``None`` means the manifest's ``limits.timeout_s``.
        autonomy: the autonomy level the policy applies.
        device: target device id; ``None`` means a server worker.
        max_attempts: deliveries allowed before the job is dead (retries and lost leases
            both count).
        idempotency_key: a second submit with the same key returns the first job's id.
        correlation_id: the agent step this job belongs to, carried into logs.
        submitted_at: unix seconds.
        priority: higher runs first; equal priorities run in submission order.
        not_before: unix seconds before which the job is not delivered.
        text_args: names of arguments given as command-line text (``metnos-exec submit
            --arg``): the worker converts each such string to the type the executor's
            schema declares (``integer``, ``number``, ``boolean``, ``array``, ``object``)
            and refuses the job with ``E_BAD_ARGS`` when it does not convert. Producers
            with typed values leave it empty.
        result_ttl_s: keep this job's result (and the rest of the finished job) this long
            after it finished rather than the whole retention period: the first purge
            after that forgets it (workers purge hourly). ``None``: the retention.
        trace: the producer's trace context; the worker's span of this job is its child
            (``None``: not traced).
        commit: ``approve``: a staged job's changes wait for an approval (its result is
            ``awaiting_approval``, `metnos_exec.undo.gates`); ``auto``: as its manifest says.
        branch_of: a candidate on the same base as that job (gated; approving one of them
            discards the others).
    """

    v: int = WIRE_VERSION
    id: _ID = msgspec.field(default_factory=new_job_id)
    executor: _NAME
    args: dict[str, Any] = msgspec.field(default_factory=dict)
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    autonomy: Autonomy = "supervised"
    device: _NAME | None = None
    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=1000)] = 3
    idempotency_key: Annotated[str, msgspec.Meta(min_length=1, max_length=512)] | None = None
    correlation_id: str | None = None
    submitted_at: float = msgspec.field(default_factory=time.time)
    priority: Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)] = 0
    not_before: float | None = None
    text_args: tuple[_NAME, ...] = ()
    result_ttl_s: Annotated[float, msgspec.Meta(gt=0)] | None = None
    trace: TraceContext | None = None
    commit: Literal["auto", "approve"] = "auto"
    branch_of: _ID | None = None


class Result(msgspec.Struct, frozen=True, kw_only=True):
    """What became of a job. Written once per job (the first ack wins, see the brokers).

    Attributes:
        v: wire version.
        job_id: the job.
        status: the verdict.
        output: the executor's JSON output (``None`` when it produced none).
        exit: how the sandboxed process ended; ``None`` when nothing ran.
        error: why the job did not succeed (``E_...`` code and a sentence).
        stderr: the executor's stderr, decoded as UTF-8 and capped at `STDERR_CAP_BYTES`.
        stdout_truncated: stdout hit its output budget.
        stderr_truncated: stderr was cut (budget or cap).
        containment: which walls stood, per axis.
        usage: wall time, CPU, memory, fuel.
        undo_ids: undo entries recorded by this job.
        worker: the worker id that produced this result ("" when none did).
        device: the device the job ran on.
        attempt: the delivery that produced this result (1-based; 0 when never delivered).
        started_at: unix seconds the run started; ``None`` when nothing ran.
        finished_at: unix seconds the result was produced.
        egress: each connection the job made through the network wall, allowed or
            refused and why, with its bytes each way (``()``: none, or no wall).
        changes: a staged job's change set (`metnos_exec.changeset`; capped, caps named).
    """

    v: int = WIRE_VERSION
    job_id: _ID
    status: ResultStatus
    output: Any = None
    exit: SandboxExit | None = None
    error: ErrorInfo | None = None
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    containment: ContainmentReport | None = None
    usage: Usage | None = None
    undo_ids: tuple[str, ...] = ()
    worker: str = ""
    device: str = SERVER_DEVICE
    attempt: int = 0
    started_at: float | None = None
    finished_at: float | None = None
    egress: tuple[EgressRecord, ...] = ()
    changes: ChangeSet | None = None


class Progress(msgspec.Struct, frozen=True, kw_only=True):
    """The latest progress a running job's executor reported (README, "Reporting
    progress"): stored by the worker at most once a second, read by ``result``,
    ``status --jobs``, `Client.progress` and the MCP server.

    Attributes:
        fraction: how far it is, 0.0 to 1.0; ``None`` when it sent a message only.
        message: what it is doing (at most 200 characters), ``""`` for none.
        at: unix seconds (the worker's clock) the worker read it.
        attempt: the delivery that reported it.
        lines: progress lines the worker read from this delivery so far.
        dropped: lines superseded before they were read alone (coalesced, or past the
            rate), counted in `lines`.
        malformed: lines that were not a progress object (ignored, counted in `lines`).
    """

    fraction: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    message: str = ""
    at: float = 0.0
    attempt: int = 0
    lines: int = 0
    dropped: int = 0
    malformed: int = 0


class DeadLetter(msgspec.Struct, frozen=True, kw_only=True):
    """A job that will not be retried, with the last error.

    Attributes:
        v: wire version.
        job_id: the job's id (for an undecodable message: the id the broker gave it).
        job: the decoded job, when it could be decoded.
        raw: the message as received, when it could not be decoded (its first
            `MAX_JOB_BYTES` bytes when it was larger: see ``raw_truncated``).
        error: the last error.
        attempts: deliveries made.
        at: unix seconds the job was dead-lettered.
        worker: the worker that held the last delivery ("" when none).
        raw_truncated: ``raw`` is only the start of a message over `MAX_JOB_BYTES`.
    """

    v: int = WIRE_VERSION
    job_id: str
    job: Job | None = None
    raw: bytes | None = None
    error: ErrorInfo
    attempts: int = 0
    at: float
    worker: str = ""
    raw_truncated: bool = False


# --- undo entries ---------------------------------------------------------------------


class Absent(msgspec.Struct, frozen=True, tag="absent"):
    """Nothing at the path."""


class FileState(msgspec.Struct, frozen=True, tag="file"):
    """A regular file: its content (by SHA-256, in the blob store when it must be
    restored), its permission bits, and when known its mtime and owner.

    ``mode`` never carries the setuid or setgid bit (commit strips them). ``uid``/``gid``
    are restored only by a root worker; ``mtime_ns`` is restored, not compared."""

    sha256: str
    size: int
    mode: int
    mtime_ns: int | None = None
    uid: int | None = None
    gid: int | None = None


class LinkState(msgspec.Struct, frozen=True, tag="symlink"):
    """A symbolic link, by its target text (never followed)."""

    target: str


class DirState(msgspec.Struct, frozen=True, tag="dir"):
    """A folder; its entries are separate paths."""

    mode: int
    uid: int | None = None
    gid: int | None = None


PathState = Absent | FileState | LinkState | DirState


class Put(msgspec.Struct, frozen=True, tag="put"):
    """Take `path` from `before` to `after` (create, delete, replace, change the mode)."""

    path: str
    before: PathState
    after: PathState


class Move(msgspec.Struct, frozen=True, tag="move"):
    """Rename `src` (holding `state`) to `dst` (absent): "move back" in an undo."""

    src: str
    dst: str
    state: FileState | LinkState


UndoOp = Put | Move


class UndoEntry(msgspec.Struct, frozen=True, kw_only=True):
    """How to undo the file changes of one job, deterministically.

    Attributes:
        v: wire version.
        id: ULID of the entry.
        job_id: the job whose changes `ops` undo.
        device: the device that made the changes (undo runs there and nowhere else).
        executor: the job's executor (for people reading the entry).
        recorded_at: unix seconds.
        method: ``staged`` (the whole change set, from the staging layer) or ``backup``
            (no staging: only the declared targets, see `lost`).
        roots: the writable folders the job was given; every path lies below one.
        ops: apply in this order to undo the job.
        reverses: when this entry was recorded by an undo job, the entry it undid.
        lost: what this entry does not cover (``backup`` entries), for people.
        seal: HMAC-SHA256 of the rest, with the recording device's key
            (`metnos_exec.undo.seal`); an undo refuses an entry without a valid one.
    """

    v: int = WIRE_VERSION
    id: _ID = msgspec.field(default_factory=new_job_id)
    job_id: _ID
    device: _NAME = SERVER_DEVICE
    executor: str = ""
    recorded_at: float = msgspec.field(default_factory=time.time)
    method: Literal["staged", "backup"] = "staged"
    roots: tuple[str, ...] = ()
    ops: tuple[UndoOp, ...] = ()
    reverses: str | None = None
    lost: str | None = None
    seal: str | None = None

    def paths(self) -> list[str]:
        """Every path the entry touches, in op order, without repeats."""
        seen: dict[str, None] = {}
        for op in self.ops:
            if isinstance(op, Move):
                seen.setdefault(op.src, None)
                seen.setdefault(op.dst, None)
            else:
                seen.setdefault(op.path, None)
        return list(seen)

    def blobs(self) -> set[str]:
        """The SHA-256 of every content undoing restores from the blob store (the blobs
        this entry needs kept)."""
        return {
            op.after.sha256
            for op in self.ops
            if isinstance(op, Put) and isinstance(op.after, FileState) and writes_content(op)
        }


def writes_content(op: UndoOp) -> bool:
    """Whether applying `op` writes a file's content (from a blob or a staged file), as
    opposed to removing, renaming or changing metadata only."""
    if not isinstance(op, Put) or not isinstance(op.after, FileState):
        return False
    return not (isinstance(op.before, FileState) and op.before.sha256 == op.after.sha256)


# --- codecs ---------------------------------------------------------------------------

# Built once: msgspec compiles a decoder per type, and building one per message would cost
# more than decoding it.
_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()
_job_decoder = msgspec.json.Decoder(Job)
_job_msgpack_decoder = msgspec.msgpack.Decoder(Job)
_result_decoder = msgspec.json.Decoder(Result)
_dead_letter_decoder = msgspec.json.Decoder(DeadLetter)
_undo_entry_decoder = msgspec.json.Decoder(UndoEntry)
_progress_decoder = msgspec.json.Decoder(Progress)


def encode(msg: Job | Result | DeadLetter | ErrorInfo | UndoEntry | Progress) -> bytes:
    """JSON-encode a message."""
    return _json_encoder.encode(msg)


def encode_msgpack(msg: Job | Result | DeadLetter | ErrorInfo) -> bytes:
    """MessagePack-encode a message."""
    return _msgpack_encoder.encode(msg)


def encode_job(job: Job) -> bytes:
    """JSON-encode a job for submission, holding it to the wire's bounds.

    Raises:
        BadMessage: the job's ``args`` nest deeper than `MAX_ARGS_DEPTH`, cannot be
            encoded (a value JSON has no form for), or the encoding is larger than
            `MAX_JOB_BYTES`; the message names the limit.
    """
    _check_depth(job)
    try:
        data = _json_encoder.encode(job)
    except Exception as exc:  # RecursionError, an unencodable value, memory, ...
        raise BadMessage(f"job rejected: it cannot be encoded ({_describe(exc)})") from None
    check_job_size(len(data))
    return data


def _describe(exc: BaseException) -> str:
    text = str(exc)
    if len(text) > 300:
        text = text[:300] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def check_job_size(size: int) -> None:
    """Refuse a job message of `size` bytes when it is over `MAX_JOB_BYTES`.

    Raises:
        BadMessage: naming the size and the limit.
    """
    if size > MAX_JOB_BYTES:
        raise BadMessage(
            f"job message rejected: it is {size:,} bytes, over the limit of "
            f"{MAX_JOB_BYTES:,} bytes (MAX_JOB_BYTES); pass large inputs as a file path"
        )


def _too_deep(value: Any, limit: int) -> bool:
    # Iterative: a recursive walk would itself hit the recursion limit it guards against.
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend(
            (child, depth + 1) for child in children if isinstance(child, dict | list | tuple)
        )
    return False


def _check_depth(job: Job) -> None:
    # `args` itself is level 1.
    if _too_deep(job.args, MAX_ARGS_DEPTH):
        raise BadMessage(
            f"job message rejected: its args nest deeper than {MAX_ARGS_DEPTH} levels "
            "(MAX_ARGS_DEPTH)"
        )


def _input_size(data: bytes | bytearray | memoryview | str) -> int:
    if isinstance(data, str):
        # UTF-8 takes one to four bytes per character: only measure when it matters.
        if len(data) > MAX_JOB_BYTES or len(data) * 4 <= MAX_JOB_BYTES:
            return len(data)
        return len(data.encode("utf-8", errors="surrogatepass"))
    return len(data)


def decode_job(data: bytes | str) -> Job:
    """Decode and validate a JSON job.

    Raises:
        BadMessage: larger than `MAX_JOB_BYTES`, not JSON, not an object, a field of the
            wrong type or range, ``args`` deeper than `MAX_ARGS_DEPTH`, or a ``v`` newer
            than this reader understands; the message names the path or the limit. Never
            anything else, whatever the bytes (see the module docstring).
    """
    check_job_size(_input_size(data))
    try:
        job = _job_decoder.decode(data)
    except Exception as exc:  # DecodeError, RecursionError, MemoryError, ...
        raise BadMessage(f"job message rejected: {_decode_error(exc)}") from None
    return _check_version(job)


def decode_job_msgpack(data: bytes) -> Job:
    """Decode and validate a MessagePack job (see `decode_job`)."""
    check_job_size(_input_size(data))
    try:
        job = _job_msgpack_decoder.decode(data)
    except Exception as exc:
        raise BadMessage(f"job message rejected: {_decode_error(exc)}") from None
    return _check_version(job)


def _decode_error(exc: Exception) -> str:
    if isinstance(exc, msgspec.DecodeError):
        return str(exc)  # msgspec's own words name the path
    if isinstance(exc, RecursionError):
        return "it nests too deeply to decode"
    return _describe(exc)


def _check_version(job: Job) -> Job:
    # A higher major version may change a field's meaning, not just add one; running it
    # with this reader's understanding would be a guess.
    if job.v < 1 or job.v > WIRE_VERSION:
        raise BadMessage(f"job message rejected: wire version v={job.v} is not supported")
    _check_depth(job)
    return job


def decode_result(data: bytes | str) -> Result:
    """Decode a JSON result.

    Raises:
        BadMessage: the bytes are not a result (a damaged store, a foreign writer);
            brokers report it as `BrokerCorrupt` naming the job.
    """
    try:
        return _result_decoder.decode(data)
    except Exception as exc:
        raise BadMessage(f"result message unreadable: {_decode_error(exc)}") from None


def describe_progress(progress: Progress) -> str:
    """One line for people: ``progress 40% (step 2 of 5)``."""
    parts = ["progress"]
    if progress.fraction is not None:
        parts.append(f"{progress.fraction:.0%}")
    if progress.message:
        parts.append(f"({progress.message})")
    return " ".join(parts)


def decode_progress(data: bytes | str) -> Progress | None:
    """Decode a stored progress record; ``None`` for one that does not decode (written by
    hand, or by a newer build): progress is advice, and a reader skips it."""
    try:
        return _progress_decoder.decode(data)
    except Exception:
        return None


def decode_dead_letter(data: bytes | str) -> DeadLetter:
    """Decode a JSON dead letter.

    Raises:
        BadMessage: the bytes are not a dead letter (see `decode_result`).
    """
    try:
        return _dead_letter_decoder.decode(data)
    except Exception as exc:
        raise BadMessage(f"dead letter unreadable: {_decode_error(exc)}") from None


def decode_undo_entry(data: bytes | str) -> UndoEntry:
    """Decode a JSON undo entry (written by a broker).

    Raises:
        BadMessage: the bytes are not an undo entry (see `decode_result`).
    """
    try:
        return _undo_entry_decoder.decode(data)
    except Exception as exc:
        raise BadMessage(f"undo entry unreadable: {_decode_error(exc)}") from None
