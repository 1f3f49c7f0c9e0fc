"""The Paddle Inference backend. Imported only inside worker processes: importing paddle costs
~290 MB and ~1.5 s, and predictor.run() holds the GIL."""
