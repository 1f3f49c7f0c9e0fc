"""The backends that run a model in a worker process: Paddle Inference and Python models.
Their modules are imported only inside worker processes (importing paddle costs ~290 MB and
~1.5 s, and predictor.run() holds the GIL); this package itself holds only names the front-end
uses too."""

# config.pbtxt's `backend` of a model.py implementing Triton's TritonPythonModel (the other
# models are Paddle programs).
PYTHON_BACKEND = "python"
