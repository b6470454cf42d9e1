"""Worked examples, e.g. migrating a TorchServe archive."""
