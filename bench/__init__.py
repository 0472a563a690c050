"""Benchmarks: ``python -m bench`` prints a table and writes bench/results/latest.json."""
