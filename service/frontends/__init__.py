"""Several front-end processes on one port feeding one scheduler (`--frontends N`)."""
