"""Serving: the bundled tritonserver, supervised (serve-repo)."""
