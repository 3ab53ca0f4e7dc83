"""Unit tests of the dev tooling."""
