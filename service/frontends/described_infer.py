"""The parent's side of descriptors: the view of served versions it pushes to the front-ends,
and the calls they describe, each checked against that view as it arrives (described_call.py
runs it)."""

from __future__ import annotations

from service.frontends.described_call import Answering, DescribedCall, Serving
from service.frontends.descriptors import (
    MODEL_INFER,
    DescribedRequest,
    Refusal,
    View,
    ViewEntry,
    encode_view,
)
from service.frontends.protocol import Open
from service.http.textgen import generation_models
from service.inference import errors
from service.observability.observer import Observation
from service.registry.versions import ModelRegistry, ServedVersion

# The labels the view carries at most, all versions' together: the view is one frame, sent to
# every front-end whenever it changes, and a frame has FRAME_OVERHEAD (1 MiB) of room beyond
# the largest message. A version whose labels would go past it is not described (in the order
# of the model names); the parent answers its calls.
MAX_VIEW_LABEL_BYTES = 1 << 20


class StaleView(Exception):
    """The front-end's view no longer holds for this call: it passes the call on as bytes."""


class DescribedInfer:
    def __init__(self, models: ModelRegistry, serving: Serving) -> None:
        self._models = models
        self._serving = serving
        self._described: dict[int, ServedVersion] = {}  # token -> version
        self._next_token = 1

    def view(self) -> bytes:
        """The versions front-ends may describe calls for (MODELS), as requests name them.
        A version keeps its token while it serves, so calls in flight stay valid."""
        tokens = {id(served): token for token, served in self._described.items()}
        described: dict[int, ServedVersion] = {}
        entries: list[ViewEntry] = []
        labelled = _LabelBudget()
        for name in self._models.loaded_names():
            numbers = sorted(self._models.serving(name))
            for key in ("", *map(str, numbers)):
                try:
                    served = self._models.resolve(name, key)
                except errors.ServiceError:
                    continue
                if not describable(served) or not labelled.fits(served):
                    continue
                token = tokens.get(id(served))
                if token is None:
                    token = tokens[id(served)] = self._next_token
                    self._next_token += 1
                described[token] = served
                config = served.config.SerializeToString()
                # Once per version: under its number ("" names one of them too).
                labels = tuple(served.labels.items()) if key else ()
                entries.append(ViewEntry(name, key, token, config, labels))
        self._described = described
        generation = tuple(served.name for served in generation_models(self._models))
        return encode_view(View(tuple(entries), generation))

    @property
    def described(self) -> dict[int, ServedVersion]:
        """The versions of the last view, by token."""
        return self._described

    def call(
        self, link: Answering, call_id: int, opened: Open, request: DescribedRequest
    ) -> DescribedCall:
        """The call on the version it names, or StaleView when that is not the one the
        front-end validated it against (reloaded, unloaded, no longer ready or newest)."""
        served = self._described.get(request.token)
        try:
            resolved = self._models.resolve(request.model_name, request.model_version)
        except errors.ServiceError:
            raise StaleView from None
        if resolved is not served:
            raise StaleView
        return DescribedCall(link, call_id, opened, served, request, self._serving)

    def refused(self, opened: Open, refusal: Refusal, elapsed_ns: int) -> None:
        """A call a front-end refused with its version's validator and answered: observed,
        and counted against the version, as the refusal made here would be."""
        served = self._described.get(refusal.token)
        if served is not None:
            served.stats.record_failure(elapsed_ns)
        observer = self._serving.observer
        observation = Observation(observer, opened.transport, MODEL_INFER, lambda: opened.metadata)
        observation.started -= elapsed_ns  # the call's time is the front-end's
        observation.saw(refusal)
        status = refusal.status
        observation.end(status.code, lambda: status.details)


def describable(served: ServedVersion) -> bool:
    """Versions whose requests front-ends may describe: those served by their own batcher
    and workers, decoupled models (a ModelInfer call on one is refused as the parent
    refuses it, after the same checks; a stream's request keeps its parameters) and
    ensembles (sequence models' calls go on as bytes)."""
    return served.validator is not None and not served.config.HasField("sequence_batching")


class _LabelBudget:
    """The view's labels, all versions' together, within MAX_VIEW_LABEL_BYTES."""

    def __init__(self) -> None:
        self._left = MAX_VIEW_LABEL_BYTES
        self._taken: dict[int, bool] = {}  # each version's answer, once

    def fits(self, served: ServedVersion) -> bool:
        known = self._taken.get(id(served))
        if known is None:
            # As the view encodes them: each line's bytes and its 4-byte length.
            size = sum(len(line) + 4 for lines in served.labels.values() for line in lines)
            known = self._taken[id(served)] = size <= self._left
            if known:
                self._left -= size
        return known
