"""Development tooling: embedded servers, the process supervisor, the dev stack, simulated devices
and the demo. The product apps never import it and the runtime image does not ship it."""
