"""read_notes: list the notes in a folder, or read one note. Read-only.

Protocol: one JSON document of arguments on stdin, one JSON document on stdout. `path`
arrives already vetted and resolved by the runtime (it falls under ``~/notes/**``).
Exit status 1 with ``{"error": ...}`` when the path is missing or unreadable.

Listing a folder, it reports its progress as it goes (README, "Reporting progress"): one
JSON line per note on the descriptor named by ``METNOS_PROGRESS_FD``, when the worker
offers one.
"""

import json
import os
import sys


def fail(message: str) -> int:
    json.dump({"error": message}, sys.stdout)
    sys.stdout.write("\n")
    return 1


def progress_reporter():
    """A function that writes one progress line, or does nothing without a channel."""
    fd = os.environ.get("METNOS_PROGRESS_FD")
    if fd is None:
        return lambda fraction, message: None
    channel = os.fdopen(int(fd), "w", buffering=1)  # line-buffered: one write a line

    def report(fraction: float, message: str) -> None:
        channel.write(json.dumps({"progress": fraction, "message": message}) + "\n")

    return report


def main() -> int:
    args = json.load(sys.stdin)
    path = os.path.expanduser(args["path"])
    max_bytes = int(args.get("max_bytes", 65536))
    if os.path.isdir(path):
        report = progress_reporter()
        found = []
        for folder, dirs, names in os.walk(path):
            dirs.sort()
            found += [os.path.join(folder, name) for name in sorted(names)]
        notes = []
        for i, full in enumerate(found):
            report(i / len(found), f"note {i + 1} of {len(found)}")
            st = os.lstat(full)
            notes.append(
                {
                    "path": os.path.relpath(full, path),
                    "bytes": st.st_size,
                    "modified": int(st.st_mtime),
                }
            )
        report(1.0, f"{len(found)} notes listed")
        json.dump({"kind": "folder", "path": path, "notes": notes}, sys.stdout)
    else:
        try:
            with open(path, "rb") as f:
                data = f.read(max_bytes + 1)
        except OSError as exc:
            return fail(f"cannot read {path}: {exc.strerror}")
        text = data[:max_bytes].decode("utf-8", errors="replace")
        json.dump(
            {"kind": "note", "path": path, "text": text, "truncated": len(data) > max_bytes},
            sys.stdout,
        )
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
