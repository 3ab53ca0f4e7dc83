"""The fast tier: logic tested module by module, with no server (`make test-fast`)."""
