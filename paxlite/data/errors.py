"""Errors of the data tools and pipeline."""


class DatasetError(ValueError):
    """Bad input files or a missing/unreadable/invalid dataset directory."""
