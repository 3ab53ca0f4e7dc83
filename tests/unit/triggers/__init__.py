"""Unit tests of the triggers app."""
