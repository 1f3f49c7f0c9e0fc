"""The request path below the servicer: breaker, fallback, then the batcher or an ensemble."""
