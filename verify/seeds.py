"""The one way a test derives its random seed: from its pytest node id.

``seed_of(nodeid)`` is the first 31 bits of the md5 of the id, so a failing case
reproduces alone (``pytest 'verify/test_x.py::test_y[...]'``) and two cases never share a
stream by accident. Both suites' ``seed`` fixtures (``verify/conftest.py``,
``tests/conftest.py``) use it.
"""

from __future__ import annotations

import hashlib

__all__ = ["seed_of"]


def seed_of(nodeid: str) -> int:
    """A 31-bit seed from the md5 of ``nodeid``."""
    return int(hashlib.md5(nodeid.encode()).hexdigest()[:8], 16) & 0x7FFFFFFF
