"""What other services import: the numpy-level inference client and the command line."""
