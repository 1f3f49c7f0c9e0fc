"""A model template: the process a Paddle CPU model version's instances are forked from when it
has more than one (the server's side: templates.py). The preloaded launcher forks it
(preloaded.py); it builds the version's predictor from the Load its workers get, never runs
it, and then forks each instance's launcher as the preloaded launcher does, so that every
worker inherits the predictor and shares its weights copy-on-write instead of loading its own
copy (resnet18: about 45 MB less of each worker's own memory).

Built, not run, the predictor has started no thread, so the template is single-threaded when
it forks (it checks before every fork all the same, as the preloaded launcher does). It holds
what a worker of the model holds, the model and the server's environment, no secret and none
of the server's sockets; it ends when the server closes its socket (the version's last
instance ended) or with the preloaded launcher (PR_SET_PDEATHSIG), and the launchers it forked
then end their workers.

On its socket: first the Load, pickled as a worker gets it (protocol.py), answered
`{"ready": true, "bytes": its private memory}` or `{"failed": reason}` (then it exits); then
spawn requests as the preloaded launcher's.
"""

from __future__ import annotations

import json
import os
import socket

from service.backend.load import Load
from service.workers import main, memory, protocol
from service.workers.fork_channel import MAX_REQUEST_BYTES


def build(server: socket.socket) -> bool:
    """Build the model of the Load the server sends, kept for the workers forked from here
    (main.inherit); False, the reason sent, when it fails."""
    data, _, flags, _ = server.recvmsg(MAX_REQUEST_BYTES)
    header = protocol.header_size()
    whole = data and not flags & socket.MSG_TRUNC
    load = protocol.decode(data[header:]) if whole else None
    if not isinstance(load, Load):
        _reply(
            server, {"failed": f"the template expected a Load of at most {MAX_REQUEST_BYTES} bytes"}
        )
        return False
    try:
        model = main.build(load)
    except Exception as exc:
        _reply(server, {"failed": main.failure_reason(exc, load)})
        return False
    main.inherit(load, model)
    # Before any fork, all its own: what building the model added, which its end gives back.
    _reply(server, {"ready": True, "bytes": memory.private_bytes(os.getpid())})
    return True


def _reply(server: socket.socket, message: dict[str, object]) -> None:
    server.sendall(json.dumps(message).encode())
