"""Wire protocols with no inference knowledge (gRPC framing and status mapping, HTTP/3)."""
