"""Devices: the trust of code that runs away from the server (spec sections 7 and 10).

**A device** is a worker whose device id is not ``server`` (`messages.SERVER_DEVICE`):
a machine apart from the server, a laptop or a phone, perhaps behind a bad link, that has
nothing but a Python and the executor folders sent to it. It leases only the jobs that
target its id; a job with no target, or targeting ``server``, stays on server workers.

**Trust** here means that a device runs only code the server signed, and only where it
can run. Four checks stand between a job and a device, none of them the wall (the
device's sandbox is the wall; these decide *what* reaches it):

- **Signed or refused.** A device worker will not start without a trusted public key, and
  verifies every executor against the server's Ed25519 signature before a job of it is
  planned; unsigned or altered code never runs (``E_SIGNATURE``), and what runs is a
  private copy of the very bytes that were verified, never the folder that was checked.
- **Packable or server-only.** Only an executor whose code imports nothing but the
  standard library and its own files may go to a device; its claim is read from the code
  at load and tried in the sandbox at worker start (``E_BAD_MANIFEST``).
- **Pinned at submit.** A job that must stay on the server (a non-packable executor, a
  provider binding) is refused at submit when it targets a device (``E_SERVER_PINNED``),
  from the manifests server workers publish; the device worker refuses it again at lease.
- **Pinned bytes.** A runtime a device lacks (a standalone CPython, python.wasm) is
  downloaded only against a SHA-256 fixed beforehand; other bytes are never kept.

The modules, each opening with its own contract:

- `signing`: the contract of signed executors, signing (`sign_folder`), and the names of
  the three modules below it: `signed_tree` (what is signed: the canonical tree of a
  folder and the signature file), `keys` (generating and loading Ed25519 keys, the keys a
  worker trusts) and `trust` (`TrustStore`: verification, the private copy, the cache by
  content).
- `packability`: the packable claim, checked at load (`manifest.check_packable`, which
  reads the code through `source_imports` and is re-exported here) and by a dry run in
  the sandbox (`dry_run`).
- `catalog`: the executors server workers publish to the broker, and the refusal at
  submit (`device_refusal`).
- `fetch`: `robust_fetch`, a pinned download over a bad link (ranges, resume, copies).
- `runtimes`: the runtimes a worker may download through it.

The package sits above `manifest`, `capabilities` and `sandbox/` and imports only from
them and below; `brokers/`, `client`, the supervisor and the worker import it, never the
other way round.
"""
