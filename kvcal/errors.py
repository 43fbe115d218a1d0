"""Anticipated errors. The CLI turns them into one line `Error: ...` on stderr and an exit code.

Library code raises these (never sys.exit, never prints); anything else is a bug and shows a traceback
only with KVCAL_DEBUG=1.
"""

from __future__ import annotations


class KvcalError(Exception):
    """A domain failure: stale scales, failed regression gate, bad data. Exit code 1."""

    exit_code = 1


class UsageError(KvcalError):
    """The user asked for something that cannot work as asked (bad option value, unknown name). Exit code 2."""

    exit_code = 2
