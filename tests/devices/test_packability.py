"""Packability: a packable executor imports only the standard library and its own files."""

from __future__ import annotations

from pathlib import Path

import pytest

from metnos_exec.brokers.memory import MemoryBroker
from metnos_exec.devices.packability import dry_run, imported_modules
from metnos_exec.errors import BadManifest
from metnos_exec.manifest import ExecutorRegistry, load_manifest
from metnos_exec.messages import Job
from metnos_exec.sandbox._types import Sandbox
from metnos_exec.worker import dry_run_executors, serve


def executor(root: Path, name: str, code: str, *, packable: bool = True, **files: str) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "manifest.toml").write_text(
        f'name = "{name}"\nversion = "1"\nruntime = "python"\nentry = "main.py"\n'
        f"packable = {'true' if packable else 'false'}\n"
    )
    (folder / "main.py").write_text(code)
    for rel, text in files.items():
        path = folder / rel.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return folder


def test_a_packable_executor_importing_a_third_party_module_is_refused_at_load(
    tmp_path: Path,
) -> None:
    folder = executor(tmp_path, "uses_yaml", "import json\nimport os.path\n\nimport yaml.loader\n")
    with pytest.raises(BadManifest) as info:
        load_manifest(folder / "manifest.toml")
    msg = info.value.message
    assert info.value.code == "E_BAD_MANIFEST"
    assert "field `packable`" in msg and "main.py:4 imports `yaml.loader`" in msg
    assert "packable = false" in msg  # the fix
    registry = ExecutorRegistry.load(tmp_path)
    assert "uses_yaml" not in registry and "uses_yaml" in registry.errors


@pytest.mark.parametrize(
    ("code", "named"),
    [
        ("from requests import get\n", "requests"),
        ("import importlib\nimportlib.import_module('numpy')\n", "numpy"),
        ("def f():\n    import httpx\n", "httpx"),
    ],
)
def test_every_kind_of_import_is_read(tmp_path: Path, code: str, named: str) -> None:
    folder = executor(tmp_path, "ex", code)
    with pytest.raises(BadManifest, match=f"imports `{named}`"):
        load_manifest(folder / "manifest.toml")


def test_a_sibling_file_importing_a_third_party_module_is_refused_too(tmp_path: Path) -> None:
    folder = executor(tmp_path, "ex", "import helper\n", **{"helper.py": "import attr\n"})
    with pytest.raises(BadManifest, match=r"helper\.py:1 imports `attr`"):
        load_manifest(folder / "manifest.toml")


def test_computed_imports_cannot_be_checked(tmp_path: Path) -> None:
    folder = executor(tmp_path, "ex", "import sys\n__import__(sys.argv[1])\n")
    with pytest.raises(BadManifest, match="computed at run time"):
        load_manifest(folder / "manifest.toml")


def test_stdlib_and_own_files_are_packable(tmp_path: Path) -> None:
    folder = executor(
        tmp_path,
        "ex",
        "from __future__ import annotations\nimport json, helper\nfrom pkg import mod\n"
        "from . import sibling\n",
        **{"helper.py": "import os\n", "pkg__mod.py": "from .other import x\n"},
    )
    manifest = load_manifest(folder / "manifest.toml")
    assert manifest.packable
    assert [m for _, _, m in imported_modules(folder)] == [
        "os",
        "__future__",
        "json",
        "helper",
        "pkg",
    ]


def test_a_non_packable_executor_may_import_anything(tmp_path: Path) -> None:
    folder = executor(tmp_path, "ex", "import yaml\n", packable=False)
    assert load_manifest(folder / "manifest.toml").packable is False


def test_the_example_executors_are_all_packable() -> None:
    examples = Path(__file__).resolve().parents[2] / "examples" / "executors"
    registry = ExecutorRegistry.load(examples)
    assert registry.errors == {}
    assert all(registry[name].manifest.packable for name in registry)


# --- the dry run in the sandbox ----------------------------------------------------------


@pytest.mark.anyio
async def test_the_dry_run_finds_what_the_static_check_cannot(
    tmp_path: Path, native_arm: Sandbox
) -> None:
    arm = native_arm
    # winreg is in sys.stdlib_module_names everywhere, and exists only on Windows.
    bad = executor(tmp_path, "windows_only", "import json\nimport winreg\n")
    good = executor(tmp_path, "fine", "import json, helper\n", **{"helper.py": "X = 1\n"})
    registry = ExecutorRegistry.load(tmp_path)
    assert set(registry) == {"windows_only", "fine"}  # the static check let both through
    with pytest.raises(BadManifest, match="the dry run in the sandbox cannot find `winreg`"):
        await dry_run(registry["windows_only"], arm)
    await dry_run(registry["fine"], arm)
    assert bad.exists() and good.exists()


@pytest.mark.anyio
async def test_a_worker_refuses_jobs_of_an_executor_that_fails_its_dry_run(tmp_path: Path) -> None:
    executor(tmp_path / "ex", "windows_only", "import winreg\n")
    executor(tmp_path / "ex", "fine", 'import json\nprint(json.dumps({"ok": 1}))\n')
    registry = ExecutorRegistry.load(tmp_path / "ex")
    broker = MemoryBroker()
    bad_id = (await broker.submit(Job(executor="windows_only"))).job_id
    good_id = (await broker.submit(Job(executor="fine"))).job_id
    await serve(
        broker,
        registry,
        burst=True,
        handle_signals=False,
        dry_run=True,
        worker_id="w",
        home=str(tmp_path),
    )
    bad = await broker.get_result(bad_id)
    assert bad is not None and bad.status == "rejected" and bad.error is not None
    assert bad.error.code == "E_BAD_MANIFEST" and "`winreg`" in bad.error.message
    good = await broker.get_result(good_id)
    assert good is not None and good.status == "succeeded", good


@pytest.mark.anyio
async def test_dry_run_skips_what_needs_none(tmp_path: Path) -> None:
    executor(tmp_path, "server_only", "import yaml\n", packable=False)
    registry = ExecutorRegistry.load(tmp_path)
    await dry_run_executors(registry)
    assert "server_only" in registry and registry.errors == {}


@pytest.mark.anyio
async def test_a_trust_worker_dry_runs_the_verified_copy(tmp_path: Path) -> None:
    from metnos_exec.devices.signing import TrustStore, generate_key, load_public_key, sign_folder
    from tests.conftest import need_import

    need_import("cryptography", "device")
    key, pub = generate_key(tmp_path / "k" / "srv.key")
    folder = executor(tmp_path / "ex", "windows_only", "import winreg\n")
    sign_folder(folder, key)
    registry = ExecutorRegistry.load(tmp_path / "ex")
    trust = TrustStore([load_public_key(str(pub))], verified_dir=tmp_path / "verified")
    await dry_run_executors(registry, trust=trust)
    assert "windows_only" not in registry
    err = registry.errors["windows_only"]
    # The dry run ran in the private copy; the refusal names the executor's own folder.
    assert str(folder) in err.message and "`winreg`" in err.message
    assert str(tmp_path / "verified") not in err.message
    assert registry.error_folders["windows_only"] == str(folder)


@pytest.mark.parametrize(
    ("code", "said"),
    [
        # Each ran a third-party module on the server yet passed both the load check
        # and the dry run (which only looks for the names the load check found).
        ("import builtins\nbuiltins.__import__('ya' + 'ml')\n", "computed"),
        ("import importlib\nimportlib.__import__('ya' + 'ml')\n", "computed"),
        ("from importlib import import_module as im\nim('ya' + 'ml')\n", "computed"),
        ("import importlib\nload = importlib.import_module\nload('yaml')\n", "computed"),
        ("import importlib\ngetattr(importlib, 'import_module')('yaml')\n", "computed"),
        ("__builtins__['__import__']('yaml')\n", "computed"),
        ("eval('__imp' + 'ort__')('yaml')\n", "code computed"),
        ("exec('imp' + 'ort yaml')\n", "code computed"),
        ("exec('import yaml')\n", "imports `yaml`"),
        ("from importlib import import_module as im\nim('yaml')\n", "imports `yaml`"),
    ],
)
def test_dynamic_imports_that_cannot_be_checked_are_refused(
    tmp_path: Path, code: str, said: str
) -> None:
    folder = executor(tmp_path, "ex", code)
    with pytest.raises(BadManifest, match=said):
        load_manifest(folder / "manifest.toml")


def test_literal_code_and_ordinary_calls_stay_packable(tmp_path: Path) -> None:
    code = (
        "import re\nfrom importlib import import_module as im\n"
        "WORD = re.compile('x')\nim('json')\nexec('import os')\n"
        "print(eval('1 + 2'))\n"
    )
    folder = executor(tmp_path, "ex", code)
    assert load_manifest(folder / "manifest.toml").packable


@pytest.mark.parametrize("module", ["ctypes", "ssl", "multiprocessing", "lzma", "fcntl", "imp"])
def test_a_wasm_python_executor_importing_what_python_wasm_lacks_is_refused(
    tmp_path: Path, module: str
) -> None:
    # Standard library for the worker's CPython, absent from the pinned python.wasm (no
    # dry run there): such an executor passed the load check and failed on every device.
    folder = executor(tmp_path, "ex", f"import json\nimport {module}\n")
    manifest = folder / "manifest.toml"
    manifest.write_text(manifest.read_text().replace('"python"', '"wasm-python"'))
    with pytest.raises(BadManifest, match=f"imports `{module}`.*python.wasm"):
        load_manifest(manifest)


def test_a_native_executor_may_still_import_ctypes(tmp_path: Path) -> None:
    folder = executor(tmp_path, "ex", "import ctypes\n")
    assert load_manifest(folder / "manifest.toml").packable
