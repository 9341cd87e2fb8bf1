"""Signed executors: canonical hashing, keys, verification, the private copy, the cache."""

from __future__ import annotations

import os
import re
import shutil
import stat
import threading
from pathlib import Path

import msgspec
import pytest

from metnos_exec.devices import signed_tree, signing, trust
from metnos_exec.devices.signing import SIGNATURE_FILE, TrustStore, sign_folder
from metnos_exec.errors import BadConfig, SignatureError
from metnos_exec.manifest import Executor, load_manifest
from metnos_exec.plan import plan_invocation
from metnos_exec.sandbox._types import Sandbox, Success
from tests.conftest import need_import


@pytest.fixture(autouse=True)
def _needs_device_extra() -> None:
    need_import("cryptography", "device")


MANIFEST = 'name = "{name}"\nversion = "1.0.0"\nruntime = "python"\nentry = "main.py"\n'
# Reads a sibling file (not an import: ``python -I`` keeps the script's folder off
# sys.path).
MAIN = (
    "import json, os\n"
    "here = os.path.dirname(os.path.abspath(__file__))\n"
    "word = open(os.path.join(here, 'word.txt')).read().strip()\n"
    'print(json.dumps({"says": word}))\n'
)


def make_executor(root: Path, name: str, word: str = "signed") -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "manifest.toml").write_text(MANIFEST.format(name=name))
    (folder / "main.py").write_text(MAIN)
    (folder / "word.txt").write_text(f"{word}\n")
    return folder


def executor(folder: Path) -> Executor:
    return Executor(manifest=load_manifest(folder / "manifest.toml"), path=str(folder))


@pytest.fixture
def key(tmp_path: Path) -> tuple[Path, Path]:
    return signing.generate_key(tmp_path / "keys" / "server.key")


@pytest.fixture
def store(tmp_path: Path, key: tuple[Path, Path]) -> TrustStore:
    return store_at(tmp_path, key)


#: A check made "long after" the files were written: none of them is racily clean.
LATER = 2**62


def store_at(tmp_path: Path, key: tuple[Path, Path], clock_ns: int | None = None) -> TrustStore:
    return TrustStore(
        [signing.load_public_key(str(key[1]))],
        verified_dir=tmp_path / "verified",
        **({} if clock_ns is None else {"clock_ns": lambda: clock_ns}),
    )


# --- hashing -----------------------------------------------------------------------------


def test_hash_tree_is_sorted_relative_and_timestamp_free(tmp_path: Path) -> None:
    folder = make_executor(tmp_path, "ex")
    (folder / "pkg").mkdir()
    (folder / "pkg" / "b.py").write_text("b")
    (folder / "pkg" / "__pycache__").mkdir()
    (folder / "pkg" / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"\0")
    first = signing.hash_tree(folder)
    assert list(first) == ["main.py", "manifest.toml", "pkg/b.py", "word.txt"]
    os.utime(folder / "main.py", ns=(1, 1))
    os.chmod(folder / "word.txt", 0o600)
    assert signing.hash_tree(folder) == first
    assert signing.tree_digest(first) == signing.tree_digest(dict(reversed(first.items())))
    (folder / "main.py").write_text(MAIN + "#\n")
    assert signing.hash_tree(folder)["main.py"] != first["main.py"]


def test_symlinks_and_special_files_are_refused(tmp_path: Path, key: tuple[Path, Path]) -> None:
    folder = make_executor(tmp_path, "ex")
    outside = tmp_path / "outside.py"
    outside.write_text("X = 1\n")
    (folder / "link.py").symlink_to(outside)
    with pytest.raises(SignatureError, match=r"link\.py is a symbolic link"):
        sign_folder(folder, key[0])
    (folder / "link.py").unlink()
    os.mkfifo(folder / "pipe")
    with pytest.raises(SignatureError, match="pipe is not a regular file"):
        sign_folder(folder, key[0])


def test_keygen_refuses_to_overwrite_and_keys_load(tmp_path: Path, key: tuple[Path, Path]) -> None:
    priv, pub = key
    assert stat.S_IMODE(priv.stat().st_mode) == 0o600
    assert pub.read_text().startswith("ed25519:")
    with pytest.raises(BadConfig, match="already exists"):
        signing.generate_key(priv)
    inline = signing.load_public_key(pub.read_text())
    from_file = signing.load_public_key(str(pub))
    assert inline.raw == from_file.raw and len(inline.raw) == 32
    keys = signing.load_trust_keys([str(pub)], {})
    assert [k.id for k in keys] == [inline.id]
    with pytest.raises(BadConfig, match="32 bytes"):
        signing.load_public_key("ed25519:AAAA")
    with pytest.raises(BadConfig, match="cannot read trust key"):
        signing.load_public_key(str(tmp_path / "nope.pub"))


def test_trust_keys_come_from_the_environment_too(tmp_path: Path) -> None:
    _, pub_a = signing.generate_key(tmp_path / "a.key")
    _, pub_b = signing.generate_key(tmp_path / "b.key")
    keys = signing.load_trust_keys([str(pub_a)], {"METNOS_TRUST_KEYS": f"{pub_b}, {pub_a}"})
    assert len(keys) == 2


# --- verification ------------------------------------------------------------------------


def test_a_signed_executor_verifies_and_runs_from_a_private_copy(
    tmp_path: Path, key: tuple[Path, Path], store: TrustStore
) -> None:
    folder = make_executor(tmp_path / "ex", "good")
    sig = sign_folder(folder, key[0])
    assert sig == folder / SIGNATURE_FILE
    checked = store.verify(executor(folder))
    staged = Path(checked.path)
    assert staged.parent == tmp_path / "verified"
    assert staged.name == signing.tree_digest(signing.hash_tree(folder))
    assert (staged / "main.py").read_text() == MAIN
    assert not (staged / SIGNATURE_FILE).exists()
    assert stat.S_IMODE((staged / "main.py").stat().st_mode) == 0o444
    assert stat.S_IMODE(staged.stat().st_mode) == 0o555
    assert checked.manifest == executor(folder).manifest


@pytest.mark.parametrize("kind", ["fifo", "symlink", "folder"])
def test_a_signature_file_that_is_not_a_regular_file_is_refused_unread(
    tmp_path: Path, key: tuple[Path, Path], store: TrustStore, kind: str
) -> None:
    # manifest.sig was read (following a link) before the folder was walked: a FIFO there
    # blocked the verification forever, holding the lock every other executor's waits on,
    # and a link to /dev/zero would read without end.
    folder = make_executor(tmp_path / "ex", "victim")
    sig = sign_folder(folder, key[0])
    kept = tmp_path / "kept.sig"
    os.rename(sig, kept)
    if kind == "fifo":
        os.mkfifo(sig)
    elif kind == "symlink":
        os.mkfifo(tmp_path / "fifo")  # (a link to /dev/zero read without end)
        os.symlink(tmp_path / "fifo", sig)
    else:
        sig.mkdir()
    outcome: list[BaseException | None] = []

    def verify() -> None:
        try:
            store.verify(executor(folder))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=verify, daemon=True)
    worker.start()
    worker.join(10)  # a deadline, not a synchronisation
    if worker.is_alive():  # blocked on the FIFO: give it an end of file, then fail
        os.close(os.open(sig, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(10)
        pytest.fail("verification blocked on a FIFO named manifest.sig")
    [error] = outcome
    assert isinstance(error, SignatureError), error
    assert "manifest.sig" in error.message and "not a regular file" in error.message


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        ("one_byte", r"main\.py differs from what was signed"),
        ("added", r"extra\.py was added after signing"),
        ("removed", r"word\.txt is missing \(it was signed\)"),
        ("unsigned", r"is not signed \(manifest\.sig is missing\)"),
        ("other_key", r"signed by key [0-9a-f]{16}, which this worker does not trust"),
        ("forged_listing", r"the signature does not verify"),
        ("manifest", r"manifest\.toml differs"),
        # A worker with a trust key died at start (E_INTERNAL, UnicodeEncodeError).
        ("not_utf8", r"'\\xff-added' is a name that is not valid UTF-8"),
        ("not_utf8_folder", r"'\\xfe-dir' is a name that is not valid UTF-8"),
    ],
)
def test_every_alteration_is_refused_naming_the_file(
    tmp_path: Path, key: tuple[Path, Path], store: TrustStore, tamper: str, message: str
) -> None:
    folder = make_executor(tmp_path / "ex", "victim")
    sign_folder(folder, key[0])
    if tamper == "one_byte":
        data = bytearray((folder / "main.py").read_bytes())
        data[data.index(b"says")] ^= 0x20  # "says" -> "Says": still valid Python
        (folder / "main.py").write_bytes(bytes(data))
    elif tamper == "added":
        (folder / "extra.py").write_text("")
    elif tamper == "removed":
        (folder / "word.txt").unlink()
    elif tamper == "unsigned":
        (folder / SIGNATURE_FILE).unlink()
    elif tamper == "other_key":
        other, _ = signing.generate_key(tmp_path / "other.key")
        sign_folder(folder, other)
    elif tamper == "forged_listing":
        # The attacker changes the code and rewrites the listing to match: the signature
        # over the listing no longer verifies.
        (folder / "word.txt").write_text("evil\n")
        sig = msgspec.json.decode((folder / SIGNATURE_FILE).read_bytes())
        sig["files"]["word.txt"] = signing.hash_tree(folder)["word.txt"]
        (folder / SIGNATURE_FILE).write_bytes(msgspec.json.encode(sig))
    elif tamper == "manifest":
        with open(folder / "manifest.toml", "a") as f:
            f.write('description = "now with more"\n')
    elif tamper == "not_utf8":
        with open(os.path.join(os.fsencode(folder), b"\xff-added"), "w") as f:
            f.write("")
    elif tamper == "not_utf8_folder":
        os.mkdir(os.path.join(os.fsencode(folder), b"\xfe-dir"))
        with open(os.path.join(os.fsencode(folder), b"\xfe-dir", b"f"), "w") as f:
            f.write("")
    with pytest.raises(SignatureError, match=message) as info:
        store.verify(executor(folder))
    assert info.value.code == "E_SIGNATURE"
    assert str(folder) in info.value.message


# --- the cache ---------------------------------------------------------------------------


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    reads: list[Path] = []
    real = trust._read_tree

    def counting(folder: Path) -> signed_tree._Tree:
        reads.append(folder)
        return real(folder)

    monkeypatch.setattr(trust, "_read_tree", counting)
    return reads


def test_cached_check_does_not_rehash_an_unchanged_executor(
    tmp_path: Path, key: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = make_executor(tmp_path / "ex", "good")
    sign_folder(folder, key[0])
    store = store_at(tmp_path, key, LATER)
    ex = executor(folder)
    reads = _count_reads(monkeypatch)
    assert store.cached(ex) is None
    first = store.check(ex)
    assert reads == [folder]
    reads.clear()
    for _ in range(50):
        assert store.check(ex) is first
    assert reads == []


def test_racily_clean_entries_are_verified_again(
    tmp_path: Path, key: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Checked within RACY_NS of main.py's last change: a write in the same timestamp tick
    # could hide behind an equal ctime, so the stat alone is not trusted for it yet.
    folder = make_executor(tmp_path / "ex", "fresh")
    sign_folder(folder, key[0])
    ctime = (folder / "main.py").stat().st_ctime_ns
    store = store_at(tmp_path, key, ctime + signing.RACY_NS // 2)
    ex = executor(folder)
    store.verify(ex)
    reads = _count_reads(monkeypatch)
    assert store.cached(ex) is None
    store.check(ex)
    assert reads == [folder]


def test_a_change_between_two_jobs_is_caught(tmp_path: Path, key: tuple[Path, Path]) -> None:
    folder = make_executor(tmp_path / "ex", "good")
    sign_folder(folder, key[0])
    store = store_at(tmp_path, key, LATER)
    ex = executor(folder)
    store.check(ex)
    assert store.cached(ex) is not None
    # Same size, same mtime put back: only the content (and the kernel's ctime) changed.
    st = (folder / "word.txt").stat()
    (folder / "word.txt").write_text("evil!!\n")
    os.utime(folder / "word.txt", ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (folder / "word.txt").stat().st_size == st.st_size
    assert store.cached(ex) is None
    with pytest.raises(SignatureError, match=r"word\.txt differs"):
        store.check(ex)


def test_a_file_added_between_two_jobs_is_caught(tmp_path: Path, key: tuple[Path, Path]) -> None:
    folder = make_executor(tmp_path / "ex", "good")
    sign_folder(folder, key[0])
    store = store_at(tmp_path, key, LATER)
    ex = executor(folder)
    store.check(ex)
    (folder / "sub").mkdir()
    (folder / "sub" / "x.py").write_text("")
    assert store.cached(ex) is None
    with pytest.raises(SignatureError, match=r"sub/x\.py was added after signing"):
        store.check(ex)


def test_a_tampered_private_copy_is_replaced(tmp_path: Path, key: tuple[Path, Path]) -> None:
    folder = make_executor(tmp_path / "ex", "good")
    sign_folder(folder, key[0])
    store = store_at(tmp_path, key, LATER)
    ex = executor(folder)
    staged = Path(store.check(ex).path)
    assert store.cached(ex) is not None
    os.chmod(staged, 0o755)
    os.chmod(staged / "word.txt", 0o644)
    (staged / "word.txt").write_text("evil\n")
    assert store.cached(ex) is None
    again = store.check(ex)
    assert Path(again.path) == staged
    assert (staged / "word.txt").read_text() == "signed\n"


# --- no window between the check and the run ---------------------------------------------


@pytest.mark.anyio
async def test_a_change_after_the_check_never_reaches_the_guest(
    tmp_path: Path, key: tuple[Path, Path], store: TrustStore, native_arm: Sandbox
) -> None:
    arm = native_arm
    folder = make_executor(tmp_path / "ex", "good")
    sign_folder(folder, key[0])
    checked = store.check(executor(folder))
    # Between the check and the mount (and during the run) the host folder changes: the
    # job still runs the bytes that were verified, from the private copy.
    (folder / "word.txt").write_text("evil\n")
    shutil.rmtree(folder)
    inv = plan_invocation(checked, {}, home=str(tmp_path))
    outcome = await arm.run(inv.job)
    assert isinstance(outcome.exit, Success), outcome
    assert msgspec.json.decode(outcome.stdout) == {"says": "signed"}


# --- acceptance: a worker with the key -------------------------------------------------


@pytest.mark.anyio
async def test_worker_refuses_every_altered_executor_and_runs_the_signed_one(
    tmp_path: Path, key: tuple[Path, Path]
) -> None:
    from structlog.testing import capture_logs

    from metnos_exec.brokers.memory import MemoryBroker
    from metnos_exec.manifest import ExecutorRegistry
    from metnos_exec.messages import Job
    from metnos_exec.worker import serve, trust_store_for

    root = tmp_path / "executors"
    for name in ("good", "one_byte", "unsigned", "other_key", "added", "breaks_load"):
        make_executor(root, name)
        if name != "unsigned":
            sign_folder(root / name, key[0])
    sign_folder(root / "other_key", signing.generate_key(tmp_path / "other.key")[0])
    (root / "one_byte" / "word.txt").write_text("signeD\n")
    (root / "added" / "later.py").write_text("")
    # Tampered so that it no longer loads (a third-party import in a packable executor):
    # the worker names the tampering, not the load error it causes.
    main_py = root / "breaks_load" / "main.py"
    main_py.write_text(main_py.read_text() + "import yaml\n")
    registry = ExecutorRegistry.load(root)
    assert "breaks_load" in registry.errors
    broker = MemoryBroker()
    ids = {
        name: (await broker.submit(Job(executor=name, device="phone"))).job_id
        for name in [*sorted(registry), "breaks_load"]
    }
    trust = trust_store_for("phone", [str(key[1])], environ={})
    assert trust is not None
    trust.verified_dir = tmp_path / "verified"
    with capture_logs() as logs:
        await serve(
            broker,
            registry,
            burst=True,
            handle_signals=False,
            worker_id="w",
            device="phone",
            home=str(tmp_path),
            trust=trust,
        )
    results = {name: await broker.get_result(job_id) for name, job_id in ids.items()}
    good = results.pop("good")
    assert good is not None and good.status == "succeeded", good
    assert good.output == {"says": "signed"}
    expected = {
        "one_byte": r"word\.txt differs from what was signed",
        "unsigned": "is not signed",
        "other_key": "which this worker does not trust",
        "added": r"later\.py was added after signing",
        "breaks_load": r"main\.py differs from what was signed",
    }
    for name, pattern in expected.items():
        r = results[name]
        assert r is not None and r.status == "rejected", (name, r)
        assert r.error is not None and r.error.code == "E_SIGNATURE", (name, r.error)
        assert r.exit is None and r.started_at is None  # nothing ran
        assert re.search(pattern, r.error.message), (name, r.error.message)
    failed = {rec["executor"] for rec in logs if rec["event"] == "executor.signature_failed"}
    assert failed == set(expected)


def test_a_device_worker_without_a_trust_key_refuses_to_start(tmp_path: Path) -> None:
    from metnos_exec.worker import run_worker, trust_store_for

    assert trust_store_for("server", [], environ={}) is None
    with pytest.raises(BadConfig, match="refuses to start without a trust key"):
        trust_store_for("phone", [], environ={})
    (tmp_path / "ex").mkdir()
    with pytest.raises(BadConfig, match="--trust-key"):
        run_worker(
            f"sqlite:///{tmp_path}/q.db", tmp_path / "ex", device="phone", configure_logs=False
        )
    assert not (tmp_path / "q.db").exists()  # refused before anything was opened


def test_cli_device_worker_without_trust_key_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from metnos_exec.cli import main

    monkeypatch.delenv("METNOS_TRUST_KEYS", raising=False)
    (tmp_path / "ex").mkdir()
    with pytest.raises(SystemExit) as info:
        main(["worker", "--device", "phone", "--executors", str(tmp_path / "ex"),
              "--broker", f"sqlite:///{tmp_path}/q.db"])  # fmt: skip
    assert info.value.code == 2
    assert "E_CONFIG" in capsys.readouterr().err


def test_cli_keygen_and_sign(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from metnos_exec.cli import main

    # A missing folder is refused, not made (issue 18: `--out /missing/dir/k.key` made both).
    with pytest.raises(SystemExit) as refused:
        main(["keygen", "--out", str(tmp_path / "k" / "srv.key")])
    assert refused.value.code == 2
    assert "no folder" in capsys.readouterr().err and not (tmp_path / "k").exists()
    (tmp_path / "k").mkdir()
    assert main(["keygen", "--out", str(tmp_path / "k" / "srv.key")]) == 0
    out = capsys.readouterr().out
    assert "srv.key.pub" in out and "key id" in out
    folder = make_executor(tmp_path, "ex")
    assert main(["sign", str(folder), "--key", str(tmp_path / "k" / "srv.key")]) == 0
    assert "signed 3 files" in capsys.readouterr().out
    store = store_at(tmp_path, (tmp_path / "k" / "srv.key", tmp_path / "k" / "srv.key.pub"))
    assert store.verify(executor(folder)).manifest.name == "ex"


def test_a_file_swapped_for_a_fifo_after_its_lstat_is_refused_not_waited_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The walk saw a regular file; by the time it is opened, it is a FIFO (an attacker
    # swapping it in a loop): the open must not wait for a writer that never comes.
    folder = make_executor(tmp_path / "ex", "victim")
    real_walk = signed_tree._walk

    def swapping_walk(root: Path):  # type: ignore[no-untyped-def]
        for rel, path, st in real_walk(root):
            if rel == "word.txt":
                os.unlink(path)
                os.mkfifo(path)
            yield rel, path, st

    monkeypatch.setattr(signed_tree, "_walk", swapping_walk)
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            signed_tree._read_tree(folder)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    worker = threading.Thread(target=read, daemon=True)
    worker.start()
    worker.join(10)  # a deadline, not a synchronisation
    if worker.is_alive():
        os.close(os.open(folder / "word.txt", os.O_WRONLY | os.O_NONBLOCK))
        worker.join(10)
        pytest.fail("reading the tree blocked on a FIFO swapped in after the walk saw a file")
    [error] = outcome
    assert isinstance(error, SignatureError) and "word.txt" in error.message, error
