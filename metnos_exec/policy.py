"""Policy: autonomy levels as profiles, and when a job may run without its kernel wall.

The sandbox modules stay a mechanical translation of a `SandboxJob` into walls; *which*
walls a level of autonomy asks for is decided here, in one table (`PROFILES`), before the
job is built by `metnos_exec.plan`.

Autonomy (spec §11):

=============  =====================  ===============  ======================
level          force_read_only_mounts  refuse_mutating  allow_network_override
=============  =====================  ===============  ======================
``read_only``  yes                     yes              no
``supervised`` no                      no               no
``full``       no                      no               yes
=============  =====================  ===============  ======================

* ``force_read_only_mounts``: every ``fs:write`` mount becomes read-only.
* ``refuse_mutating``: an executor whose manifest says it mutates (`Manifest.is_mutating`)
  is refused with `AutonomyDenied` before anything runs.
* ``allow_network_override``: the kernel wall lets the guest use the network even when no
  ``network:*`` capability is active. Argument vetting is unchanged: a URL argument still
  needs a ``network:*`` hint; ``full`` widens the kernel wall, never the first wall.

Degradation (spec §5): `Policy.require_sandbox` says for which executors running without a
kernel wall (the direct arm) is refused with ``E_SANDBOX_REQUIRED`` instead:

* ``"fs_write"`` (default): executors with an *active* ``fs:write`` capability.
* ``"always"``: every executor.
* ``"never"``: none (degradation is always allowed, and always reported).

Configured from the environment with ``METNOS_REQUIRE_SANDBOX=fs_write|always|never``
(`Policy.from_env`); an unknown value is a configuration error, not a silent default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Literal, cast, get_args

import msgspec

from .capabilities import EffectiveCapabilities
from .errors import AutonomyDenied, BadConfig
from .manifest import Manifest

__all__ = (
    "DEFAULT_AUTONOMY",
    "PROFILES",
    "AutonomyLevel",
    "Policy",
    "Profile",
    "RequireSandbox",
    "profile_for",
    "require_sandbox",
)

AutonomyLevel = Literal["read_only", "supervised", "full"]
RequireSandbox = Literal["fs_write", "always", "never"]

DEFAULT_AUTONOMY: AutonomyLevel = "supervised"


class Profile(msgspec.Struct, frozen=True):
    """What one autonomy level does to an invocation (see the module table)."""

    level: AutonomyLevel
    force_read_only_mounts: bool
    refuse_mutating: bool
    allow_network_override: bool


#: The autonomy table. The only place a level is given meaning.
PROFILES: Mapping[AutonomyLevel, Profile] = {
    "read_only": Profile("read_only", True, True, False),
    "supervised": Profile("supervised", False, False, False),
    "full": Profile("full", False, False, True),
}


def profile_for(level: str) -> Profile:
    """The profile of an autonomy level.

    Raises:
        AutonomyDenied: `level` is not one of ``read_only``, ``supervised``, ``full``
            (an unknown level must not fall back to a more permissive one).
    """
    try:
        return PROFILES[cast(AutonomyLevel, level)]
    except KeyError:
        raise AutonomyDenied(
            f"unknown autonomy level {level!r}; use one of {', '.join(PROFILES)}"
        ) from None


class Policy(msgspec.Struct, frozen=True):
    """Operator policy that is not part of any manifest.

    Attributes:
        require_sandbox: for which executors degradation to the direct arm is refused
            (``E_SANDBOX_REQUIRED``); see the module docstring.
        host_network: a job with a network capability gets the host's network, not the
            network wall (``METNOS_HOST_NETWORK=1``): the operator's choice, reported
            ``not_kept``. Off by default.
        egress_deny: host patterns no job may reach whatever its manifest says
            (``METNOS_EGRESS_DENY``, comma-separated; ``host``, ``*.domain``, an
            address, each optionally ``:port``): deny wins.
    """

    require_sandbox: RequireSandbox = "fs_write"
    host_network: bool = False
    egress_deny: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Policy:
        """Read ``METNOS_REQUIRE_SANDBOX`` (unset or empty → the default, ``fs_write``).

        Raises:
            BadConfig: (``E_CONFIG``) the variable holds something else than the three
                values; a worker must refuse to start on it.
        """
        env = os.environ if environ is None else environ
        raw = env.get("METNOS_REQUIRE_SANDBOX", "").strip().lower() or "fs_write"
        allowed = get_args(RequireSandbox)
        if raw not in allowed:
            raise BadConfig(
                f"METNOS_REQUIRE_SANDBOX={raw!r} is not a policy; set it to one of "
                f"{', '.join(allowed)} (or leave it unset for fs_write)"
            )
        host = env.get("METNOS_HOST_NETWORK", "").strip().lower()
        if host not in ("", "0", "1", "true", "false", "yes", "no"):
            raise BadConfig(
                f"METNOS_HOST_NETWORK={host!r}: set it to 1 (jobs with a network capability "
                "get the host network) or 0 (the network wall, the default)"
            )
        deny = tuple(p.strip() for p in env.get("METNOS_EGRESS_DENY", "").split(",") if p.strip())
        return cls(
            require_sandbox=cast(RequireSandbox, raw),
            host_network=host in ("1", "true", "yes"),
            egress_deny=deny,
        )

    def sandbox_required(self, manifest: Manifest, effective: EffectiveCapabilities) -> bool:
        """Whether this invocation must be refused rather than run unsandboxed."""
        del manifest  # part of the signature so a richer rule needs no new call sites
        if self.require_sandbox == "always":
            return True
        if self.require_sandbox == "never":
            return False
        return effective.fs_write


def require_sandbox(
    manifest: Manifest, effective: EffectiveCapabilities, policy: Policy | None = None
) -> bool:
    """`Policy.sandbox_required` with the environment's policy when none is given."""
    return (policy or Policy.from_env()).sandbox_required(manifest, effective)
