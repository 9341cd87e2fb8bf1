"""read_notes: list the notes in a folder, or read one note. Read-only.

Protocol: one JSON document of arguments on stdin, one JSON document on stdout. `path`
arrives already vetted and resolved by the runtime (it falls under ``~/notes/**``).
Exit status 1 with ``{"error": ...}`` when the path is missing or unreadable.
"""

import json
import os
import sys


def fail(message: str) -> int:
    json.dump({"error": message}, sys.stdout)
    sys.stdout.write("\n")
    return 1


def main() -> int:
    args = json.load(sys.stdin)
    path = os.path.expanduser(args["path"])
    max_bytes = int(args.get("max_bytes", 65536))
    if os.path.isdir(path):
        notes = []
        for folder, dirs, names in os.walk(path):
            dirs.sort()
            for name in sorted(names):
                full = os.path.join(folder, name)
                st = os.lstat(full)
                notes.append(
                    {
                        "path": os.path.relpath(full, path),
                        "bytes": st.st_size,
                        "modified": int(st.st_mtime),
                    }
                )
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
