"""Undo: staging, commits, the journal, blobs, seals, applying an undo."""
