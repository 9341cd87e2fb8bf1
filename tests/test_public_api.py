"""`metnos_exec.__all__` and the package namespace stay in step."""

from __future__ import annotations

import types

import metnos_exec


def test_every_exported_name_exists() -> None:
    missing = [name for name in metnos_exec.__all__ if not hasattr(metnos_exec, name)]
    assert missing == []


def test_every_public_name_is_exported() -> None:
    public = {
        name
        for name, value in vars(metnos_exec).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and name != "annotations"
    }
    assert public - set(metnos_exec.__all__) == set()


def test_all_is_a_tuple_without_duplicates() -> None:
    assert isinstance(metnos_exec.__all__, tuple)
    assert len(set(metnos_exec.__all__)) == len(metnos_exec.__all__)


def test_importing_the_package_does_not_import_wasmtime() -> None:
    import subprocess
    import sys

    code = "import sys, metnos_exec; print('wasmtime' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
