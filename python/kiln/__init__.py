"""kiln — Python side of the kiln build farm.

For now this package holds `kiln.farm`, which starts a broker and workers
on loopback (used by `make demo` and the integration tests).  The trace
front-end (`kiln.trace`) builds on it.
"""

__all__ = ["farm"]
