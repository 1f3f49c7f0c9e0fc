"""Predictor worker processes: one per model instance; Paddle is only ever imported there."""
