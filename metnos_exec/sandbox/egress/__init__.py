"""The network wall: a job with a network capability reaches the hosts it names, nothing else.

The contract, which every piece below is written against:

* **Its own network.** A job whose network is filtered runs in a network namespace of its
  own (bubblewrap's ``--unshare-net``): its loopback only, no route anywhere. Its traffic
  leaves only through listeners the worker puts into that namespace before the job's
  first instruction (`bridge`): a short-lived child of a small helper process enters the
  job's user and network namespaces, binds them there, hands them back over
  ``SCM_RIGHTS`` and exits; the worker accepts on them in its own namespace, so every
  connection is attributed to its job. No Unix socket, tun device or extra binary inside.
* **One decision point, fixed for the job's life, failing closed** (`policy`): the host
  (exact, or ``*.domain``), the port (``network:https`` 443 unless the hint names one,
  ``network:http`` 80), deny wins; names are resolved by the worker, a name resolving to
  loopback, private, link-local (metadata) or multicast addresses is refused unless the
  hint names that address; the worker connects to the addresses it checked.
* **The ways out** (`wall`): an HTTP proxy (CONNECT and absolute-form, `http_proxy`) and a
  SOCKS5 CONNECT proxy with ``socks5h`` semantics (`socks`), both on the job's loopback
  and named by the usual proxy variables; a hint naming a literal address and port
  (``127.0.0.1:8080``) appears at that very address and port inside the job, forwarded.
  Anything else the job tries finds nothing listening.
* **Refusals say they are policy**: a 403 whose body and ``X-Metnos-Egress`` header name
  the host and "blocked by the executor's manifest"; SOCKS reply 2 ("connection not
  allowed by ruleset"); a forwarded connection closed at once.
* **Accounted and bounded**: each connection becomes one `EgressRecord` (host, port,
  bytes each way, allowed or refused and why) in the job's result and an
  ``egress.allowed`` / ``egress.refused`` log record; connections at once and bytes per
  job are bounded (`EgressLimits`), idle connections closed.
* **Nothing outlives the job**: the listeners and every relayed connection live in a task
  group inside the job's run; when the job ends they are cancelled and closed.
"""

from __future__ import annotations

from .policy import (
    Authorized,
    EgressLimits,
    EgressPolicy,
    Refused,
    Resolver,
    Rule,
    authorize,
    is_public,
    normalise_host,
    policy_for,
    system_resolver,
)
from .record import EgressRecord

__all__ = (
    "Authorized",
    "EgressLimits",
    "EgressPolicy",
    "EgressRecord",
    "Refused",
    "Resolver",
    "Rule",
    "authorize",
    "is_public",
    "normalise_host",
    "policy_for",
    "system_resolver",
)
