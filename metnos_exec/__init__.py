"""metnos-exec: the execution layer of an agent runtime.

An agent loop puts jobs on a queue; workers run each job's executor in a sandbox derived
from its manifest, kill it on time, and return a result that says honestly which walls
stood. The public names are re-exported here; each lives in the module of its concept.
"""

from __future__ import annotations

from .backoff import retry_delay
from .brokers import Broker, PurgeHook, PurgeReport, open_broker
from .capabilities import (
    PROVIDER_SKILLS,
    Capability,
    EffectiveCapabilities,
    InactiveCapability,
    VettedArgs,
    effective_capabilities,
    final_args,
    vet_arguments,
)
from .client import Client, NotImplementedYet, SyncClient
from .errors import (
    ERROR_CODES,
    AutonomyDenied,
    BadArguments,
    BadConfig,
    BadManifest,
    BadMessage,
    BadOutput,
    BrokerBusy,
    BrokerCorrupt,
    BrokerError,
    BrokerFull,
    BrokerGone,
    BrokerReadOnly,
    BrokerUnavailable,
    CapabilityDenied,
    HostFault,
    IdempotencyConflict,
    MetnosError,
    MissingFolder,
    SandboxDenied,
    SandboxRequired,
    ServerPinned,
    SignatureError,
    ToolUnavailable,
    UndoConflict,
    UnknownExecutor,
)
from .fetch import FetchError, robust_fetch
from .logs import EVENTS, configure_logging, tail
from .manifest import (
    ArgSpec,
    CapabilitySpec,
    Executor,
    ExecutorRegistry,
    Limits,
    Manifest,
    load_manifest,
)
from .messages import MAX_ARGS_DEPTH, MAX_JOB_BYTES, DeadLetter, ErrorInfo, Job, Result, new_job_id
from .plan import Invocation, plan_invocation
from .policy import Policy, Profile, profile_for, require_sandbox
from .process import ProcessResult, ProcessSpec, run_process
from .sandbox import (
    ContainmentReport,
    Failure,
    FuelExhausted,
    Killed,
    MemoryExceeded,
    Mount,
    ResourceLimits,
    Sandbox,
    SandboxExit,
    SandboxJob,
    SandboxOutcome,
    Success,
    Timeout,
    Trap,
    Usage,
    WasmProgram,
)
from .sandbox.absent import AbsentSandbox
from .sandbox.bwrap import BwrapSandbox
from .sandbox.direct import DirectSandbox
from .sandbox.doubles import EchoSandbox, FaultSandbox
from .sandbox.select import ArmChoice, Degradation, choose_arm
from .sandbox.status import SandboxStatus, status
from .signing import TrustStore, generate_key, sign_folder
from .supervisor import Supervisor
from .worker import run_worker

__version__ = "0.1.0"

__all__ = (
    "ERROR_CODES",
    "EVENTS",
    "MAX_ARGS_DEPTH",
    "MAX_JOB_BYTES",
    "FetchError",
    "PROVIDER_SKILLS",
    "AbsentSandbox",
    "ArgSpec",
    "ArmChoice",
    "AutonomyDenied",
    "BadArguments",
    "BadConfig",
    "BadManifest",
    "BadMessage",
    "BadOutput",
    "Broker",
    "BrokerBusy",
    "BrokerCorrupt",
    "BrokerError",
    "BrokerFull",
    "BrokerGone",
    "BrokerReadOnly",
    "BrokerUnavailable",
    "BwrapSandbox",
    "Capability",
    "CapabilityDenied",
    "CapabilitySpec",
    "Client",
    "ContainmentReport",
    "DeadLetter",
    "Degradation",
    "DirectSandbox",
    "EchoSandbox",
    "EffectiveCapabilities",
    "ErrorInfo",
    "Executor",
    "ExecutorRegistry",
    "Failure",
    "FaultSandbox",
    "FuelExhausted",
    "HostFault",
    "IdempotencyConflict",
    "InactiveCapability",
    "Invocation",
    "Job",
    "Killed",
    "Limits",
    "Manifest",
    "MemoryExceeded",
    "MetnosError",
    "MissingFolder",
    "Mount",
    "NotImplementedYet",
    "Policy",
    "ProcessResult",
    "ProcessSpec",
    "Profile",
    "PurgeHook",
    "PurgeReport",
    "ResourceLimits",
    "Result",
    "Sandbox",
    "SandboxDenied",
    "SandboxExit",
    "SandboxJob",
    "SandboxOutcome",
    "SandboxRequired",
    "SandboxStatus",
    "ServerPinned",
    "SignatureError",
    "Success",
    "Supervisor",
    "SyncClient",
    "Timeout",
    "ToolUnavailable",
    "Trap",
    "TrustStore",
    "UndoConflict",
    "UnknownExecutor",
    "Usage",
    "VettedArgs",
    "WasmProgram",
    "__version__",
    "choose_arm",
    "configure_logging",
    "effective_capabilities",
    "final_args",
    "generate_key",
    "load_manifest",
    "new_job_id",
    "open_broker",
    "plan_invocation",
    "profile_for",
    "require_sandbox",
    "retry_delay",
    "robust_fetch",
    "run_process",
    "run_worker",
    "sign_folder",
    "status",
    "tail",
    "vet_arguments",
)
