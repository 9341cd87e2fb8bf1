"""``metnos-exec worker``: serve jobs until SIGTERM or Ctrl-C (`metnos_exec.worker` does
the serving; this is its command line and the exit codes its failures mean)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..errors import BadConfig, BrokerError, MetnosError
from ._common import (
    EXIT,
    Subparsers,
    _check_url,
    _count,
    _Exit,
    _non_negative_float,
    _positive_float,
    _positive_int,
    _retention,
    add_command,
    os_error_exit,
)

_WARM_HELP = (
    "warm bwrap sandboxes kept per job template of an executor whose manifest sets no "
    "`warm` (default: $METNOS_WARM_SANDBOXES, else 0); at most max(8, 2 x concurrency) in all"
)


def _cmd_worker(ns: argparse.Namespace) -> int:
    from ..sandbox._bwrap_warm import WARM_DEFAULT_ENV
    from ..worker import ARM_OVERRIDE_ENV, run_worker

    _check_url(ns.broker)
    if ns.arm:
        os.environ[ARM_OVERRIDE_ENV] = ns.arm
    if ns.warm is not None:
        os.environ[WARM_DEFAULT_ENV] = str(ns.warm)
    retention: Any = "env"
    if ns.retention_days is not None:
        retention = _retention(ns.retention_days, "--retention-days")
    try:
        observer = _observer(ns)
        return run_worker(
            ns.broker,
            ns.executors,
            concurrency=ns.concurrency,
            worker_id=ns.worker_id,
            device=ns.device,
            log_file=ns.log_file,
            log_level=ns.log_level,
            grace_s=ns.grace,
            burst=ns.burst,
            visibility_s=ns.visibility,
            prefetch=ns.prefetch,
            backend=ns.backend,
            home=ns.home,
            retention_s=retention,
            state_dir=ns.state_dir,
            trust_keys=ns.trust_key or (),
            observer=observer,
        )
    except BrokerError as exc:
        # The store (before serving: cannot open, read-only; while serving: only a fatal
        # error, the queue file deleted or replaced) stopped the worker.
        raise _Exit(EXIT["broker"], str(exc)) from None
    except MetnosError as exc:
        # Everything else raised before serving is configuration: options, METNOS_*
        # variables, the broker URL, the executors folder.
        raise _Exit(EXIT["usage"], str(exc)) from None
    except OSError as exc:
        raise os_error_exit(exc) from None


def _observer(ns: argparse.Namespace) -> Any:
    """The worker's observer: ``--metrics`` checked (loopback unless ``--metrics-public``);
    traces when the process has an OpenTelemetry tracer provider."""
    from ..observe import make_observer
    from ..observe.http import check_bind

    if ns.metrics_public and not ns.metrics:
        raise BadConfig("--metrics-public needs --metrics HOST:PORT")
    bind = check_bind(ns.metrics, public=ns.metrics_public) if ns.metrics else None
    return make_observer(metrics=bind)


def _add_observe_options(w: argparse.ArgumentParser) -> None:
    w.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (needs the metrics "
        "extra); a loopback address unless --metrics-public; one port per worker",
    )
    w.add_argument(
        "--metrics-public",
        action="store_true",
        help="allow --metrics on an address outside loopback (the page names the "
        "queue's executors and error codes: put it behind your network's own wall)",
    )


def register(subparsers: Subparsers) -> None:
    """Add ``worker``."""
    w = add_command(
        subparsers,
        "worker",
        "serve jobs until SIGTERM/Ctrl-C",
        "Serve jobs: lease, vet, sandbox, run, store results. SIGTERM or Ctrl-C drains "
        "(no new jobs; running ones get --grace seconds, then are cancelled and handed "
        "back); a second signal stops at once.",
    )
    w.add_argument("--executors", required=True, metavar="DIR", help="folder of executors")
    w.add_argument(
        "--concurrency", type=_positive_int, default=4, metavar="N", help="jobs at once (4)"
    )
    w.add_argument("--warm", type=int, metavar="N", help=_WARM_HELP)
    w.add_argument("--log-file", metavar="FILE", help="JSON-lines log file (default: stderr)")
    w.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="the lowest level written (info)",
    )
    w.add_argument("--worker-id", metavar="ID", help="default: HOSTNAME-PID")
    w.add_argument("--device", default="server", metavar="ID", help="device id (server)")
    w.add_argument(
        "--grace", type=_non_negative_float, default=30.0, metavar="S", help="drain grace (30)"
    )
    w.add_argument(
        "--visibility",
        type=_positive_float,
        default=30.0,
        metavar="S",
        help="lease window: a job whose worker stops heart-beating is redelivered after it (30)",
    )
    w.add_argument(
        "--prefetch",
        type=_count,
        default=1,
        metavar="N",
        help="jobs leased ahead while every slot is busy, prepared and launched the moment "
        "a slot frees; 0 leaves them to other workers (1)",
    )
    w.add_argument(
        "--home", metavar="DIR", help="what ~ means in hints and arguments (default: $HOME)"
    )
    w.add_argument(
        "--retention-days",
        metavar="DAYS",
        help="purge finished jobs older than DAYS (a number, or 'never'), at start and "
        "hourly (default: $METNOS_RETENTION_DAYS, else 7)",
    )
    w.add_argument(
        "--state-dir",
        metavar="DIR",
        help="blobs (originals kept for undo), commit journals, staging mount points "
        "(default: $METNOS_STATE_DIR, else the queue's own folder in "
        "$XDG_STATE_HOME/metnos-exec/queues, else in ~/.local/state/metnos-exec/queues; "
        "an install from before keeps its one folder); an undo needs the blobs of the "
        "worker that committed",
    )
    w.add_argument(
        "--trust-key",
        action="append",
        metavar="PUB",
        help="verify every executor's signature with this public key (a file, or inline "
        "ed25519:BASE64) before planning its jobs, and run them from the verified copy; "
        "repeatable; also $METNOS_TRUST_KEYS (comma-separated). Required with --device",
    )
    _add_observe_options(w)
    w.add_argument("--burst", action="store_true", help="exit when the queue is empty")
    w.add_argument(
        "--backend",
        default="asyncio",
        choices=["asyncio", "trio"],
        help="the async library the worker runs on (asyncio)",
    )
    # Tests and benchmarks only: run every job in the echo double (queue cost alone).
    w.add_argument("--arm", choices=["echo"], help=argparse.SUPPRESS)
    w.set_defaults(fn=_cmd_worker)
