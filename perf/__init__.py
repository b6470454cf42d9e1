"""Measuring: the load generator, Triton statistics, benchmarks, tuning; results/ holds their outputs."""
