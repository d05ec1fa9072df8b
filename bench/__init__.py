"""edgefleet benchmarks: ``python -m bench.run [--quick] [--only NAME ...] [--out PATH]``.

Every figure is a ratio of two measurements taken side by side in one run, so the
report stays meaningful on a small, noisy machine. The last full report is kept in
``bench/RESULTS.md``.
"""
