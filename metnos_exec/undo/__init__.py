"""Undo: a job's writes are staged and committed (or backed up), never lost, and undoable.

What this package promises:

- **A commit is crash-safe at every step.** A job's changes reach the host as a list of
  `Put` / `Move` operations, each naming what a path holds now and what it must hold.
  Everything an operation destroys is in the blob store, and the list is in a journal,
  before the first operation runs; every step that changes the host (a ``mkdir``, a
  ``chmod``, one ``write``, a ``rename``) leaves a state the next start settles from the
  journal: the changes stand when the job's stored result lists its entry, else they are
  rolled back. Never a mix, whatever step a kill interrupts (the crash-point tests kill
  a commit, its undo, the undo of that undo and a recovery at each step in turn).
- **Undo, and undo of an undo, are exact.** An undo applies its entry's operations only
  when every path still holds what the job left there (content, kind, link target,
  mode), else it changes nothing and names the paths. What it replaces is recorded as
  found, mtime and owner too, so its own entry (the redo) puts the job's results back
  exactly, and the job can then be undone again.
- **Entries are sealed and one-way.** Every entry a device records carries an HMAC seal
  made with a key only that device's workers hold; an undo refuses an entry whose seal
  is missing or does not match, or that belongs to another job or device. Whether an
  entry is undone is kept by the device too (its ledger, marked before the first
  operation), so a broker whose marks were reset cannot have an entry undone twice.
- **Nothing is walked through a symlink, and nothing the host changed is clobbered.**
  Paths are reached from each root's fd one component at a time; a path that changed on
  the host since it was planned refuses the commit or the undo.

The modules, and what each owns:

- `staging`: `Staging`, a worker's piece (the blob store, the journal, the staging
  namespace, recovery of journals whose worker died), and the choice for each job
  between a staged run and a backed-up one;
- `overlay_run`: `OverlayRun`, a job staged in overlays: its mounts, its commit, its
  settlement;
- `overlay` and `_nshelper`: the staging namespace's helper process (a stdlib-only script
  run by path) and how the worker talks to it;
- `backup`: `BackupRun`, the fallback without staging (declared targets backed up);
- `changes` and `change_checks`: the change set read from the overlays' upper folders,
  planned as operations (`plan_commit`), and the checks each staged entry is held to;
- `journal`: applying a list of operations crash-safely (`apply_ops`) and the commit
  journal; beside it `host_tree` (the roots walked through fds, states, fingerprints,
  conflicts), `order` (the order operations run in, their inverse), `applier` (the steps
  of one operation), `rollback` (reverting from whatever a crash left) and
  `crash_points` (the test hooks that kill a process at a step);
- `blobs`: the content-addressed store of originals;
- `seal`: the HMAC seal of entries and the device's ledger of undone ones;
- `apply`: applying an undo job (`apply_undo`, `entries_to_undo`);
- `checkpoints` and `restore`: a device's sealed checkpoint marks and its entry log read
  back; a restore, the later entries composed into one undo (all or nothing);
- `folder_lock`: the lock every committer of a host folder holds, across processes;
- `_types`: what every reversible run gives the supervisor (`Reversible`, `Committed`).
"""
