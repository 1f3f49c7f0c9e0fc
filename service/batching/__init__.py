"""Dynamic batching with Triton's semantics: a pure queue (queue.py) driven by asyncio
(batcher.py), and the batch's layout (assemble.py): where each request's rows go in the
worker's shared memory and which output rows come back to it."""
