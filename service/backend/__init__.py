"""The backends that run a model in a worker process: Paddle Inference and Python models.
Their modules are imported only inside worker processes (importing paddle costs ~290 MB and
~1.5 s, and predictor.run() holds the GIL), except the load message
(load.py), which the front-end builds, and sandbox/privileges.py, whose undumpable() every
paddlequic process calls at start."""
