"""Unit tests of the jobs app."""
