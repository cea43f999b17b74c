"""The sections of BENCHMARKS.md, one module each (see scripts/benchmarks_md.py)."""
