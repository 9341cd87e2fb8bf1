"""Generate the queue's JSON Schemas, and ``manifest.toml``'s, from the msgspec Structs.

``python -m metnos_exec._schemas`` rewrites ``queue/schemas/*.json`` in a source checkout;
``--check`` only reports whether they are stale (exit 1), which is what the test does. The
Structs in `metnos_exec.messages` (and `manifest.Manifest`, for ``manifest.json``: the
schema of an executor's ``manifest.toml`` read as TOML, for editors and CI, and of the
manifests the workers publish in the catalog) are the single source of truth: never edit
the JSON by hand.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import msgspec

from .manifest import Manifest
from .messages import DeadLetter, Job, Progress, Result, UndoEntry

__all__ = ("SCHEMA_DIR", "main", "render")

#: ``queue/schemas`` of the source checkout this module lives in.
SCHEMA_DIR = Path(__file__).resolve().parent.parent / "queue" / "schemas"

_MESSAGES: dict[str, type[msgspec.Struct]] = {
    "job.json": Job,
    "result.json": Result,
    "dead_letter.json": DeadLetter,
    "undo_entry.json": UndoEntry,
    "progress.json": Progress,
}

_TITLES: dict[str, str] = {
    "manifest.json": "metnos-exec executor manifest (manifest.toml, read as TOML)",
}


def render() -> dict[str, bytes]:
    """File name -> schema text (JSON Schema 2020-12, two-space indent, final newline)."""
    out: dict[str, bytes] = {}
    structs: dict[str, type[msgspec.Struct]] = {**_MESSAGES, "manifest.json": Manifest}
    for name, struct in structs.items():
        title = _TITLES.get(name, f"metnos-exec {struct.__name__} message, wire version 1")
        schema: dict[str, Any] = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"https://metnos.invalid/queue/schemas/{name}",
            "title": title,
            **msgspec.json.schema(struct),
        }
        text = msgspec.json.format(msgspec.json.encode(schema), indent=2)
        out[name] = text + b"\n"
    return out


def stale(folder: Path = SCHEMA_DIR) -> list[str]:
    """Names of schema files in `folder` that are missing or differ from `render()`."""
    names = []
    for name, text in render().items():
        path = folder / name
        if not path.is_file() or path.read_bytes() != text:
            names.append(name)
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m metnos_exec._schemas", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=SCHEMA_DIR, help="target folder")
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    if args.check:
        names = stale(args.out)
        for name in names:
            print(f"stale: {args.out / name}", file=sys.stderr)
        return 1 if names else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        (args.out / name).write_bytes(text)
        print(f"wrote {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
