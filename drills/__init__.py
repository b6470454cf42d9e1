"""Breaking on purpose: fault drills, mixed good/bad traffic, load tests and soaks against a real server."""
