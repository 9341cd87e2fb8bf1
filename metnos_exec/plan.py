"""The invocation planner: executor + arguments + autonomy → a vetted `SandboxJob`.

`plan_invocation` is the single place where a job's walls are decided. It runs, in order:
schema check and defaults (`final_args`), effective capabilities (``when`` clauses,
provider authority), the autonomy profile (`policy.PROFILES`), argument vetting (the first
wall) and finally the mechanical construction of the `SandboxJob` that an arm turns into
the second wall. Anything refused here is refused before a process exists.

Construction rules (each tested in ``tests/test_plan.py``):

* The executor's folder is mounted read-only at its own (resolved) path and is the guest's
  working directory: it can import its siblings, never modify itself, even when a
  ``fs:write`` hint covers it.
* ``fs:read`` hints → read-only mounts, ``fs:write`` hints → writable mounts, each hint cut
  at its first glob segment (`sandbox.flags.expand_hint`). A hint's folder is never reached
  through a symlink: one on the way refuses the job (``E_SYMLINKED_FOLDER``,
  `sandbox.mount_sources`), since another job may have planted it to have its target
  mounted instead. Only existing paths are mounted; a hint naming a missing folder is
  skipped and noted (so is a hint naming a single file for the wasm runtimes: WASI
  preopens folders only).
  A path declared both read and write is writable once; a path below another mount stays
  a separate mount (mounts are sorted parent-first, so the deeper, more specific one wins).
  Under ``read_only`` autonomy every mount is read-only.
* A valid provider binding mounts ``<skills_root>/<skill>`` read-write (token refresh
  needs it, even under ``read_only``: it is the skill's own state, not the user's files),
  opens the network and pins the job to the server. ``skills_root`` defaults to
  ``$METNOS_SKILLS_ROOT`` or ``<home>/.metnos/skills``.
* ``network`` is on iff an active ``network:*`` capability or a valid provider binding
  exists, or the autonomy profile allows the override (``full``).
* ``egress``: with active ``network:*`` hints, the network wall's policy (`_egress`): the
  job reaches those hosts and ports only. ``None`` (the host network) for a provider
  binding, ``full`` autonomy or an operator's ``METNOS_HOST_NETWORK=1``.
* runtime ``python``: ``argv = (<base interpreter>, "-E", "-s", "-S", <main.py>)``. The
  venv's ``python`` is a symlink to the base interpreter; `os.path.realpath` names the file
  the sandbox can actually mount and execute. ``-E -s -S`` keep the environment, the venv's
  and the user's site-packages out (executors are stdlib-only by contract) while the
  script's own folder stays first on ``sys.path``, so its sibling modules import (``-I``
  would drop it; `sandbox.flags.PYTHON_FLAGS`). The environment is a fixed
  allow-list (``PATH``, ``LANG``, ``HOME``, ``PYTHONDONTWRITEBYTECODE``,
  ``PYTHONUNBUFFERED``); nothing is inherited from the worker. stdin is the vetted
  arguments as one JSON document.
* runtime ``wasm``: ``WasmProgram(module=<entry>, args=(<name>,))``; ``wasm-python``:
  ``WasmProgram(module=PYTHON_WASM_MODULE, args=("python", "-u", *PYTHON_FLAGS, <main.py>))``,
  the arm resolves the sentinel to the pinned CPython-on-WASI runtime. ``-E -s -S`` as for
  native (and no ``site`` import: the guest starts ~15% faster); ``-u`` first, where the
  arm looks for it (`wasm._python_argv` adds it only when missing).
* Limits come from the manifest; a job's own ``timeout_s`` may only shorten the wall time.
  ``fuel`` is passed for the wasm runtimes only.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Collection, Mapping
from typing import Any

import msgspec

from .capabilities import (
    EffectiveCapabilities,
    InactiveCapability,
    VettedValue,
    effective_capabilities,
    final_args,
    require_hint_folders,
    vet_arguments,
)
from .errors import AutonomyDenied, CapabilityDenied, MissingFolder
from .manifest import Executor, Manifest, Runtime
from .policy import Policy, Profile, profile_for
from .sandbox._types import (
    PYTHON_WASM_MODULE,
    Mount,
    ResourceLimits,
    SandboxJob,
    WasmProgram,
)
from .sandbox.egress import EgressLimits, EgressPolicy, policy_for
from .sandbox.flags import PYTHON_FLAGS, expand_hint
from .sandbox.mount_sources import check_folder

__all__ = ("Invocation", "default_skills_root", "plan_invocation")

_MiB = 1024 * 1024
#: The guest argv before main.py for ``wasm-python`` (see the module docstring).
_WASM_PYTHON_ARGV: tuple[str, ...] = ("python", "-u", *PYTHON_FLAGS)

#: How long a resolved executor folder or interpreter path is reused. Resolving them is a
#: third of the per-job planning cost (one ``lstat`` per path component, every job); within
#: this window a symlink swapped under an executor folder (an update) may still mount the
#: folder it named a moment ago. User paths (fs hints, skill homes) are never cached: a hint
#: folder created later is mounted from the next job on.
RESOLVE_TTL_S = 2.0

_resolved_lock = threading.Lock()
_resolved: dict[str, tuple[str, float]] = {}


def _realpath_fresh(path: str) -> str:
    """`os.path.realpath` of a host-owned path, memoised for `RESOLVE_TTL_S`."""
    now = time.monotonic()
    with _resolved_lock:
        hit = _resolved.get(path)
    if hit is not None and now - hit[1] < RESOLVE_TTL_S:
        return hit[0]
    real = os.path.realpath(path)
    with _resolved_lock:
        if len(_resolved) > 4096:  # bounded: executors come and go over a worker's life
            _resolved.clear()
        _resolved[path] = (real, now)
    return real


class Invocation(msgspec.Struct, frozen=True):
    """A planned, vetted invocation, ready for an arm.

    Attributes:
        executor: the executor's name.
        runtime: the manifest's runtime (selects the arm family).
        autonomy: the profile that shaped the job.
        args: the arguments the executor receives (vetted, paths resolved).
        effective: effective capabilities (active, inactive, provider bindings).
        job: what the sandbox runs.
        server_pinned: never send this job to a remote device (provider binding or a
            non-packable executor).
        require_sandbox: policy forbids running this invocation on the direct arm.
        inactive: what the manifest declared but grants nothing here (for reporting).
        checked: every argument value vetting checked and the hint that admitted it.
        notes: decisions worth a log line (e.g. a hint not mounted because it is missing).
        write_roots: the writable mounts that hold the user's files (``fs:write`` hints;
            not a provider skill's home): what staging covers.
        write_targets: the path arguments admitted by an ``fs:write`` hint (resolved): what
            is backed up when staging is unavailable.
    """

    executor: str
    runtime: Runtime
    autonomy: Profile
    args: dict[str, Any]
    effective: EffectiveCapabilities
    job: SandboxJob
    server_pinned: bool
    require_sandbox: bool
    inactive: tuple[InactiveCapability, ...] = ()
    checked: tuple[VettedValue, ...] = ()
    notes: tuple[str, ...] = ()
    write_roots: tuple[str, ...] = ()
    write_targets: tuple[str, ...] = ()


def default_skills_root(home: str, environ: Mapping[str, str] | None = None) -> str:
    """``$METNOS_SKILLS_ROOT`` or ``<home>/.metnos/skills``."""
    env = os.environ if environ is None else environ
    return env.get("METNOS_SKILLS_ROOT") or os.path.join(home, ".metnos", "skills")


def _folder_entry(path: str, entry: str) -> tuple[str, str]:
    """The executor's folder (normalised, absolute) and its entry file. Pure string work,
    the same for every job of an executor: cached when `path` is absolute (a relative one
    depends on the working directory). Nothing on disk is read here; the folder is checked
    for every job by `check_folder`."""
    if os.path.isabs(path):
        return _folder_entry_abs(path, entry)
    folder = os.path.normpath(os.path.abspath(path))
    return folder, os.path.join(folder, entry)


@functools.lru_cache(maxsize=256)
def _folder_entry_abs(path: str, entry: str) -> tuple[str, str]:
    folder = os.path.normpath(path)
    return folder, os.path.join(folder, entry)


def _egress(
    manifest: Manifest, effective: EffectiveCapabilities, profile: Profile, policy: Policy
) -> EgressPolicy | None:
    """The network wall's policy: the active ``network:*`` hints, the manifest's traffic
    limits, the operator's deny list. ``None`` (the host network, reported ``not_kept``)
    where the hosts are not what bounds the job: no network capability, the operator's
    ``host_network``, ``autonomy: "full"`` (which may open the network regardless of
    declarations), or a provider binding (its hosts are the provider's, not named)."""
    nets = effective.of("network")
    if not nets or policy.host_network or profile.allow_network_override:
        return None
    if effective.provider_bindings:
        return None
    lim = manifest.limits
    return policy_for(
        [(cap.mode, hint) for cap in nets for hint in cap.hints],
        deny=policy.egress_deny,
        limits=EgressLimits(connections=lim.net_connections, bytes=lim.net_mb * _MiB),
    )


def _limits(manifest: Manifest, timeout_s: float | None) -> ResourceLimits:
    lim = manifest.limits
    wall = lim.timeout_s if timeout_s is None else min(float(timeout_s), lim.timeout_s)
    return ResourceLimits(
        wall_time_s=wall,
        memory_bytes=lim.memory_mb * _MiB,
        pids=lim.pids,
        output_bytes=lim.output_kb * 1024,
        fuel=lim.fuel if manifest.runtime != "python" else None,
        cpu_time_s=lim.cpu_s,
        file_size_bytes=lim.file_size_mb * _MiB,
        open_files=lim.open_files,
        disk_bytes=lim.disk_mb * _MiB,
    )


def _mounts(
    folder: str,
    effective: EffectiveCapabilities,
    profile: Profile,
    home: str,
    skills_root: str,
    notes: list[str],
    *,
    dirs_only: bool,
    protected: Collection[str] = (),
) -> tuple[tuple[Mount, ...], tuple[str, ...]]:
    """The mounts, and the writable ones that hold the user's files (`Invocation.write_roots`).

    Raises:
        CapabilityDenied: a hint's folder lies under, or covers, one of `protected`.
    """
    writable: dict[str, bool] = {}
    for cap in effective.of("fs"):
        if cap.mode not in ("read", "write"):
            continue
        for hint in cap.hints:
            try:
                root = expand_hint(hint, home)
            except ValueError as exc:
                notes.append(f"{cap.name} hint {hint!r} not mounted: {exc}")
                continue
            # Never through a symlink: the folder mounted is the one the hint names.
            if not check_folder(root):
                notes.append(f"{cap.name} hint {hint!r} not mounted: {root} does not exist")
                continue
            _refuse_protected(cap.name, hint, root, protected)
            if dirs_only and not os.path.isdir(root):
                # WASI preopens are directories; mounting the parent would widen the grant.
                notes.append(f"{cap.name} hint {hint!r} not mounted: {root} is not a folder")
                continue
            rw = cap.mode == "write" and not profile.force_read_only_mounts
            writable[root] = writable.get(root, False) or rw
    skill_homes: set[str] = set()
    for skill in effective.provider_bindings:
        skill_home = os.path.join(skills_root, skill)
        if not check_folder(skill_home) or not os.path.isdir(skill_home):
            notes.append(f"provider skill {skill!r} home {skill_home} does not exist")
            continue
        writable[skill_home] = True
        skill_homes.add(skill_home)
    # The executor never modifies itself, whatever a hint above it says.
    writable[folder] = False
    ordered = sorted(writable.items(), key=lambda kv: kv[0].split("/"))
    return (
        # Parent-first: bubblewrap applies binds in order, so a deeper mount lands on top.
        tuple(Mount(host=path, guest=path, writable=rw) for path, rw in ordered),
        tuple(path for path, rw in ordered if rw and path not in skill_homes),
    )


def plan_invocation(
    executor: Executor,
    args: Mapping[str, Any],
    *,
    autonomy: str = "supervised",
    home: str | None = None,
    skills_root: str | None = None,
    policy: Policy | None = None,
    timeout_s: float | None = None,
    python: str | None = None,
    text_args: Collection[str] = (),
    protected: Collection[str] = (),
) -> Invocation:
    """Decide everything about one invocation before anything runs.

    Args:
        executor: the loaded executor.
        args: the caller's arguments.
        autonomy: ``read_only``, ``supervised`` (default) or ``full``.
        home: what ``~`` means for this job (default: the worker's home).
        skills_root: where provider skills keep their homes (see `default_skills_root`).
        policy: degradation policy (default: `Policy.from_env`).
        timeout_s: the job's own timeout; may only shorten the manifest's.
        python: the interpreter of ``python`` executors (default: the worker's own base
            interpreter); a standalone build's prefix (two levels above it) is mounted
            read-only (see `runtimes.obtain_device_python`).
        text_args: arguments given as command-line text, converted by their schema
            (``Job.text_args``, see `final_args`).
        protected: the worker's own paths (real paths): its executors root and executor
            folders, the queue database, the state folder, blob store and journals, the
            caches, the provider skills root. A ``fs:*`` hint whose folder lies under one,
            or covers one, refuses the job (``E_CAPABILITY_DENIED``): through it a job
            could change a later job's code or the worker's state. Refused rather than
            masked inside the sandbox: one check that holds the same in every arm (the
            direct arm and a wasm preopen cannot mask a path below a folder they grant),
            and a staged commit then never has a write root there either.

    Returns:
        The vetted `Invocation`.

    Raises:
        BadArguments: the arguments do not fit the schema.
        AutonomyDenied: unknown level, or a mutating executor under ``read_only``.
        CapabilityDenied: a path/URL/host argument outside the active hints, or a hint
            over a `protected` path.
        MissingFolder: a path argument's hint folder does not exist (cannot be mounted).
    """
    manifest = executor.manifest
    profile = profile_for(autonomy)
    _refuse_mutating(manifest, profile)
    # `home` is trusted as given (the supervisor resolves its own once, at start): a hint's
    # folder below it must be reached without a symlink, so resolving the home again here
    # would follow a link planted in its place since.
    home = os.path.realpath(os.path.expanduser("~")) if home is None else home
    policy = Policy.from_env() if policy is None else policy

    final = final_args(manifest, args, text_args=text_args)
    effective = effective_capabilities(manifest, final)
    vetted = vet_arguments(manifest, final, effective, home=home)
    require_hint_folders(manifest.name, vetted.checked, home)

    # Real since the registry loaded it: checked, never resolved again (a symlink swapped
    # in since, at the executors root or anywhere on the way, is refused: E_SYMLINKED_FOLDER;
    # the bwrap arm checks again when it opens the folder to bind it).
    folder, entry = _folder_entry(str(executor.path), manifest.entry)
    if not check_folder(folder):
        raise MissingFolder(f"{manifest.name}: its folder {folder} is gone; nothing ran")
    notes: list[str] = []
    if effective.provider_bindings:
        # Only a provider binding mounts a skill's home: resolved for those jobs alone.
        skills_root = _realpath_fresh(
            default_skills_root(home) if skills_root is None else skills_root
        )
    mounts, write_roots = _mounts(
        folder,
        effective,
        profile,
        home,
        skills_root or "",
        notes,
        dirs_only=manifest.runtime != "python",
        protected=protected,
    )
    targets = _write_targets(effective, vetted.checked, write_roots)
    common: dict[str, Any] = {
        "env": _env(home),
        "stdin": msgspec.json.encode(vetted.args),
        "mounts": mounts,
        "network": effective.network or profile.allow_network_override,
        "egress": _egress(manifest, effective, profile, policy),
        "cwd": folder,
        "limits": _limits(manifest, timeout_s),
        "warm": manifest.warm,
    }
    job = _runtime_job(manifest, entry, common, python)
    return Invocation(
        executor=manifest.name,
        runtime=manifest.runtime,
        autonomy=profile,
        args=vetted.args,
        effective=effective,
        job=job,
        server_pinned=effective.server_pinned or not manifest.packable,
        require_sandbox=policy.sandbox_required(manifest, effective),
        inactive=effective.inactive,
        checked=vetted.checked,
        notes=tuple(notes),
        write_roots=write_roots,
        write_targets=targets,
    )


def _refuse_mutating(manifest: Manifest, profile: Profile) -> None:
    """Refuse a mutating executor under a profile that refuses them (``read_only``)."""
    if profile.refuse_mutating and manifest.is_mutating:
        raise AutonomyDenied(
            f"{manifest.name} mutates files and autonomy is {profile.level}; "
            "run it under supervised or full autonomy"
        )


def _write_targets(
    effective: EffectiveCapabilities,
    checked: tuple[VettedValue, ...],
    write_roots: tuple[str, ...],
) -> tuple[str, ...]:
    """`Invocation.write_targets`: the resolved path arguments admitted by an ``fs:write``
    hint that lie under one of `write_roots`, each once, in order."""
    write_hints = {h for cap in effective.of("fs") if cap.mode == "write" for h in cap.hints}
    return tuple(
        dict.fromkeys(
            v.resolved
            for v in checked
            if v.kind == "path"
            and v.hint in write_hints
            and any(_under(v.resolved, root) for root in write_roots)
        )
    )


def _env(home: str) -> dict[str, str]:
    """The guest's whole environment: a fixed allow-list, nothing from the worker."""
    return {
        "PATH": "/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": home,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
    }


def _runtime_job(
    manifest: Manifest, entry: str, common: dict[str, Any], python: str | None
) -> SandboxJob:
    """The `SandboxJob` for `manifest`'s runtime, from the fields all runtimes share
    (`common`); see the module docstring for each runtime's argv."""
    if manifest.runtime == "python":
        interpreter = _realpath_fresh(python or sys.executable)
        if python is not None:
            prefix = os.path.dirname(os.path.dirname(interpreter))
            mounts = common["mounts"]
            common["mounts"] = (*mounts, Mount(host=prefix, guest=prefix, writable=False))
        return SandboxJob(argv=(interpreter, *PYTHON_FLAGS, entry), **common)
    if manifest.runtime == "wasm":
        return SandboxJob(wasm=WasmProgram(module=entry, args=(manifest.name,)), **common)
    return SandboxJob(
        wasm=WasmProgram(module=PYTHON_WASM_MODULE, args=(*_WASM_PYTHON_ARGV, entry)),
        **common,
    )


def _refuse_protected(cap: str, hint: str, root: str, protected: Collection[str]) -> None:
    """Refuse a hint whose folder `root` lies under or covers a `protected` path (see
    `plan_invocation`)."""
    for path in protected:
        if _under(root, path) or _under(path, root):
            where = "lies inside" if _under(root, path) and root != path else "covers"
            raise CapabilityDenied(
                f"{cap} hint {hint!r} {where} {path}, which belongs to the worker (executors, "
                "queue, state or caches): a job could change later jobs' code or the worker's "
                "own state through it; nothing ran. Narrow the hint, or keep the worker's "
                "folders out of the folders jobs may use"
            )


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")
