"""Who may use a sequence model, and whose a sequence is (`--sequence-callers`).

A sequence belongs to the caller that started it: a caller with a client certificate is its
certificate's identity (on either transport, through any front-end), one without is anyone, so
its sequence id is a capability: whoever knows the id may continue, end or restart the
sequence (the clients pick random 63-bit ids). `any` (the default) serves both; `certified`
refuses sequence requests from callers without a certificate, so every sequence is bound to
one identity. A restricted-protocol header is shared by every caller of its category: it is
no identity, and `certified` does not take it for one. A REST caller is known by the
certificate its TLS connection authenticated with, as a gRPC caller (service/http/callers.py);
without one it is anyone."""

from __future__ import annotations

import dataclasses

import grpc

from service.inference import errors
from service.inference.identity import Identity
from service.inference.jobs import InferJob

MODES = ("any", "certified")


class SequenceCallers:
    def __init__(self, mode: str) -> None:
        self.certified = mode == "certified"

    def owned(self, model: str, job: InferJob, identity: Identity) -> InferJob:
        """The job of a sequence model's request, its sequence owned by its caller (`identity`,
        its certificate's; ANYONE without one); UNAUTHENTICATED for a caller without a
        certificate under `certified`."""
        if self.certified and not identity:
            raise errors.ServiceError(
                grpc.StatusCode.UNAUTHENTICATED,
                f"model '{model}' keeps sequences for callers with a client certificate only "
                "(--sequence-callers certified); connect with one the server's --tls-client-ca "
                "trusts",
            )
        if job.sequence is None:
            return job
        return dataclasses.replace(job, sequence=dataclasses.replace(job.sequence, owner=identity))
