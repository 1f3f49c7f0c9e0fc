"""Which versions' requests go straight into their instances' queues, and what those queues
are (their layout and what the worker is told): one setup the server and every front-end
build their ends by."""

from __future__ import annotations

import math
from collections.abc import Sequence

from oip.datatypes import BY_CONFIG_TYPE
from protos.inference import model_config_pb2 as mc
from service.batching.queue import BatchPolicy
from service.model.files import PYTHON_BACKEND
from service.model.parameters import python_instance_queues, string_parameters
from service.queues import records
from service.queues.layout import QueueLayout
from service.queues.ring import aligned8
from service.workers import protocol

MB = 1 << 20


def queueable(config: mc.ModelConfig, bls_reason: str | None) -> bool:
    """Versions whose requests can go straight to their instances: Paddle models', run by
    the dynamic batcher (not sequences, streams, ensembles), and Python models' that make no
    BLS calls, which a queued worker has no channel for (a BLS call goes back through the
    process holding its request): as python_instance_queues says, else where `bls_reason`
    (service/model/python_code.py) finds no reason to think they make some."""
    said = python_instance_queues(string_parameters(config))
    python = bls_reason is None if said is None else said
    return (
        (config.backend != PYTHON_BACKEND or python)
        and not config.HasField("sequence_batching")
        and not config.HasField("ensemble_scheduling")
        and not config.model_transaction_policy.decoupled
        and all(len(t.dims) < records.MAX_RANK for t in config.input)
        and all(len(t.dims) < records.MAX_RANK for t in config.output)
    )


def queue_setup(
    config: mc.ModelConfig, policy: BatchPolicy, fetch_names: dict[str, str], queue_mb: int
) -> protocol.Queues:
    """What a version's workers are told of their queues, and every process writing into
    them builds its end by."""
    rows = max(config.max_batch_size, 1)
    ring = queue_mb * MB // 2
    return protocol.Queues(
        QueueLayout(
            ring_bytes(ring, config.input, rows), ring_bytes(ring, config.output, rows), rows
        ),
        policy,
        tuple((t.name, BY_CONFIG_TYPE[t.data_type].name) for t in config.input),
        tuple(fetch_names.get(t.name, t.name) for t in config.output),
    )


RECORD_SLACK = 4096  # a record's own fields, past its tensors' bytes


def ring_bytes(
    least: int, tensors: Sequence[mc.ModelInput] | Sequence[mc.ModelOutput], rows: int
) -> int:
    """A ring's data bytes: `least`, or room for a full batch's tensors in one record where
    the config fixes their size (a ring takes records of up to half its size), so that a
    model's largest request always fits, its warm-up's included (BYTES elements have no
    fixed size: `least` then)."""
    if any(d < 0 for t in tensors for d in t.dims) or any(
        t.data_type == mc.TYPE_STRING for t in tensors
    ):
        return aligned8(least)
    full = rows * sum(
        math.prod(t.dims) * BY_CONFIG_TYPE[t.data_type].numpy.itemsize for t in tensors
    )
    return aligned8(max(least, 2 * (full + RECORD_SLACK)))
