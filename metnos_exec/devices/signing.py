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

Keys: `generate_key` writes a PKCS#8 PEM private key (mode 0600) and a one-line public key
``ed25519:<base64 of the 32 raw bytes>`` (``KEY.pub``); `load_public_key` takes that line
inline, or a file holding it or a PEM public key. Ed25519 comes from the ``cryptography``
package (``pip install 'metnos-exec[device]'``), imported only when keys are used.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import msgspec

from ..errors import BadConfig, SignatureError
from ..private import private_dir

if TYPE_CHECKING:  # pragma: no cover
    from cryptography.hazmat.primitives.asymmetric.ed25519 import (
        Ed25519PrivateKey,
        Ed25519PublicKey,
    )

    from ..manifest import Executor

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

#: The signature's file name, beside ``manifest.toml``; never part of what is signed.
SIGNATURE_FILE: Final = "manifest.sig"
#: Extra trusted public keys for a worker: comma-separated, each a file path or an inline
#: ``ed25519:BASE64`` key.
TRUST_KEYS_ENV: Final = "METNOS_TRUST_KEYS"
#: Entries changed this close to their check are verified again once older (see 5 above).
RACY_NS: Final = 100_000_000
#: Folders skipped when hashing and staging (never run: the private copy has none).
SKIPPED_DIRS: Final = frozenset({"__pycache__"})
#: A signature file larger than this is refused unread (it lists hashes: ~100 bytes a file).
MAX_SIGNATURE_BYTES: Final = 16 * 1024 * 1024
#: A tree larger than this is refused rather than read into memory for hashing.
MAX_TREE_BYTES: Final = 256 * 1024 * 1024

_DOMAIN = b"metnos-exec executor signature v1\n"
_INLINE_PREFIX = "ed25519:"
_INSTALL_HINT = "install the device extra: pip install 'metnos-exec[device]'"


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


@dataclass(frozen=True)
class PublicKey:
    """A trusted Ed25519 public key and where it came from (for messages)."""

    raw: bytes
    source: str

    @property
    def id(self) -> str:
        return key_id(self.raw)

    def verify(self, signature: bytes, data: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        key: Ed25519PublicKey = Ed25519PublicKey.from_public_bytes(self.raw)
        try:
            key.verify(signature, data)
        except InvalidSignature:
            return False
        return True


def key_id(raw_public: bytes) -> str:
    """A short, stable name for a public key: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(raw_public).hexdigest()[:16]


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import serialization
    except ImportError as exc:
        raise BadConfig(
            f"Ed25519 needs the cryptography package ({exc}); {_INSTALL_HINT}"
        ) from None
    return serialization


# --- hashing --------------------------------------------------------------------------


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


# --- keys and signing -----------------------------------------------------------------


def generate_key(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """Write a new Ed25519 private key to `path` (PEM, mode 0600) and its public key to
    ``<path>.pub`` (one line, ``ed25519:<base64>``). Refuses to overwrite.

    Returns:
        (private key path, public key path).

    Raises:
        BadConfig: cryptography is not installed, or a key file already exists.
    """
    serialization = _crypto()
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    priv_path = Path(path)
    pub_path = priv_path.with_name(priv_path.name + ".pub")
    for p in (priv_path, pub_path):
        if p.exists():
            raise BadConfig(f"{p} already exists; refusing to overwrite a key")
    private_dir(priv_path.parent)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)  # exactly, whatever the umask
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub_path.write_text(_INLINE_PREFIX + base64.b64encode(raw).decode() + "\n")
    return priv_path, pub_path


def _load_private_key(path: str | os.PathLike[str]) -> Ed25519PrivateKey:
    serialization = _crypto()
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise BadConfig(f"cannot read the signing key {path}: {exc.strerror}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise BadConfig(f"{path} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise BadConfig(f"{path} is not an Ed25519 key ({type(key).__name__})")
    return key


def load_public_key(spec: str) -> PublicKey:
    """A trusted key from an inline ``ed25519:BASE64`` or a file holding that line or a
    PEM public key.

    Raises:
        BadConfig: unreadable, malformed, or not Ed25519.
    """
    text = spec.strip()
    source = "inline key"
    if not text.startswith(_INLINE_PREFIX):
        source = text
        try:
            text = Path(text).read_text().strip()
        except OSError as exc:
            raise BadConfig(f"cannot read trust key {spec}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise BadConfig(f"trust key {spec} is not text (a public key file)") from None
    if text.startswith(_INLINE_PREFIX):
        try:
            raw = base64.b64decode(text[len(_INLINE_PREFIX) :].split()[0], validate=True)
        except (ValueError, IndexError):
            raise BadConfig(f"trust key {source}: not valid base64 after 'ed25519:'") from None
        if len(raw) != 32:
            raise BadConfig(f"trust key {source}: an Ed25519 key is 32 bytes, got {len(raw)}")
        _crypto()
        return PublicKey(raw=raw, source=source)
    serialization = _crypto()
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        key = serialization.load_pem_public_key(text.encode())
    except ValueError as exc:
        raise BadConfig(f"trust key {source}: not a public key ({exc})") from None
    if not isinstance(key, Ed25519PublicKey):
        raise BadConfig(f"trust key {source}: not an Ed25519 key ({type(key).__name__})")
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return PublicKey(raw=raw, source=source)


def load_trust_keys(
    specs: Sequence[str] = (), environ: Mapping[str, str] | None = None
) -> tuple[PublicKey, ...]:
    """The keys of ``--trust-key`` options plus `TRUST_KEYS_ENV` (comma-separated).

    Raises:
        BadConfig: a key that cannot be loaded.
    """
    env = os.environ if environ is None else environ
    all_specs = [*specs, *(s for s in env.get(TRUST_KEYS_ENV, "").split(",") if s.strip())]
    keys: dict[bytes, PublicKey] = {}
    for spec in all_specs:
        key = load_public_key(spec)
        keys.setdefault(key.raw, key)
    return tuple(keys.values())


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


# --- verification, the private copy, the cache ---------------------------------------


def default_verified_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$METNOS_CACHE_DIR/verified``, else ``~/.cache/metnos-exec/verified``."""
    root = (os.environ if env is None else env).get("METNOS_CACHE_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "metnos-exec"
    return base / "verified"


@dataclass(frozen=True)
class _Checked:
    """One verified executor: what runs (the private copy) and how to see a change."""

    executor: Executor
    source_stats: tuple[tuple[str, tuple[int, ...]], ...]
    staged_stats: tuple[tuple[str, tuple[int, ...]], ...]
    #: Wall clock (ns) just before the source was read: entries changed after this minus
    #: `RACY_NS` are not trusted from their stat alone.
    checked_ns: int
    digest: str


def _unchanged(root: str, stats: tuple[tuple[str, tuple[int, ...]], ...], racy_after: int) -> bool:
    for rel, key in stats:
        try:
            st = os.lstat(root if rel == "." else os.path.join(root, rel))
        except OSError:
            return False
        now = _stat_key(st)
        if now != key or now[3] >= racy_after:
            return False
    return True


class TrustStore:
    """The keys a worker trusts, and the executors it has verified (by content).

    Args:
        keys: trusted public keys (at least one).
        verified_dir: where private copies of verified trees are kept (default
            `default_verified_dir`); created mode 0700.
        clock_ns: wall clock in nanoseconds (tests).
    """

    def __init__(
        self,
        keys: Sequence[PublicKey],
        *,
        verified_dir: str | os.PathLike[str] | None = None,
        clock_ns: Any = time.time_ns,
    ) -> None:
        if not keys:
            raise BadConfig("a trust store needs at least one public key")
        self.keys = {k.id: k for k in keys}
        self.verified_dir = Path(verified_dir) if verified_dir else default_verified_dir()
        self._clock_ns = clock_ns
        self._lock = threading.Lock()
        self._verify_lock = threading.Lock()
        self._checked: dict[str, _Checked] = {}
        #: digest → stat keys of the private copy as written or last read in full.
        self._staged: dict[str, tuple[tuple[str, tuple[int, ...]], ...]] = {}

    def cached(self, executor: Executor) -> Executor | None:
        """The verified executor (planned from its private copy) when neither the source
        folder nor the private copy changed since it was verified; ``None`` otherwise.

        Cheap (one ``lstat`` per entry of both trees), so the supervisor calls it inline
        per job and only goes to `verify` (in a thread) on ``None``.
        """
        hit = self._checked.get(executor.path)
        if hit is None:
            return None
        racy_after = hit.checked_ns - RACY_NS
        if not _unchanged(executor.path, hit.source_stats, racy_after):
            return None
        # The private copy is ours and read-only: a change there is tampering, not an
        # update, and it is verified again (and re-written) like any change.
        if not _unchanged(hit.executor.path, hit.staged_stats, 1 << 62):
            return None
        return hit.executor

    def check(self, executor: Executor) -> Executor:
        """`cached`, else `verify`."""
        return self.cached(executor) or self.verify(executor)

    def verify(self, executor: Executor) -> Executor:
        """Verify `executor`'s folder and return it as planned from its private copy.

        Raises:
            SignatureError: unsigned, a key not trusted here, a signature that does not
                verify, or a file added, removed or changed since signing (named).
            BadManifest: the verified manifest does not load, or names another executor.
        """
        with self._verify_lock:  # rare; one at a time keeps the private copies simple
            return self._verify(executor.path, executor.name)

    def verify_folder(self, folder: str | os.PathLike[str], name: str) -> Executor:
        """`verify` for a folder whose manifest did not load: a worker with trust keys
        says ``E_SIGNATURE`` for a tampered executor rather than the load error the
        tampering caused (a broken import, a syntax error). A folder whose signature
        holds raises its load error again, from the verified bytes."""
        with self._verify_lock:
            return self._verify(os.fspath(folder), name)

    def _verify(self, path: str, name: str) -> Executor:
        from ..manifest import Executor as _Executor
        from ..manifest import load_manifest

        folder = Path(path)
        checked_ns = self._clock_ns()
        sig = self._signature(folder, name)
        try:
            tree = _read_tree(folder)
        except OSError as exc:
            raise SignatureError(f"{folder}: cannot be read for verification: {exc}") from None
        self._compare(folder, sig, tree.files)
        digest = tree_digest(tree.files)
        staged = self._stage(digest, tree)
        manifest = load_manifest(staged / "manifest.toml")
        if manifest.name != name:
            from ..errors import BadManifest

            raise BadManifest(
                f"{folder}/manifest.toml: field `name`: the signed manifest names "
                f"{manifest.name!r}, loaded as {name!r}; restart the worker"
            )
        result = _Executor(manifest=manifest, path=str(staged))
        staged_stats = self._staged[digest]
        entry = _Checked(
            executor=result,
            source_stats=tree.stats,
            staged_stats=staged_stats,
            checked_ns=checked_ns,
            digest=digest,
        )
        with self._lock:
            self._checked[path] = entry
        return result

    def forget(self, executor: Executor) -> None:
        """Drop `executor` from the cache (its next check verifies again)."""
        with self._lock:
            self._checked.pop(executor.path, None)

    # --- steps of verify ---

    def _signature(self, folder: Path, name: str) -> SignatureFile:
        path = folder / SIGNATURE_FILE
        not_regular = SignatureError(
            f"{path}: not a regular file (a link, FIFO, device or folder): refused unread"
        )
        try:
            # Not followed, not waited on: a FIFO here blocked the verification (and the
            # lock every other executor's waits on) for ever; a link could lead anywhere.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise SignatureError(
                f"{folder}: executor {name!r} is not signed ({SIGNATURE_FILE} is missing); "
                f"sign it with `metnos-exec sign {folder} --key KEY`"
            ) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise not_regular from None
            raise SignatureError(f"{path}: cannot read: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise not_regular
            if st.st_size > MAX_SIGNATURE_BYTES:
                raise SignatureError(f"{path}: larger than {MAX_SIGNATURE_BYTES >> 20} MiB")
            data = os.read(fd, MAX_SIGNATURE_BYTES + 1)
        except OSError as exc:
            raise SignatureError(f"{path}: cannot read: {exc.strerror}") from None
        finally:
            os.close(fd)
        try:
            sig = _sig_decoder.decode(data)
        except msgspec.DecodeError as exc:
            raise SignatureError(f"{path}: not a signature file: {exc}") from None
        if sig.v != 1 or sig.algorithm != "ed25519":
            raise SignatureError(
                f"{path}: unsupported signature (v={sig.v}, algorithm={sig.algorithm!r})"
            )
        key = self.keys.get(sig.key_id)
        if key is None:
            trusted = ", ".join(sorted(self.keys))
            raise SignatureError(
                f"{path}: signed by key {sig.key_id}, which this worker does not trust "
                f"(trusted: {trusted})"
            )
        try:
            raw_sig = base64.b64decode(sig.signature, validate=True)
        except ValueError:
            raise SignatureError(f"{path}: the signature is not valid base64") from None
        if not key.verify(raw_sig, canonical_listing(sig.files)):
            raise SignatureError(
                f"{path}: the signature does not verify with key {sig.key_id}: the "
                "signature file was altered (or signed by another key with the same id)"
            )
        return sig

    @staticmethod
    def _compare(folder: Path, sig: SignatureFile, files: Mapping[str, str]) -> None:
        for rel in sorted(set(files) | set(sig.files), key=lambda r: r.encode("utf-8")):
            signed, now = sig.files.get(rel), files.get(rel)
            if signed == now:
                continue
            if signed is None:
                problem = f"{rel} was added after signing"
            elif now is None:
                problem = f"{rel} is missing (it was signed)"
            else:
                problem = (
                    f"{rel} differs from what was signed "
                    f"(sha256 {now[:16]}…, signed {signed[:16]}…)"
                )
            raise SignatureError(f"{folder}: {problem}; re-sign the executor or restore it")

    def _stage(self, digest: str, tree: _Tree) -> Path:
        """The private, read-only copy of `tree` at ``verified_dir/<digest>``: the exact
        bytes that were hashed. An existing copy is used only if it holds exactly them."""
        private_dir(self.verified_dir)
        final = self.verified_dir / digest
        known = self._staged.get(digest)
        if known is not None and _unchanged(str(final), known, 1 << 62):
            return final
        if final.exists():
            try:
                existing = _read_tree(final)
            except (OSError, SignatureError):
                existing = None
            if existing is not None and existing.files == tree.files:
                self._staged[digest] = existing.stats
                return final
            _remove_tree(final)  # tampered or half-written: replace it
        tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}-", dir=self.verified_dir))
        try:
            dirs = sorted({str(a) for rel in tree.contents for a in Path(rel).parents} - {"."})
            for rel_dir in dirs:
                (tmp / rel_dir).mkdir(parents=True, exist_ok=True)
            for rel, data in tree.contents.items():
                target = tmp / rel
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            for rel_dir in sorted(dirs, key=len, reverse=True):
                os.chmod(tmp / rel_dir, 0o555)
            os.chmod(tmp, 0o555)
            try:
                os.rename(tmp, final)
            except OSError:
                # Another worker staged the same digest meanwhile: use theirs if intact.
                _remove_tree(tmp)
                theirs = _read_tree(final)
                if theirs.files != tree.files:
                    raise SignatureError(
                        f"{final}: the private copy is not what was verified"
                    ) from None
                self._staged[digest] = theirs.stats
                return final
        except BaseException:
            if tmp.exists():
                _remove_tree(tmp)
            raise
        self._staged[digest] = _read_stats(final)
        return final


def _read_stats(root: Path) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The stat keys of a tree we just wrote (no hashing)."""
    return tuple(
        [(".", _stat_key(os.lstat(root)))] + [(rel, _stat_key(st)) for rel, _, st in _walk(root)]
    )


def _remove_tree(path: Path) -> None:
    """Remove a private copy (its folders are read-only: make them writable first)."""
    for dirpath, dirnames, _ in os.walk(path):
        os.chmod(dirpath, 0o700)
        for d in dirnames:
            full = os.path.join(dirpath, d)
            if not os.path.islink(full):
                os.chmod(full, 0o700)
    shutil.rmtree(path, ignore_errors=True)
