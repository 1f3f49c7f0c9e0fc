"""What other services import: the numpy-level inference client and the command line.

`__version__` is the distribution's one version: the build reads it from here (pyproject.toml),
`paddlequic --version` prints it and the server reports it in ServerMetadata."""

__version__ = "0.1.0"
