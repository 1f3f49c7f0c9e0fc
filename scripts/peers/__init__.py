"""The servers `make bench-peers` (scripts/bench_peers.py) measures paddlequic against, each
started in a process of its own."""
