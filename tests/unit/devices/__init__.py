"""Unit tests of the devices app."""
