"""Errors raised at the IR's boundaries (bad files, invalid schedules)."""

from __future__ import annotations


class CommsimInputError(ValueError):
    """Bad user input: the message names the file, field or flag and what is allowed.

    The CLI prints it as one line and exits with status 2.
    """


class ScheduleFormatError(CommsimInputError):
    """A schedule or trace file that cannot be read as this version of the IR."""


class ScheduleInvalidError(CommsimInputError):
    """A well-formed schedule that would not run (mismatched collectives, cycles, ...)."""
