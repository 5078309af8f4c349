"""Tests for paxlite.eval."""
