"""Dynamic batching with Triton's semantics: a pure queue (queue.py) driven by asyncio
(batcher.py), and joining requests into one batch and splitting the result (assemble.py)."""
