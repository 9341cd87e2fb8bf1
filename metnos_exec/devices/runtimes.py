"""Runtimes a worker may have to download: CPython-on-WASI and a standalone CPython.

Both come through `fetch.robust_fetch` from URLs in configuration, and **nothing is
downloaded without a pinned SHA-256**:

- **python.wasm** (the ``wasm-python`` runtime) when neither ``METNOS_PYTHON_WASM`` nor the
  ``wasm-python`` extra provides it: ``METNOS_PYTHON_WASM_URL`` names where to get it; the
  hash is the one pinned in code (`PYTHON_WASM_SHA256`), so only that exact build is ever
  kept. It lands in ``$METNOS_CACHE_DIR/runtimes/python-3.12.0.wasm``, where
  `find_python_wasm` looks after the other two sources.
- **A standalone CPython** for native executors on a device worker whose own Python is
  not fit to run them (a frozen or embedded build, or none on the device's PATH):
  ``METNOS_DEVICE_PYTHON_URL`` and ``METNOS_DEVICE_PYTHON_SHA256`` name an *install_only*
  archive of python-build-standalone (``.tar.gz`` holding ``python/bin/python3``); a URL
  without its hash is a configuration error. It is unpacked with tarfile's ``data``
  filter (no links out, no devices, no setuid bits) into
  ``$METNOS_CACHE_DIR/runtimes/cpython-<sha>/`` and used as the native jobs' interpreter.
"""

from __future__ import annotations

import os
import re
import shutil
import tarfile
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import anyio

from ..errors import BadConfig
from ..sandbox._wasm_runtime import PYTHON_WASM_SHA256, find_python_wasm
from .fetch import FetchError, robust_fetch

__all__ = (
    "DEVICE_PYTHON_SHA256_ENV",
    "DEVICE_PYTHON_URL_ENV",
    "PYTHON_WASM_URL_ENV",
    "device_python_source",
    "obtain_device_python",
    "obtain_python_wasm",
    "runtimes_dir",
)

PYTHON_WASM_URL_ENV: Final = "METNOS_PYTHON_WASM_URL"
DEVICE_PYTHON_URL_ENV: Final = "METNOS_DEVICE_PYTHON_URL"
DEVICE_PYTHON_SHA256_ENV: Final = "METNOS_DEVICE_PYTHON_SHA256"

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
#: Where python-build-standalone's install_only archives put the interpreter.
_STANDALONE_EXE = ("python", "bin", "python3")


def runtimes_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$METNOS_CACHE_DIR/runtimes``, else ``~/.cache/metnos-exec/runtimes``."""
    root = (os.environ if env is None else env).get("METNOS_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "metnos-exec") / "runtimes"


async def obtain_python_wasm(
    env: Mapping[str, str] | None = None, *, use_package: bool = True
) -> Path | None:
    """Download python.wasm when no source provides it and ``METNOS_PYTHON_WASM_URL`` is set.

    Returns:
        The downloaded (hash-verified) file, or ``None`` when nothing was needed or no URL
        is configured (the arm then answers ``E_TOOL_UNAVAILABLE`` as before).

    Raises:
        FetchError: the download never gave the pinned bytes.
    """
    env = os.environ if env is None else env
    found = find_python_wasm(env, use_package=use_package)
    if found is not None and (found.source == "env" or found.path.is_file()):
        # Present, or an operator named a file on purpose: never replaced by a download.
        return None
    url = env.get(PYTHON_WASM_URL_ENV, "").strip()
    if not url:
        return None
    return await robust_fetch(url, PYTHON_WASM_SHA256, runtimes_dir(env) / "python-3.12.0.wasm")


def device_python_source(env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """``(url, sha256)`` of the configured standalone CPython, or ``None``.

    Raises:
        BadConfig: a URL without its pinned hash (or a malformed hash).
    """
    env = os.environ if env is None else env
    url = env.get(DEVICE_PYTHON_URL_ENV, "").strip()
    sha = env.get(DEVICE_PYTHON_SHA256_ENV, "").strip().lower()
    if not url and not sha:
        return None
    if not url:
        raise BadConfig(f"{DEVICE_PYTHON_SHA256_ENV} is set without {DEVICE_PYTHON_URL_ENV}")
    if not _HEX64.match(sha):
        raise BadConfig(
            f"{DEVICE_PYTHON_URL_ENV} needs {DEVICE_PYTHON_SHA256_ENV} (64 hex digits): "
            "nothing is downloaded without a pinned hash"
        )
    return url, sha


async def obtain_device_python(env: Mapping[str, str] | None = None) -> Path | None:
    """The configured standalone CPython's interpreter, downloaded and unpacked if needed.

    Returns:
        The path of ``python/bin/python3`` inside the unpacked archive, or ``None`` when
        none is configured.

    Raises:
        BadConfig: a URL without its hash.
        FetchError: the download failed, or the archive holds no ``python/bin/python3``.
    """
    env = os.environ if env is None else env
    source = device_python_source(env)
    if source is None:
        return None
    url, sha = source
    base = runtimes_dir(env)
    root = base / f"cpython-{sha[:16]}"
    exe = root.joinpath(*_STANDALONE_EXE)
    marker = root / ".sha256"
    if exe.is_file() and marker.is_file() and marker.read_text().strip() == sha:
        return exe
    archive = await robust_fetch(url, sha, base / f"cpython-{sha[:16]}.tar.gz")
    await anyio.to_thread.run_sync(_unpack, archive, root, sha)
    if not exe.is_file():
        raise FetchError(f"{url}: the archive holds no {'/'.join(_STANDALONE_EXE)}")
    return exe


def _data_members(tar: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """tarfile's ``data`` filter for Pythons without it: regular files, folders and links
    that stay inside the tree; no absolute paths, devices or FIFOs; no setuid, setgid or
    sticky bits, no group/other write."""
    safe = []
    for member in tar.getmembers():
        name = member.name
        if name.startswith("/") or ".." in Path(name).parts:
            raise tarfile.TarError(f"{name!r} leaves the archive's folder")
        if member.issym() or member.islnk():
            base = os.path.dirname(name) if member.issym() else ""
            target = os.path.normpath(os.path.join(base, member.linkname))
            if member.linkname.startswith("/") or target.split(os.sep)[0] == "..":
                raise tarfile.TarError(f"{name!r} links out of the archive's folder")
        elif not (member.isfile() or member.isdir()):
            raise tarfile.TarError(f"{name!r} is a device or FIFO")
        member.mode &= 0o755
        safe.append(member)
    return safe


def _unpack(archive: Path, root: Path, sha: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        with tarfile.open(archive) as tar:
            # The "data" filter refuses absolute paths, links leaving the tree and device
            # files, and drops setuid/setgid bits: the archive is data until verified as
            # an interpreter by running it. CPython before 3.11.4 has no filters: the
            # same rules, checked here.
            if hasattr(tarfile, "data_filter"):
                tar.extractall(tmp, filter="data")
            else:  # pragma: no cover - exercised on CPython < 3.11.4 only
                tar.extractall(tmp, members=_data_members(tar))
        (tmp / ".sha256").write_text(sha + "\n")
        if root.exists():
            shutil.rmtree(root)
        os.rename(tmp, root)
    except (tarfile.TarError, OSError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise FetchError(f"{archive}: cannot unpack: {exc}") from None
