"""The sandbox a Python model's worker enters after its limits are set and before model.py is
imported (model parameter `python_sandbox`, `on` unless a trusted model says `off`).

- User and capabilities: a worker of a root server becomes `nobody` when that user can read
  what the model needs, and drops every capability either way (uid 0 without capabilities
  cannot ptrace, read another process's /proc files, override file permissions or raise
  limits).
- no_new_privs: nothing it executes gains privileges; required for the two below.
- Landlock: files only beneath the interpreter, its packages, this project's packages, the
  model's own directory (read-only), /usr, a few device and /etc files and the CPU's
  description (/proc/cpuinfo, /sys/devices/system/cpu); no TCP connect or
  bind (ABI 4); no signals to or abstract sockets of outside processes (ABI 6). The server's
  environment in /proc, its TLS keys, ticket keys and trusted keys are outside all of these.
- RLIMIT_FSIZE: the only files it can write (memfd_create ones: memory outside its address
  space) hold at most MAX_FILE_MB each; RLIMIT_NOFILE bounds how many.
- seccomp: no socket() of any family, no io_uring, ptrace, process_vm_*, mounts, namespaces
  (clone's namespace flags included), kernel modules, keys, BPF or perf events; no new process
  unless the model asks for child processes (python_child_processes).

Shared memory needs no rule: the worker gets its own segments as file descriptors and no
segment has a name anyone could open (service/workers/shm.py).

What the host cannot provide is returned, for the front-end's warning at load; what fails for
another reason fails the load (closed, not open).
"""

from __future__ import annotations

import os
import pwd
import resource
import site
import sysconfig
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import oip
import service
from protos import __file__ as protos_init
from service.backend.sandbox import landlock, privileges, seccomp
from service.model.parameters import PYTHON_SANDBOX

# Whom a root server's Python workers run as, when it can read the interpreter, the packages
# and the model (else uid 0 without capabilities, and a warning).
SANDBOX_USER = "nobody"
# Read-only beyond the Python installation and the model: shared libraries and data under /usr,
# what the dynamic linker and time functions read, the entropy devices, and what numeric
# libraries read to pick their kernels (Paddle runs `cat /proc/cpuinfo`; OpenBLAS and oneDNN
# read the CPU list and caches under /sys/devices/system/cpu). Nothing else of /proc or /sys.
_SYSTEM_READ = (
    "/usr", "/etc/ld.so.cache", "/etc/localtime", "/dev/urandom", "/dev/random",
    "/proc/cpuinfo", "/sys/devices/system/cpu",
)  # fmt: skip
_SYSTEM_READ_WRITE = ("/dev/null",)
# What of its own /proc/PID a model may read: not net/ (every socket of the host's network
# namespace), mountinfo or mounts (the host's mounts), environ. Directories it may only list
# (their files stay closed: task/TID holds net/ and mountinfo again).
_OWN_PROC_FILES = ("stat", "statm", "status", "maps", "cmdline", "comm", "limits")
_OWN_PROC_LISTS = ("fd", "task")
# The largest file a sandboxed model may write (all it can write is a memfd_create file).
MAX_FILE_MB = 16


def wanted(parameters: Mapping[str, str]) -> bool:
    """Off only where the model's parameters say so (check_parameters refuses any value but
    "on" and "off")."""
    return parameters.get(PYTHON_SANDBOX, "on") != "off"


def enter(model_dir: Path, children: bool) -> list[str]:
    """Confine this (single-threaded) process for good; returns what is missing, and why.
    `children`: the model may start processes."""
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        # Landlock and capabilities hold for the calling thread only.
        raise RuntimeError(f"the Python sandbox needs a single-threaded worker, it has {threads}")
    missing = []
    allowed = list(_allowed(model_dir))
    if privileges.is_root():
        missing.extend(_leave_root(p for p, _ in allowed))
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    file_size = (
        MAX_FILE_MB << 20 if hard == resource.RLIM_INFINITY else min(MAX_FILE_MB << 20, hard)
    )
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    privileges.no_new_privileges()
    privileges.undumpable()
    version = landlock.abi()
    if version == 0:
        missing.append(
            "Landlock (Linux 5.13+, 'landlock' in the lsm= boot list): model.py can read "
            "every file its user may, and signal processes of its user"
        )
    else:
        landlock.restrict(allowed, version)
        if version < 6:
            missing.append(
                f"Landlock ABI 6 (Linux 6.12+; this kernel has ABI {version}): model.py can "
                "signal processes of its user"
            )
    if not seccomp.supported():
        missing.append(
            f"seccomp filter (x86_64 and aarch64 only, not {os.uname().machine}): model.py can "
            "open network sockets, start processes and create namespaces"
        )
    elif not seccomp.install(children):
        missing.append(
            "seccomp filter (CONFIG_SECCOMP_FILTER): model.py can open network sockets, start "
            "processes and create namespaces"
        )
    return missing


def _leave_root(needed: Iterable[Path]) -> list[str]:
    """To SANDBOX_USER if it can read what the model needs; capabilities go either way."""
    privileges.drop_bounding_set()
    try:
        user = pwd.getpwnam(SANDBOX_USER)
    except KeyError:
        unreadable: Path | str | None = f"no user {SANDBOX_USER} on this host"
    else:
        unreadable = privileges.unreadable_as(user.pw_uid, user.pw_gid, needed)
        if unreadable is None:
            privileges.become(user.pw_uid, user.pw_gid)
    privileges.drop_capabilities()
    if unreadable is None:
        return []
    return [
        f"a user of its own ({SANDBOX_USER} cannot read {unreadable}): model.py runs as uid 0 "
        "without capabilities, so only Landlock keeps it from files root owns"
    ]


def _allowed(model_dir: Path) -> Iterator[tuple[Path, int]]:
    paths = sysconfig.get_paths()
    python = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    python.update(site.getsitepackages())
    python.update(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    for entry in sorted(p for p in python if p):
        yield Path(entry), landlock.READ
    yield Path(service.__file__).parent, landlock.READ
    yield Path(oip.__file__).parent, landlock.READ
    yield Path(protos_init).parent, landlock.READ
    yield model_dir, landlock.READ
    own = Path(f"/proc/{os.getpid()}")
    for name in _OWN_PROC_FILES:
        yield own / name, landlock.READ
    for name in _OWN_PROC_LISTS:
        yield own / name, landlock.READ_DIR
    for system in _SYSTEM_READ:
        yield Path(system), landlock.READ
    for device in _SYSTEM_READ_WRITE:
        yield Path(device), landlock.READ_WRITE
