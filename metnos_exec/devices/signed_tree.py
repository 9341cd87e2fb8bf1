"""What is signed: an executor's folder read as a canonical tree, and the signature file.

Steps 1 and 2 of `signing`'s contract. `_read_tree` walks the folder (refusing links and
special files) and reads every regular file once, keeping its hash, its exact bytes (the
private copy is written from them) and each entry's stat key (what the trust store's cache
compares); `canonical_listing` is what a signature covers and `tree_digest` the content
address of a tree. `SignatureFile` is the format of ``manifest.sig``.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import msgspec

from ..errors import SignatureError

__all__ = (
    "SIGNATURE_FILE",
    "SignatureFile",
    "canonical_listing",
    "hash_tree",
    "tree_digest",
)

#: The signature's file name, beside ``manifest.toml``; never part of what is signed.
SIGNATURE_FILE: Final = "manifest.sig"

#: Folders skipped when hashing and staging (never run: the private copy has none).
SKIPPED_DIRS: Final = frozenset({"__pycache__"})

#: A tree larger than this is refused rather than read into memory for hashing.
MAX_TREE_BYTES: Final = 256 * 1024 * 1024

_DOMAIN = b"metnos-exec executor signature v1\n"


class SignatureFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The content of ``manifest.sig``.

    Attributes:
        v: format version (1).
        algorithm: ``"ed25519"``.
        key_id: `key_id` of the public key that verifies `signature`.
        files: relative path → SHA-256 (hex) of every signed file.
        signature: base64 Ed25519 signature over `canonical_listing` of `files`.
    """

    key_id: str
    files: dict[str, str]
    signature: str
    v: int = 1
    algorithm: str = "ed25519"


_sig_decoder = msgspec.json.Decoder(SignatureFile)


def _refuse(folder: Path, rel: str, what: str) -> SignatureError:
    return SignatureError(
        f"{folder}: {rel} is {what}; a signed executor holds only regular files inside its "
        "folder (copy the file in instead)"
    )


def _walk(folder: Path) -> Iterable[tuple[str, str, os.stat_result]]:
    """(relative path, absolute path, lstat) of every entry, folders included, sorted.

    Raises:
        SignatureError: a symbolic link or a special file.
    """
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        abs_dir = os.path.join(folder, rel_dir) if rel_dir else str(folder)
        with os.scandir(abs_dir) as it:
            names = sorted(e.name for e in it)
        subdirs = []
        for name in names:
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if "\n" in rel or "\\" in rel:
                raise _refuse(folder, repr(rel), "a name holding a newline or backslash")
            try:
                rel.encode("utf-8")
            except UnicodeEncodeError:
                # The listing is sorted and signed as UTF-8: such a name cannot be signed
                # (it crashed a worker with a trust key at start).
                shown = rel.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
                raise _refuse(folder, f"'{shown}'", "a name that is not valid UTF-8") from None
            path = os.path.join(abs_dir, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                raise _refuse(folder, rel, "a symbolic link")
            if stat.S_ISDIR(st.st_mode):
                if name in SKIPPED_DIRS:
                    continue
                yield rel, path, st
                subdirs.append(rel)
            elif stat.S_ISREG(st.st_mode):
                if rel == SIGNATURE_FILE:
                    continue
                yield rel, path, st
            else:
                raise _refuse(folder, rel, "not a regular file (a device, FIFO or socket)")
        stack.extend(reversed(subdirs))


@dataclass(frozen=True)
class _Tree:
    """What was read from a folder: hashes, the exact bytes, and each entry's stat key."""

    files: dict[str, str]
    contents: dict[str, bytes]
    stats: tuple[tuple[str, tuple[int, ...]], ...]


def _stat_key(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_mode)


def _read_tree(folder: Path) -> _Tree:
    files: dict[str, str] = {}
    contents: dict[str, bytes] = {}
    stats: list[tuple[str, tuple[int, ...]]] = [(".", _stat_key(os.lstat(folder)))]
    total = 0
    for rel, path, st in _walk(folder):
        if stat.S_ISDIR(st.st_mode):
            stats.append((rel, _stat_key(st)))
            continue
        # O_NOFOLLOW: the entry was a regular file at lstat; a link swapped in since is
        # refused rather than followed out of the folder. O_NONBLOCK: a FIFO swapped in
        # is refused below rather than waited on for ever.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode):
                raise _refuse(folder, rel, "not a regular file")
            total += before.st_size
            if total > MAX_TREE_BYTES:
                raise SignatureError(f"{folder}: larger than {MAX_TREE_BYTES >> 20} MiB")
            chunks = []
            while chunk := os.read(fd, 1 << 20):
                chunks.append(chunk)
            after = os.fstat(fd)
        finally:
            os.close(fd)
        data = b"".join(chunks)
        if _stat_key(before) != _stat_key(after) or len(data) != after.st_size:
            raise SignatureError(f"{folder}: {rel} changed while it was being read; try again")
        files[rel] = hashlib.sha256(data).hexdigest()
        contents[rel] = data
        # The key of the file we read (the same inode the path named at lstat).
        stats.append((rel, _stat_key(before)))
    ordered = dict(sorted(files.items(), key=lambda kv: kv[0].encode("utf-8")))
    return _Tree(files=ordered, contents=contents, stats=tuple(stats))


def hash_tree(folder: str | os.PathLike[str]) -> dict[str, str]:
    """Relative path → SHA-256 of every file `sign_folder` would sign (sorted).

    Raises:
        SignatureError: the folder holds a symbolic link or a special file.
    """
    return _read_tree(Path(folder)).files


def canonical_listing(files: Mapping[str, str]) -> bytes:
    """The bytes an executor signature covers: a domain line, then ``<sha256>  <path>``
    per file, sorted by the path's UTF-8 bytes (no timestamps, owners or modes)."""
    lines = [
        f"{digest}  {rel}\n"
        for rel, digest in sorted(files.items(), key=lambda kv: kv[0].encode("utf-8"))
    ]
    return _DOMAIN + "".join(lines).encode("utf-8")


def tree_digest(files: Mapping[str, str]) -> str:
    """SHA-256 of `canonical_listing`: the content address of a signed tree."""
    return hashlib.sha256(canonical_listing(files)).hexdigest()


def _read_stats(root: Path) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The stat keys of a tree we just wrote (no hashing)."""
    return tuple(
        [(".", _stat_key(os.lstat(root)))] + [(rel, _stat_key(st)) for rel, _, st in _walk(root)]
    )
