"""Signed executors: canonical tree hashes, Ed25519 signatures, and the worker's trust store.

A device worker runs code the server sent it; it must know that code is what the server
signed (spec section 10). The contract, in the order a worker applies it:

1. **What is signed.** Every regular file of the executor's folder, the manifest included,
   by its path relative to the folder (POSIX ``/``, sorted by its UTF-8 bytes) and the
   SHA-256 of its content: no timestamps, owners or modes, so the same tree signs the same
   on every machine. ``__pycache__`` folders are skipped (an interpreter's own cache, never
   staged, so never run). A symbolic link, a device, a FIFO or a socket anywhere in the
   folder is refused: its content is not in the folder, so it cannot be signed.
2. **The signature file** (`SIGNATURE_FILE`, ``manifest.sig``, beside the manifest; JSON)
   carries the key id, the per-file hashes and the Ed25519 signature over the canonical
   listing (`canonical_listing`). Carrying the hashes is what lets a refusal name the file
   that differs.
3. **Verification** (`TrustStore.verify`): the signature file must name a trusted key, its
   signature must verify over its own listing, and the folder's files must be exactly that
   listing. Anything else is `SignatureError` (``E_SIGNATURE``) naming the file, before
   the job is planned.
4. **No window between check and run.** A bubblewrap ``--ro-bind`` of the executor's own
   folder is a live view: a write on the host after the check (or during the run) would be
   seen by the guest. So the worker never runs the folder it checked: it writes the very
   bytes it hashed into a private, read-only copy keyed by the tree's digest
   (``$METNOS_CACHE_DIR/verified/<digest>/``) and plans the job from that copy (its
   manifest too is parsed from the verified bytes). The original folder may change at any
   time afterwards; what runs is still what was signed.
5. **Cached by content.** Re-hashing per job would cost milliseconds; instead each file
   and folder of both trees is remembered by ``(inode, size, mtime, ctime, mode)``. A job
   costs one ``lstat`` per entry (microseconds); any change to a file's content, to a
   folder's entries (a file added, removed or renamed), or to the private copy changes one
   of those and sends the executor back through step 3, so a change between two jobs is
   caught at the next one. The kernel sets ``ctime`` itself (no user call can set it back).
   An entry changed within `RACY_NS` of its check could share its timestamp with the
   version we read (coarse file-system clocks), so it is verified again once it has aged
   past that window, as git does with "racily clean" index entries. Even a change that
   slipped past the stat cache could not run: jobs run from the private copy, whose bytes
   were hashed.

   What remains: the private copy lives under the worker's cache folder, owned by the
   worker's user. A job granted ``fs:write`` over that folder (a hint such as ``~/**``
   when the cache is under ``~``) could alter another executor's copy; the next check of
   that executor sees the change (its ctime) and writes the copy again, but a job of it
   running at that moment could read the altered bytes. Keep ``METNOS_CACHE_DIR``
   outside every writable hint.

The code: `signed_tree` reads a folder as the canonical tree and holds the signature
file's format (steps 1 and 2), `trust` holds the `TrustStore` (steps 3 to 5), `keys` the
Ed25519 keys (from the ``cryptography`` package, imported only when keys are used); this
module signs (`sign_folder`) and re-exports their names.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

import msgspec

from ..errors import SignatureError
from .keys import (
    TRUST_KEYS_ENV,
    PublicKey,
    _crypto,
    _load_private_key,
    generate_key,
    key_id,
    load_public_key,
    load_trust_keys,
)
from .signed_tree import SIGNATURE_FILE, SignatureFile, canonical_listing, hash_tree, tree_digest
from .trust import RACY_NS, TrustStore, default_verified_dir

__all__ = (
    "RACY_NS",
    "SIGNATURE_FILE",
    "TRUST_KEYS_ENV",
    "PublicKey",
    "SignatureFile",
    "TrustStore",
    "canonical_listing",
    "default_verified_dir",
    "generate_key",
    "hash_tree",
    "key_id",
    "load_public_key",
    "load_trust_keys",
    "sign_folder",
    "tree_digest",
)


def sign_folder(folder: str | os.PathLike[str], key_path: str | os.PathLike[str]) -> Path:
    """Sign an executor folder with the private key at `key_path`; write `SIGNATURE_FILE`.

    Returns:
        The signature file's path.

    Raises:
        BadConfig: the key cannot be loaded (or cryptography is missing).
        SignatureError: the folder holds a symbolic link or special file, or has no
            ``manifest.toml``.
    """
    serialization = _crypto()
    key = _load_private_key(key_path)
    root = Path(folder)
    if not (root / "manifest.toml").is_file():
        raise SignatureError(f"{root}: no manifest.toml; not an executor folder")
    files = hash_tree(root)
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    sig = SignatureFile(
        key_id=key_id(raw),
        files=dict(sorted(files.items(), key=lambda kv: kv[0].encode("utf-8"))),
        signature=base64.b64encode(key.sign(canonical_listing(files))).decode(),
    )
    out = root / SIGNATURE_FILE
    tmp = root / f".{SIGNATURE_FILE}.tmp"
    tmp.write_bytes(msgspec.json.format(msgspec.json.encode(sig), indent=2) + b"\n")
    os.replace(tmp, out)
    return out
