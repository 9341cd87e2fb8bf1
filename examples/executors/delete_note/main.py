"""delete_note: delete one note (a regular file) under ~/notes; folders are refused."""

import json
import os
import sys


def out(doc: dict, code: int) -> int:
    json.dump(doc, sys.stdout)
    sys.stdout.write("\n")
    return code


def main() -> int:
    args = json.load(sys.stdin)
    path = args["path"]
    if os.path.isdir(path):
        return out({"error": f"{path} is a folder; delete_note removes single notes only"}, 1)
    try:
        size = os.lstat(path).st_size
        os.unlink(path)
    except OSError as exc:
        return out({"error": f"cannot delete {path}: {exc.strerror}"}, 1)
    return out({"deleted": path, "bytes": size}, 0)


if __name__ == "__main__":
    sys.exit(main())
