"""Capabilities per invocation: final arguments, effective capabilities, argument vetting.

Three steps turn a manifest and the caller's arguments into what the invocation may touch:

1. `final_args` checks the arguments against the schema and fills in defaults.
2. `effective_capabilities` evaluates every ``when`` clause on those final values and sorts
   the declared capabilities into active and inactive ones (never raising: a malformed
   clause is an inactive capability with a reason), and extracts the provider bindings.
3. `vet_arguments` is the application-level filter, the *first* wall: every path-like
   argument must fall under a hint of an active ``fs:*`` capability and every URL/host
   argument under a hint of an active ``network:*`` capability, or the job is refused with
   `CapabilityDenied` before anything is launched. The kernel sandbox is the second wall;
   neither replaces the other.

Decisions worth knowing (each tested in ``tests/capabilities/test_capabilities.py``):

* **when values** are compared as strings: a final value of type string is itself, a
  boolean is ``"true"`` / ``"false"`` (the TOML/JSON spelling, so ``values = ["true"]``
  matches ``true``), an integer is its decimal form. A ``when`` may only name an argument of
  type string, integer or boolean; any other type makes the clause malformed (floats,
  arrays and objects have no single honest string form).
* **Provider bindings** are written ``[[capabilities]] name = "provider:access"``,
  ``hints = ["google_mail"]``: each hint names one skill, and only skills in
  `PROVIDER_SKILLS` bind. Any other claim grants nothing and is reported as inactive.
* **Path vetting** uses glob semantics per path segment: ``*``, ``?`` and ``[...]`` match
  inside one segment, ``**`` matches any number of segments (zero included, so
  ``~/notes/**`` admits ``~/notes`` itself). A hint without glob characters admits exactly
  that path, nothing below it (write ``dir/**`` for a tree). The argument is resolved with
  `os.path.realpath` (symlinks followed; for a path that does not exist yet, its existing
  part is resolved and the rest is normalised), so neither a symlink nor ``..`` can lead
  out of a hint. The hint's literal prefix (its folder) is taken as written, with ``~`` the
  job's real home, and refused with ``E_SYMLINKED_FOLDER`` when a symlink stands on the
  way: a hint's folder is what it names, never what a link (maybe planted by another job)
  points at (`metnos_exec.sandbox.mount_sources`).
* **Which arguments are vetted**: arguments declared ``format = "path"`` / ``"url"`` /
  ``"host"``; and, as defence in depth, any *undeclared* string (at any depth inside arrays
  and objects) that looks like a path (starts with ``/``, ``~`` or ``file:``), like a
  relative path climbing with dot segments (see below) or like a URL (``scheme://...``).
  An argument declared ``format = "text"`` is free text and is never vetted (a message that
  happens to begin with ``/`` must not be mistaken for a path).
* **Relative paths are refused**, declared or not: the executor's working folder is its
  own code folder (and on the direct arm, the host's), so ``../../etc/x`` would mean
  whatever that folder makes of it, never what the caller meant. An undeclared string is
  taken for a relative path when it equals ``.`` or ``..``, starts with ``./`` or ``../``,
  contains ``/../`` or ends with ``/..``; a plain relative name (``notes/a.md``) is not
  recognised (too many sentences contain a slash): declare such arguments
  ``format = "path"``, and then anything not absolute, ``~`` or ``file:`` is refused.
* **Rewriting**: a declared ``path`` argument is handed to the executor as the resolved
  absolute path (so ``~`` and symlinks mean inside the sandbox what they meant here, where
  mounts are made at resolved paths too); undeclared strings are vetted but passed as given.
* **URLs**: the scheme must equal the mode of an active network capability
  (``network:https`` admits ``https://`` only), the host must match one of its hints; a
  hint is a host name, ``*.example.com`` (any subdomain, at any depth, not the apex) or
  ``*`` (any host), optionally with ``:port``. URLs with credentials, whitespace, control
  characters or backslashes are refused outright (parsers disagree about them). A provider
  binding opens the network for the kernel wall but admits no URL argument.

The code: `effective` holds steps 1 and 2 (`final_args`, ``when`` clauses,
`effective_capabilities`), `vetting` step 3 (`vet_arguments`, `require_hint_folders`), and
`hints` what a hint admits (`match_path`, `match_host`, `resolve_path`), which vetting
applies. This module re-exports their names.
"""

from __future__ import annotations

from .effective import (
    PROVIDER_SKILLS,
    Capability,
    EffectiveCapabilities,
    InactiveCapability,
    effective_capabilities,
    final_args,
)
from .hints import match_host, match_path, resolve_path
from .vetting import VettedArgs, VettedValue, require_hint_folders, vet_arguments

__all__ = (
    "PROVIDER_SKILLS",
    "Capability",
    "EffectiveCapabilities",
    "InactiveCapability",
    "VettedArgs",
    "VettedValue",
    "effective_capabilities",
    "final_args",
    "match_host",
    "match_path",
    "require_hint_folders",
    "resolve_path",
    "vet_arguments",
)
