"""The live view of the queue: ``metnos-exec web`` in a browser, ``metnos-exec top`` in a
terminal (issue 20).

Both show one `snapshot.overview` (counts by state, running jobs with their elapsed
time, recent results with their five walls, dead letters, workers and their health) and,
in the browser, one job's `snapshot.detail`. The page is three static files served by
the app (`app`): no build step, nothing from another origin, it works offline; it polls
``/api/overview`` every second.

The contract, for whoever changes it:

- *Read-only by default.* Cancel, undo and retry (a dead letter) exist only with
  ``--allow-actions``, which needs a token; a bind other than loopback needs a token too
  (`serve.check_settings`).
- *Job data is hostile.* Arguments, outputs, stderr, error messages, even job ids and
  executor names written by a producer: the page inserts them with ``textContent`` only,
  under a Content-Security-Policy without inline script; ``top`` prints them through
  `metnos_exec._terminal.visible` into rich `Text` (no markup). A test loads a job whose
  output holds ``<img src=x onerror=...>`` and terminal escapes in a real browser.
- *No other site may act or read.* The token travels in a header the page's script sets
  (a form or an image cannot), an action's ``Origin`` must be the view's, and on a
  loopback bind the ``Host`` must be a loopback name (DNS rebinding). See `app`.

Modules: `snapshot` (what is shown; no dependency), `app` and `serve` (need starlette and
hypercorn: ``pip install 'metnos-exec[web]'``), `top` (needs rich, same extra). Only
`snapshot` is imported here, so ``top`` never needs starlette.

Layer: an entry unit, like `cli` (which starts it): it reads `brokers` and acts through
`client`.
"""

from __future__ import annotations

from .snapshot import RunningClock, detail, overview

__all__ = ("RunningClock", "detail", "overview")
