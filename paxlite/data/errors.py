"""Errors of the data tools and pipeline."""

from paxlite.errors import UserError


class DatasetError(UserError, ValueError):
    """Bad input files or a missing/unreadable/invalid dataset directory."""
