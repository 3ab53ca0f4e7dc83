"""Unit tests of the run engine's pure decisions."""
