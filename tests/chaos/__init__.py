"""The abuse suite: attacks on a live server while well-behaved clients keep calling
(`make chaos` runs the full sizes, tests/chaos/test_chaos.py the short ones)."""
