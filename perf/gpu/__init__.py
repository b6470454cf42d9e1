"""The GPU round: python -m perf.gpu.round --out DIR (round.py says what it runs)."""
