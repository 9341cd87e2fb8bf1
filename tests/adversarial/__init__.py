"""The adversarial suite (issue 8): escape attempts run as a real worker runs jobs.

Every row of `tests.adversarial.attempts` is a tiny executor (a manifest and a script,
written by the harness into a temporary executors root) that tries one escape and says
what it managed as one JSON line; `tests.adversarial.harness` serves the rows of a half
with one real ``metnos-exec worker`` process on a SQLite queue (planning from the
manifest, the arm the worker picks, staging and commit), phase by phase, and checks the
host afterwards (files planted, listeners reached, processes left, kernel settings).

Halves: ``test_bwrap`` (every row; as root, a root worker with slot uids; in
``.ci/run`` also as the unprivileged user ``metnos-ci``), ``test_wasm`` (what applies
to a WASI guest) and ``test_direct`` (``METNOS_SANDBOX=off``: each axis it reports
``not_kept`` is shown open). Each half runs once per anyio backend: the worker process
is started with ``--backend`` and the harness's own queue client runs on it too.

Adding a row: an `Attempt` with an id ``axis.what``, the axis it attacks, the mechanism
expected to stop it, the script (after `harness.PREAMBLE`: ``CTX``, ``HOME``, ``OWN``,
``sc()`` for raw system calls, ``attempt()``, ``done(escaped, ...)``), and, where the
escape shows on the host rather than in the job, a ``host_check``. A row that reveals a
defect stays and fails until the defect is fixed.
"""
