"""move_note: move or rename one note inside ~/notes.

Both paths arrive vetted and resolved. The move is a single rename (atomic within one
filesystem); an existing destination is refused unless ``overwrite`` is true.
"""

import json
import os
import sys


def out(doc: dict, code: int) -> int:
    json.dump(doc, sys.stdout)
    sys.stdout.write("\n")
    return code


def main() -> int:
    args = json.load(sys.stdin)
    src, dst, overwrite = args["src"], args["dst"], bool(args.get("overwrite", False))
    if not os.path.isfile(src):
        return out({"error": f"{src} is not a note (no such file)"}, 1)
    if os.path.isdir(dst):
        dst = os.path.join(dst, os.path.basename(src))
    if os.path.exists(dst) and not overwrite:
        return out({"error": f"{dst} exists; pass overwrite=true to replace it"}, 1)
    try:
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.replace(src, dst)
    except OSError as exc:
        return out({"error": f"cannot move {src} to {dst}: {exc.strerror}"}, 1)
    return out({"moved": src, "to": dst}, 0)


if __name__ == "__main__":
    sys.exit(main())
