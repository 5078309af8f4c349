"""Errors of the data tools and pipeline."""

from paxlite.errors import UserError


class DatasetError(UserError, ValueError):
    """Bad input files or a missing/unreadable/invalid dataset directory."""


class VocabError(UserError, ValueError):
    """The tokenizer file is missing, unusable, or does not fit the model."""
