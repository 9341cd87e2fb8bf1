"""Which arm runs a runtime here, and the fallback ladder when the kernel wall is down.

Spec §5: the sandbox must be a benefit, not a barrier. For the native ``python`` runtime:

1. bubblewrap not installed → direct arm (reason ``bwrap_missing``);
2. ``METNOS_SANDBOX=off`` (or ``0``, ``false``, ``none``) → direct arm (``sandbox_off``);
3. bubblewrap installed but unable to build our namespaces → direct arm
   (``userns_unavailable``; probed once and cached, see `bwrap_probe`).

``METNOS_BWRAP`` set to something that is not an executable (a path that does not exist
or cannot be run, a name not on ``$PATH``) is not "bubblewrap missing": the operator asked
for a particular binary, so it is a configuration error (`BadConfig`, ``E_CONFIG``) raised
by `check_bwrap_setting` — which the worker calls at start-up, so it refuses to start
instead of silently running every job unsandboxed.

Each degradation emits exactly one ``sandbox.degraded`` warning (requested arm, arm used,
reason, axes lost) — unless the policy forbids degrading this job, in which case
`SandboxRequired` is raised, nothing runs, and the supervisor logs ``job.rejected``.

The wasm runtimes have no native fallback (a wasm module cannot run as a plain process):
the wasm arm is imported lazily, and when that import fails the `AbsentSandbox` refuses
each job with ``E_TOOL_UNAVAILABLE``. That is a verdict, not a degradation.

Installing bubblewrap later needs no restart: the binary is looked for on every choice,
and only a *working* probe is cached for good (see `bwrap_probe`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import msgspec

from ..errors import BadConfig, SandboxRequired
from ..logs import get_logger
from ._types import AXES, Sandbox
from .absent import AbsentSandbox
from .bwrap import BwrapProbe, BwrapSandbox, bwrap_probe, find_bwrap

__all__ = (
    "SANDBOX_OFF_VALUES",
    "ArmChoice",
    "check_bwrap_setting",
    "Decision",
    "Degradation",
    "DegradeReason",
    "choose_arm",
    "decide_arm",
)

DegradeReason = Literal["bwrap_missing", "sandbox_off", "userns_unavailable"]

#: Values of ``METNOS_SANDBOX`` that switch the kernel wall off (case-insensitive).
SANDBOX_OFF_VALUES = frozenset({"off", "0", "false", "none"})

_log = get_logger()


class Degradation(msgspec.Struct, frozen=True):
    """A job runs with less containment than its runtime asks for.

    Attributes:
        requested: the arm the runtime asks for (``"bwrap"``).
        used: the arm actually used (``"none"``: the direct arm).
        reason: why (``bwrap_missing`` | ``sandbox_off`` | ``userns_unavailable``).
        axes_lost: containment axes not kept by the arm used.
        detail: bubblewrap's own words, when a probe failed (for people).
    """

    requested: str
    used: str
    reason: DegradeReason
    axes_lost: tuple[str, ...]
    detail: str | None = None


@dataclass(frozen=True)
class ArmChoice:
    """The arm to run a job with, and the degradation it implies (if any)."""

    sandbox: Sandbox
    degraded: Degradation | None = None


class Decision(msgspec.Struct, frozen=True):
    """What `choose_arm` would pick, without building the arm or logging (for `status`).

    Attributes:
        runtime: the runtime asked about.
        arm: ``"bwrap"``, ``"none"`` (direct), ``"wasm"`` or ``"absent"``.
        degraded: the degradation, if the arm is below the runtime's wall.
        unavailable: why the arm is absent, when it is.
    """

    runtime: str
    arm: str
    degraded: Degradation | None = None
    unavailable: str | None = None


def _sandbox_off(env: Mapping[str, str]) -> bool:
    return env.get("METNOS_SANDBOX", "").strip().lower() in SANDBOX_OFF_VALUES


def _direct_degradation(reason: DegradeReason, detail: str | None = None) -> Degradation:
    # The direct arm keeps nothing and says so: every axis is lost.
    return Degradation(requested="bwrap", used="none", reason=reason, axes_lost=AXES, detail=detail)


def check_bwrap_setting(env: Mapping[str, str] | None = None) -> None:
    """Refuse an explicit ``METNOS_BWRAP`` that names no executable.

    Unset or empty is fine (``bwrap`` is looked up on ``$PATH``, and its absence is an
    honest degradation). Whether the binary found can build our namespaces is the probe's
    business, not this check's.

    Raises:
        BadConfig: ``METNOS_BWRAP`` is set but is not an executable file (or a name found
            on ``$PATH``).
    """
    env = os.environ if env is None else env
    wanted = env.get("METNOS_BWRAP", "")
    if not wanted:
        return
    if find_bwrap(env) is None:
        where = "is not an executable file" if "/" in wanted else "is not found on $PATH"
        raise BadConfig(
            f"METNOS_BWRAP={wanted!r} {where}; point it at bubblewrap (e.g. /usr/bin/bwrap) "
            "or unset it to use bwrap from $PATH"
        )


def _native_decision(env: Mapping[str, str]) -> tuple[Decision, BwrapProbe | None]:
    if _sandbox_off(env):
        return Decision("python", "none", _direct_degradation("sandbox_off")), None
    check_bwrap_setting(env)
    probe = bwrap_probe(env)
    if probe.path is None:
        return Decision("python", "none", _direct_degradation("bwrap_missing", probe.error)), probe
    if not probe.working:
        deg = _direct_degradation("userns_unavailable", probe.error)
        return Decision("python", "none", deg), probe
    return Decision("python", "bwrap"), probe


def _wasm_import_error() -> str | None:
    try:
        # `from .wasm import X` (not `from . import wasm`): it honours sys.modules, so a
        # module that failed to import is seen as missing even after a first success.
        from .wasm import WasmSandbox  # noqa: F401 - imported for its availability only
    except ImportError as exc:
        return f"cannot import the wasm arm: {exc}"
    return None


def decide_arm(runtime: str, env: Mapping[str, str] | None = None) -> Decision:
    """Which arm `runtime` would use here, without side effects beyond the cached probe.

    Raises:
        BadConfig: ``METNOS_BWRAP`` names no executable (see `check_bwrap_setting`).
        ValueError: unknown runtime.
    """
    env = os.environ if env is None else env
    if runtime == "python":
        return _native_decision(env)[0]
    if runtime in ("wasm", "wasm-python"):
        err = _wasm_import_error()
        if err is not None:
            return Decision(runtime, "absent", unavailable=err)
        return Decision(runtime, "wasm")
    raise ValueError(f"unknown runtime {runtime!r}")


def choose_arm(
    runtime: str, *, require_sandbox: bool, env: Mapping[str, str] | None = None
) -> ArmChoice:
    """Pick the arm for one job of `runtime`, degrading honestly when the wall is down.

    Args:
        runtime: ``python`` | ``wasm`` | ``wasm-python``.
        require_sandbox: the policy forbids running this job without its kernel wall.
        env: where ``METNOS_SANDBOX``, ``METNOS_BWRAP`` and ``PATH`` are read
            (default `os.environ`).

    Returns:
        The arm, and the degradation if any (already logged as ``sandbox.degraded``).

    Raises:
        SandboxRequired: degradation needed but forbidden; nothing was logged or run.
        BadConfig: ``METNOS_BWRAP`` names no executable (see `check_bwrap_setting`).
        ValueError: unknown runtime.
    """
    env = os.environ if env is None else env
    if runtime == "python":
        decision, probe = _native_decision(env)
        deg = decision.degraded
        if deg is None:
            assert probe is not None and probe.path is not None
            return ArmChoice(BwrapSandbox(probe.path, features=probe.features))
        if require_sandbox:
            raise SandboxRequired(
                f"this executor may not run without its kernel sandbox, which is "
                f"unavailable here ({deg.reason}"
                + (f": {deg.detail}" if deg.detail else "")
                + "); install bubblewrap or allow degradation (METNOS_REQUIRE_SANDBOX)"
            )
        from .direct import DirectSandbox

        _log.warning(
            "sandbox.degraded",
            requested=deg.requested,
            used=deg.used,
            reason=deg.reason,
            axes_lost=list(deg.axes_lost),
            detail=deg.detail,
        )
        return ArmChoice(DirectSandbox(), deg)
    if runtime in ("wasm", "wasm-python"):
        try:
            from .wasm import WasmSandbox
        except ImportError as exc:
            # A wasm-python executor's main.py is plain Python: the native arm could run
            # it, if its author ships it as a `python` executor too. A raw .wasm module has
            # no other arm.
            instead = ("bwrap",) if runtime == "wasm-python" else ()
            return ArmChoice(
                AbsentSandbox(
                    "wasm", instead=instead, hint=f"install metnos-exec[{runtime}]: {exc}"
                )
            )
        return ArmChoice(WasmSandbox(env=env))
    raise ValueError(f"unknown runtime {runtime!r}")
