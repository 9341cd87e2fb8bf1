"""The Redis queue's key names and scripts: `KEY_NAMES` (every key after the queue's
prefix), `Keys` (them built for one prefix) and `SCRIPTS` (``redis.lua``'s sections, with
the key names substituted in, each after the shared prelude)."""

from __future__ import annotations

import re
from importlib import resources
from typing import Final

__all__ = ("GROUP", "KEY_NAMES", "SCRIPTS", "Keys")

#: The consumer group every job stream has; workers are its consumers (by worker id).
GROUP: Final = "workers"


#: Every Redis key name, in one place: what follows the queue's prefix (``{metnos}:``).
#: Names ending in ``:`` take a part (a job id, a device, ...). `Keys` builds them for the
#: code; `SCRIPTS` gets them substituted into ``redis.lua`` (``$job``, ``$stream``, ...).
KEY_NAMES: Final = {
    "job": "job:",  # job:<id> hash
    "stream": "q:",  # q:<device>:<priority>:<executor> stream (one per route)
    "priorities": "prios:",  # prios:<device> sorted set of routes, scored by priority
    "leases": "leases:",  # leases:<device> sorted set
    "idempotency": "idem:",  # idem:<key> string
    "delayed": "delayed",
    "finished": "finished",
    "expiring": "expiring",  # finished jobs with a result_ttl_s, by when they may go
    "dead": "dead",
    "counts": "counts",
    "inbox": "inbox",
    "executors": "executors",
    "devices": "devices",  # set: the devices with job streams (status's queued counts)
    "workers": "workers",  # hash: worker id -> its presence record (brokers/presence.py)
    "undo": "undo:",  # undo:<entry id> hash
    "job_undos": "undos:",  # undos:<job id> set
    "undo_at": "undo-at",
    "blobs": "undo-blobs",
    "epoch": "epoch",  # the data set's marker (string, `_redis_watch`)
    "lost": "lost",  # hash: marker -> a data loss found (`_redis_watch`)
    "wake": "wake",  # stream: routes work became ready on, for blocked idle workers
    "done": "done:",  # done:<id> stream: the job finished, for a client blocked on it
    "aside": "aside:",  # aside:<key name>:<time>: a key set aside by the guard (any type)
    "group": GROUP,  # not a key: the consumer group of every stream
}


def _load_scripts() -> dict[str, str]:
    text = resources.files(__package__).joinpath("redis.lua").read_text(encoding="utf-8")
    text = re.sub(r"\$(\w+)", lambda m: KEY_NAMES[m.group(1)], text)
    parts = re.split(r"^-- == (\w+) ==\n", text, flags=re.MULTILINE)
    sections = dict(zip(parts[1::2], parts[2::2], strict=True))
    prelude = sections.pop("prelude")
    return {name: f"local SCRIPT = '{name}'\n" + prelude + body for name, body in sections.items()}


#: Script name → source (the prelude and the section), from ``redis.lua``.
SCRIPTS: Final = _load_scripts()


class Keys:
    """Every key of one queue (`KEY_NAMES` after the prefix).

    Args:
        prefix: the namespace; wrapped in a hash tag, so ``metnos`` gives ``{metnos}:``.
    """

    def __init__(self, prefix: str) -> None:
        if not prefix or any(c in prefix for c in "{}"):
            raise ValueError(f"a key prefix is a non-empty name without braces, got {prefix!r}")
        #: What every key starts with (the scripts' ``P``).
        self.base = "{" + prefix + "}:"
        self.counts = self.base + KEY_NAMES["counts"]
        self.delayed = self.base + KEY_NAMES["delayed"]
        self.finished = self.base + KEY_NAMES["finished"]
        self.expiring = self.base + KEY_NAMES["expiring"]
        self.dead = self.base + KEY_NAMES["dead"]
        self.inbox = self.base + KEY_NAMES["inbox"]
        self.executors = self.base + KEY_NAMES["executors"]
        self.workers = self.base + KEY_NAMES["workers"]
        self.blobs = self.base + KEY_NAMES["blobs"]
        self.epoch = self.base + KEY_NAMES["epoch"]
        self.lost = self.base + KEY_NAMES["lost"]
        self.wake = self.base + KEY_NAMES["wake"]

    def job(self, job_id: str) -> str:
        return self.base + KEY_NAMES["job"] + job_id

    def stream(self, device: str, priority: int, executor: str = "") -> str:
        """A device's stream for one route: `priority` and `executor` (``""``: the route
        of a build before executor routing, read by every worker)."""
        route = f"{priority}:{executor}" if executor else str(priority)
        return f"{self.base}{KEY_NAMES['stream']}{device}:{route}"

    def done(self, job_id: str) -> str:
        return self.base + KEY_NAMES["done"] + job_id

    def priorities(self, device: str) -> str:
        return self.base + KEY_NAMES["priorities"] + device

    def leases(self, device: str) -> str:
        return self.base + KEY_NAMES["leases"] + device

    def idempotency(self, key: str) -> str:
        return self.base + KEY_NAMES["idempotency"] + key
