"""metnos-exec: the execution layer of an agent runtime."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ("__version__",)
