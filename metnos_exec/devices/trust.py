"""The trust store: verifying a signed executor, its private copy, the cache by content.

Steps 3 to 5 of `signing`'s contract. `TrustStore.verify` checks the signature file
against the trusted keys and the folder against the signed listing, writes the very bytes
it hashed into a private, read-only copy (``verified_dir/<digest>``) and plans the
executor from that copy; `TrustStore.cached` answers later jobs from the stat keys of both
trees, without hashing again.
"""

from __future__ import annotations

import base64
import errno
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import msgspec

from ..errors import BadConfig, SignatureError
from ..private import private_dir
from .keys import PublicKey
from .signed_tree import (
    SIGNATURE_FILE,
    SignatureFile,
    _read_stats,
    _read_tree,
    _sig_decoder,
    _stat_key,
    _Tree,
    canonical_listing,
    tree_digest,
)

if TYPE_CHECKING:  # pragma: no cover
    from ..manifest import Executor

__all__ = ("RACY_NS", "TrustStore", "default_verified_dir")

#: An entry changed this close to its check is verified again once older (`signing`, step 5).
RACY_NS: Final = 100_000_000

#: A signature file larger than this is refused unread (it lists hashes: ~100 bytes a file).
MAX_SIGNATURE_BYTES: Final = 16 * 1024 * 1024


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


def _remove_tree(path: Path) -> None:
    """Remove a private copy (its folders are read-only: make them writable first)."""
    for dirpath, dirnames, _ in os.walk(path):
        os.chmod(dirpath, 0o700)
        for d in dirnames:
            full = os.path.join(dirpath, d)
            if not os.path.islink(full):
                os.chmod(full, 0o700)
    shutil.rmtree(path, ignore_errors=True)
