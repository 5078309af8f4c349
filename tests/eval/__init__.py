"""Tests for paxlite.eval (scoring) and the readers and batchers of its tasks in paxlite.data."""
