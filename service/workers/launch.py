"""Starting one worker process: its launcher (subreaper.py) and cgroup (cgroups.py), its
environment, the sockets it is handed (messages, and shared-memory segments as descriptors), a
Python model's output into the server's log, and the load handshake, bounded by
LOAD_TIMEOUT_S."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from service.backend import python_sandbox
from service.backend.load import Load
from service.backend.sandbox import seccomp
from service.model.parameters import child_processes, worker_memory_mb
from service.workers import cgroups, protocol, subreaper
from service.workers.spec import WorkerSpec

model_log = logging.getLogger("paddlequic.model")

# All a Python model's worker sees of the server's environment: nothing secret (TLS keys,
# tokens, ticket keys) can reach model.py through it.
PYTHON_ENV_ALLOWED = ("PATH", "PYTHONPATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR")
MAX_LOG_LINE = 4096  # characters of one line a Python model prints, in the server's log
LOAD_TIMEOUT_S = 600.0


@dataclass
class Spawned:
    """A started worker's launcher, its cgroup and the front-end's ends of its two sockets."""

    process: asyncio.subprocess.Process  # the launcher: it exits with the worker's status
    messages: socket.socket
    segments: socket.socket  # non-blocking
    cgroup: Path | None


@functools.cache
def worker_cgroups() -> cgroups.WorkerCgroups:
    """Decided once per server process, at its first worker."""
    return cgroups.detect()


def end(process: asyncio.subprocess.Process) -> None:
    """Kill the worker and every process it started: its launcher's SIGTERM."""
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)


def launcher_options(spec: WorkerSpec, cgroup: Path | None) -> list[str]:
    """The count of a sandboxed Python model's processes, where seccomp does not refuse them
    all already; the cgroup to enter."""
    options = []
    if spec.python and python_sandbox.wanted(spec.parameters):
        children = child_processes(spec.parameters)
        if children or not seccomp.supported():
            options += ["--children", str(children)]
    if cgroup is not None:
        options += ["--cgroup", str(cgroup)]
    return options


async def spawn(spec: WorkerSpec) -> Spawned:
    parent, child = socket.socketpair()
    # Segments travel as descriptors, one per datagram (message boundaries kept).
    segments, segments_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    segments.setblocking(False)
    python = spec.python
    inherited = (
        {k: v for k, v in os.environ.items() if k in PYTHON_ENV_ALLOWED} if python else os.environ
    )
    env = {**inherited, "GLOG_minloglevel": "2", **spec.env}
    if python:
        # numpy's OpenBLAS would start its threads at import, before the sandbox, which
        # holds only for the thread that enters it (python_sandbox.py).
        env["OPENBLAS_NUM_THREADS"] = "1"
    # A Python model's prints go to the server's log, tagged with the model's name.
    output = asyncio.subprocess.PIPE if python else asyncio.subprocess.DEVNULL
    memory_mb = worker_memory_mb(spec.parameters, python)
    cgroup = None
    try:
        cgroup = worker_cgroups().create(
            spec.instance_name, None if memory_mb is None else memory_mb << 20
        )
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            subreaper.__name__,
            *launcher_options(spec, cgroup),
            "--",
            sys.executable,
            "-m",
            "service.workers.main",
            "--fd",
            str(child.fileno()),
            "--segments-fd",
            str(segments_child.fileno()),
            pass_fds=(child.fileno(), segments_child.fileno()),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=output,
            stderr=output if python else None,
            env=env,
        )
    except BaseException:
        parent.close()
        segments.close()
        cgroups.WorkerCgroups.remove(cgroup)
        raise
    finally:
        child.close()
        segments_child.close()
    return Spawned(process, parent, segments, cgroup)


def worker_pid(launcher: int) -> int:
    """The worker's pid: the launcher's first child (any other started after it)."""
    children = list(subreaper.children_of(launcher))
    return min(children, key=_start_time, default=launcher)


def _start_time(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return 1 << 62
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


async def load(
    spec: WorkerSpec,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    process: asyncio.subprocess.Process,
) -> protocol.Loaded:
    """Tell the worker what to load and wait for its answer; a worker that fails (or takes
    longer than LOAD_TIMEOUT_S) is ended and RuntimeError carries the reason."""
    files = spec.files
    writer.write(
        protocol.encode(
            Load(
                spec.model_name,
                files.version,
                str(files.model_file),
                str(files.params_file),
                dict(spec.parameters),
                spec.device,
                spec.shapes,
                spec.backend,
                spec.config,
            )
        )
    )
    try:
        first = await asyncio.wait_for(read_message(reader), LOAD_TIMEOUT_S)
    except TimeoutError:
        first = protocol.LoadFailed(f"loading took longer than {LOAD_TIMEOUT_S:.0f} s")
    if not isinstance(first, protocol.Loaded):
        writer.close()
        end(process)
        code = await process.wait()
        reason = (
            first.reason if isinstance(first, protocol.LoadFailed) else f"worker exited ({code})"
        )
        raise RuntimeError(reason)
    return first


async def forward_output(stream: asyncio.StreamReader, model: str) -> None:
    """Each line a Python model's worker prints, into the server's log (bounded per line)."""
    pending = b""
    while chunk := await stream.read(1 << 16):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > MAX_LOG_LINE:
            lines.append(pending)
            pending = b""
        for line in lines:
            model_log.info("model %s: %s", model, line.decode(errors="replace")[:MAX_LOG_LINE])
    if pending:
        model_log.info("model %s: %s", model, pending.decode(errors="replace")[:MAX_LOG_LINE])


async def read_message(reader: asyncio.StreamReader) -> protocol.Message | None:
    try:
        header = await reader.readexactly(protocol.header_size())
        body = await reader.readexactly(protocol.body_size(header))
    except asyncio.IncompleteReadError:
        return None
    return protocol.decode(body)
