"""word_count: word frequencies over the .md and .txt files of a read-only notes folder.

Runs under CPython-on-WASI (runtime `wasm-python`): the guest sees only its own folder and
the notes folder, both read-only. Protocol: one JSON document of arguments on stdin, one
JSON document on stdout.
"""

import json
import os
import re
import sys
from collections import Counter

WORD = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)?")
SUFFIXES = (".md", ".txt")


def main() -> int:
    args = json.load(sys.stdin)
    root = args["path"]
    top = int(args.get("top", 10))
    counts: Counter[str] = Counter()
    files = 0
    # A folder's notes, or one note (os.walk of a file yields nothing).
    walk = [(os.path.dirname(root), [], [os.path.basename(root)])]
    for folder, dirs, names in os.walk(root) if os.path.isdir(root) else walk:
        dirs.sort()
        for name in sorted(names):
            if not name.endswith(SUFFIXES):
                continue
            with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                counts.update(w.lower() for w in WORD.findall(f.read()))
            files += 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    json.dump({"files": files, "words": sum(counts.values()), "top": ranked}, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
