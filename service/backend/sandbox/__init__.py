"""The Python-model sandbox: kernel mechanisms that confine a worker running untrusted
model.py code (privileges, Landlock, seccomp), each usable on its own and each reporting when
the host cannot provide it."""
