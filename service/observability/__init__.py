"""Metrics, request logs and traces, observed around the servicers so both transports share
one implementation and the transports stay unaware of it."""
