"""Shared-memory queues between the process holding calls and a worker: no process in the
middle."""
