"""Every error code the package can emit is listed, with its meaning, in `ERROR_CODES`."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import metnos_exec
from metnos_exec.errors import ERROR_CODES, HostFault, MetnosError

ROOT = Path(metnos_exec.__file__).parent
LITERAL = re.compile(r"[\"'](E_[A-Z][A-Z_]*)[\"']")


def _subclasses(cls: type[Exception]) -> set[type[Exception]]:
    found: set[type[Exception]] = set()
    for sub in cls.__subclasses__():
        found |= {sub} | _subclasses(sub)
    return found


def test_every_code_literal_in_the_source_is_listed() -> None:
    seen = {
        code: path.relative_to(ROOT)
        for path in ROOT.rglob("*.py")
        for code in LITERAL.findall(path.read_text())
    }
    assert {"E_TIMEOUT", "E_EXIT", "E_CANCELLED"} <= set(seen)  # the scan works
    unlisted = {code: str(path) for code, path in seen.items() if code not in ERROR_CODES}
    assert unlisted == {}, "add these to ERROR_CODES in metnos_exec/errors.py"


def test_every_error_class_code_is_listed() -> None:
    for info in pkgutil.walk_packages(metnos_exec.__path__, "metnos_exec."):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:  # an optional extra (redis, wasmtime) not installed here
            continue
    # Only the package's own classes: tests may define theirs.
    classes = {
        c
        for c in _subclasses(MetnosError) | {MetnosError, HostFault}
        if c.__module__.startswith("metnos_exec.")
    }
    assert len(classes) > 10
    unlisted = sorted(
        f"{c.__module__}.{c.__name__}: {getattr(c, 'code', None)}"
        for c in classes
        if getattr(c, "code", None) not in ERROR_CODES
    )
    assert unlisted == []


def test_meanings_are_one_line() -> None:
    for code, meaning in ERROR_CODES.items():
        assert re.fullmatch(r"E_[A-Z][A-Z_]*", code)
        assert meaning and "\n" not in meaning and len(meaning) <= 100, code
