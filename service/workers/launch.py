"""Starting one worker process: its launcher (subreaper.py; for a Paddle CPU worker, forked by
the preloaded launcher, preloaded.py, or its version's model template, templates.py, where it
can) and cgroup (cgroups.py), its
environment, the sockets it is handed (messages, and shared-memory segments as descriptors), a
pipe for a Python model's output (model_output.py logs it), and the load handshake, bounded by
LOAD_TIMEOUT_S."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from service.backend import python_sandbox
from service.backend.load import Load
from service.backend.sandbox import seccomp
from service.model.parameters import child_processes, worker_memory_mb
from service.workers import cgroups, message_bounds, protocol, subreaper
from service.workers.fork_channel import ForkedProcess
from service.workers.forked import PreloadedLauncher
from service.workers.spec import WorkerSpec
from service.workers.templates import ModelTemplates

# All a Python model's worker sees of the server's environment: nothing secret (TLS keys,
# tokens, ticket keys) can reach model.py through it. The numeric libraries' kernel choices
# pass: a host that sets OPENBLAS_CORETYPE because its OpenBLAS misdetects the CPU needs it in
# every worker, and forcing AVX2 kernels (ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS) is how
# an AVX-512 host reproduces an AVX2-only one.
PYTHON_ENV_ALLOWED = (
    "PATH", "PYTHONPATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR",
    "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS",
)  # fmt: skip
LOAD_TIMEOUT_S = 600.0


class Launcher(Protocol):
    """A worker's launcher process (subreaper.py): the server's child, or one the preloaded
    launcher forked (forked.py)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def send_signal(self, signum: int) -> None: ...


@dataclass
class Spawned:
    """A started worker's launcher, its cgroup and the front-end's ends of its two sockets."""

    process: Launcher  # it exits with the worker's status
    messages: socket.socket
    segments: socket.socket  # non-blocking
    output: int | None  # a Python model's stdout and stderr: the pipe's end to read
    cgroup: Path | None


@functools.cache
def worker_cgroups() -> cgroups.WorkerCgroups:
    """Decided once per server process, at its first worker."""
    return cgroups.detect()


@functools.cache
def preloaded_launcher() -> PreloadedLauncher:
    """Paddle CPU workers are forked from it (preloaded.py); Python models' workers start
    fresh, for their sandbox, and GPU workers too, so that nothing of the GPU runtime is
    ever initialised before their device is chosen."""
    return PreloadedLauncher()


@functools.cache
def model_templates() -> ModelTemplates:
    return ModelTemplates(preloaded_launcher())


async def stop_launchers() -> None:
    model_templates().stop()
    await preloaded_launcher().stop()


def end(process: Launcher) -> None:
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
    # A Python model's prints go to the server's log, tagged with the model's name
    # (model_output.py reads them).
    output, output_child = os.pipe() if python else (None, asyncio.subprocess.DEVNULL)
    memory_mb = worker_memory_mb(spec.parameters, python)
    cgroup = None
    try:
        cgroup = worker_cgroups().create(
            spec.instance_name, None if memory_mb is None else memory_mb << 20
        )
        options = launcher_options(spec, cgroup)
        process: Launcher | None = None
        if spec.preloaded and not python and spec.device == "cpu":
            process = await _forked(spec, options, env, (child, segments_child))
        if process is None:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                subreaper.__name__,
                *options,
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
                stdout=output_child,
                stderr=output_child if python else None,
                env=env,
                # Out of the server's process group, as the preloaded launcher (forked.py).
                process_group=0,
            )
    except BaseException:
        parent.close()
        segments.close()
        if output is not None:
            os.close(output)
        cgroups.WorkerCgroups.remove(cgroup)
        raise
    finally:
        child.close()
        segments_child.close()
        if output is not None:
            os.close(output_child)
    return Spawned(process, parent, segments, output, cgroup)


async def _forked(
    spec: WorkerSpec, options: list[str], env: dict[str, str], sockets: tuple[socket.socket, ...]
) -> ForkedProcess | None:
    """Forked from its version's model template where it has one, else from the preloaded
    launcher; None: neither could."""
    if spec.template:
        templates = model_templates()
        forked = await templates.spawn(
            load_message(spec), options, env, sockets, spec.instance_name
        )
        if forked is not None:
            return forked
    return await preloaded_launcher().spawn(options, env, sockets, spec.instance_name)


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


def load_message(spec: WorkerSpec) -> Load:
    """What the worker (or its model template) is told to load."""
    files = spec.files
    return Load(
        spec.model_name,
        files.version,
        str(files.model_file),
        str(files.params_file),
        dict(spec.parameters),
        spec.device,
        spec.shapes,
        spec.backend,
        spec.config,
        spec.max_message_bytes,
    )


async def load(
    spec: WorkerSpec,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    process: Launcher,
) -> protocol.Loaded:
    """Tell the worker what to load and wait for its answer; a worker that fails (or takes
    longer than LOAD_TIMEOUT_S) is ended and RuntimeError carries the reason."""
    writer.write(protocol.encode(load_message(spec)))
    try:
        first = await asyncio.wait_for(
            read_message(reader, lambda: message_bounds.DESCRIPTOR_MAX), LOAD_TIMEOUT_S
        )
    except TimeoutError:
        first = protocol.LoadFailed(f"loading took longer than {LOAD_TIMEOUT_S:.0f} s")
    except protocol.Oversized as exc:
        first = protocol.LoadFailed(f"the worker broke the protocol: it sent {exc}")
    if not isinstance(first, protocol.Loaded):
        writer.close()
        end(process)
        code = await process.wait()
        reason = (
            first.reason if isinstance(first, protocol.LoadFailed) else f"worker exited ({code})"
        )
        raise RuntimeError(reason)
    return first


async def read_message(
    reader: asyncio.StreamReader, largest: Callable[[], int]
) -> protocol.Message | None:
    """The worker's next message; protocol.Oversized, with only its header read, when it
    declares more than `largest()` (asked once the header is in: what the worker holds may
    have changed while this waited)."""
    try:
        header = await reader.readexactly(protocol.header_size())
        body = await reader.readexactly(protocol.body_size(header, largest()))
    except asyncio.IncompleteReadError:
        return None
    return protocol.decode(body)
