"""Unit tests of the project plumbing (iotqueue)."""
