"""write_note: append a line to a note, replace it, or append and push it to the sync server.

The manifest is the spec's (§14) plus two ``format`` lines: `path` is ``format = "path"``,
so the runtime vets it against ``~/notes/**`` and hands it over resolved (absolute,
symlinks followed); `text` is ``format = "text"``, so a note such as
``https://example.com`` or ``~/todo`` is never mistaken for a path or a URL. ``~`` is
still expanded here against ``$HOME`` (the job's home), so the code also works when run by
hand. Modes:

* ``append`` (default): add `text` and a newline at the end (the note is created if needed).
* ``replace``: the note becomes `text` (written to a temporary file, then renamed, so a
  reader never sees half a note).
* ``sync``: ``append``, then PUT the note to https://notes.example.com; the network
  capability is active only in this mode. A failed push is reported (``synced: false``),
  the local write stands.
"""

import json
import os
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request

SYNC_URL = "https://notes.example.com/v1/notes/"


def append(path: str, text: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(text + "\n")


def replace(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".write_note-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def push(path: str) -> tuple[bool, str | None]:
    with open(path, "rb") as f:
        body = f.read()
    url = SYNC_URL + urllib.parse.quote(os.path.basename(path))
    request = urllib.request.Request(url, data=body, method="PUT")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return 200 <= response.status < 300, None
    except (urllib.error.URLError, OSError) as exc:
        return False, str(exc)


def main() -> int:
    args = json.load(sys.stdin)
    path = os.path.expanduser(args["path"])
    text, mode = args["text"], args.get("mode", "append")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if mode == "replace":
            replace(path, text)
        else:
            append(path, text)
    except OSError as exc:
        json.dump({"error": f"cannot write {path}: {exc.strerror}"}, sys.stdout)
        sys.stdout.write("\n")
        return 1
    result = {"path": path, "mode": mode, "bytes": os.path.getsize(path)}
    if mode == "sync":
        result["synced"], result["sync_error"] = push(path)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
