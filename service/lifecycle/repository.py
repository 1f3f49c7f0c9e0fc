"""The model repository on disk: names, versions, config.pbtxt, and completing the config.

Model names and versions arrive from the network, so they are checked here before any of them
is joined to a path.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format

from oip.datatypes import BY_CONFIG_TYPE, BY_NAME, config_type_name
from protos.inference import model_config_pb2 as mc
from service.inference.classification import LabelFileError, read_labels
from service.inference.tensors import TensorSpec
from service.model import decoupled, reshape, tuning
from service.model.files import ENSEMBLE, PLATFORM, PYTHON_BACKEND, ModelFiles
from service.model.parameters import ParameterError, check_parameters
from service.model.sequences import SequenceConfigError, sequence_settings
from service.model.shapes import shape_buckets
from service.registry.names import MAX_VERSION, NAME_RE, check_model_name

log = logging.getLogger("paddlequic.models")


class RepositoryError(Exception):
    """A model in the repository cannot be served; the message says how to fix it."""


@dataclass(frozen=True)
class RepositoryModel:
    name: str
    path: Path
    config: mc.ModelConfig
    versions: tuple[ModelFiles, ...]  # the versions the version policy serves, oldest first
    labels: Mapping[str, tuple[bytes, ...]] = field(default_factory=dict)  # by output name


class ModelRepository:
    def __init__(self, root: Path) -> None:
        self.root = root

    def model_names(self) -> list[str]:
        if not self.root.is_dir():
            raise RepositoryError(
                f"model repository {self.root} does not exist; export the example models "
                "with `make models` or pass --model-repository"
            )
        return sorted(
            p.name for p in self.root.iterdir() if p.is_dir() and NAME_RE.fullmatch(p.name)
        )

    def load(self, name: str, override: mc.ModelConfig | None = None) -> RepositoryModel:
        """The model's config and the versions it serves; `override` (a load's `config`
        parameter) replaces its config.pbtxt, as Triton's does."""
        check_model_name(name)
        path = self.root / name
        if not path.is_dir():
            raise RepositoryError(f"model {name!r} not found in repository {self.root}")
        config = read_config(path, name, override)
        if ignored := tuning.tuning_fields(config):
            log.warning(
                "model %s: config fields that tune Triton's own engines are accepted and not "
                "applied here: %s",
                name,
                ", ".join(ignored),
            )
        try:
            labels = read_labels(path, config)
        except LabelFileError as exc:
            raise RepositoryError(f"model {name!r}: {exc}") from None
        available = _version_dirs(path)
        if config.platform == ENSEMBLE:
            # An ensemble has no files: version 1 (or its version directories, as Triton
            # wants them) stand for its config.
            versions = sorted(available) or [1]
            chosen = select_versions(config.version_policy, versions)
            return RepositoryModel(
                name,
                path,
                config,
                tuple(ModelFiles(v, path, path, path) for v in chosen),
                labels,
            )
        if not available:
            raise RepositoryError(
                f"model {name!r} has no version directories under {path}; "
                "export one with `make models`"
            )
        chosen = select_versions(config.version_policy, sorted(available))
        files = _python_files if config.backend == PYTHON_BACKEND else _model_files
        if not chosen:
            raise RepositoryError(
                f"model {name!r}: version_policy selects none of the versions "
                f"{sorted(available)} under {path}"
            )
        return RepositoryModel(
            name, path, config, tuple(files(available[v], v) for v in chosen), labels
        )


def read_config(path: Path, name: str, override: mc.ModelConfig | None = None) -> mc.ModelConfig:
    """config.pbtxt (or `override` in its place), checked; a directory with a model.py in a
    version directory and no config.pbtxt is a Python model (Triton's auto-complete: its
    auto_complete_config, if it has one, completes the config when it loads)."""
    config = mc.ModelConfig()
    path_of_config = path / "config.pbtxt"
    config_file = str(path_of_config)
    if override is not None:
        config.CopyFrom(override)
        config_file = "the load's `config` parameter"
    elif path_of_config.is_file():
        try:
            text_format.Parse(path_of_config.read_text(), config)
        except text_format.ParseError as exc:
            raise RepositoryError(f"{config_file}: {exc}") from exc
    if (
        not (config.backend or config.platform)
        and (override is not None or not path_of_config.is_file())
        and any((d / "model.py").is_file() for d in _version_dirs(path).values())
    ):
        config.backend = PYTHON_BACKEND
    if config.name and config.name != name:
        raise RepositoryError(
            f"{config_file}: name {config.name!r} differs from the directory name {name!r}"
        )
    config.name = name
    if config.platform not in ("", PLATFORM, ENSEMBLE):
        raise RepositoryError(
            f"{config_file}: platform {config.platform!r} is not served here; "
            f"use platform: {PLATFORM!r} or {ENSEMBLE!r}"
        )
    config.platform = config.platform or PLATFORM
    if config.backend not in ("", PYTHON_BACKEND):
        raise RepositoryError(
            f"{config_file}: backend {config.backend!r} is not served here; leave it out for "
            f"Paddle models, or use backend: {PYTHON_BACKEND!r} with a model.py"
        )
    if config.backend == PYTHON_BACKEND and config.platform == ENSEMBLE:
        raise RepositoryError(f"{config_file}: an ensemble has no backend")
    if (config.platform == ENSEMBLE) != config.HasField("ensemble_scheduling"):
        raise RepositoryError(
            f"{config_file}: ensemble_scheduling goes with platform {ENSEMBLE!r}, and only there"
        )
    check_config(config, config_file)
    return config


def check_config(config: mc.ModelConfig, where: str) -> None:
    """What config.pbtxt, or a Python model's auto_complete_config, must get right; the
    RepositoryError names `where`."""
    if config.max_batch_size < 0:
        raise RepositoryError(f"{where}: max_batch_size must be >= 0")
    refused = decoupled.refusal(config) or tuning.unserved(config) or reshape.refusal(config)
    if refused is not None:
        raise RepositoryError(f"{where}: {refused}")
    try:
        sequence_settings(config)
    except SequenceConfigError as exc:
        raise RepositoryError(f"{where}: sequence_batching: {exc}") from None
    try:
        check_parameters(config)
        shape_buckets(config)
    except ParameterError as exc:
        raise RepositoryError(f"{where}: {exc}") from None


def auto_completed(config: mc.ModelConfig, completed: bytes) -> mc.ModelConfig:
    """A Python model's config as its auto_complete_config completed it: it may add inputs,
    outputs, max_batch_size and dynamic batching; the scheduler, and whether the model is
    decoupled, were fixed when its workers started, from config.pbtxt."""
    done = mc.ModelConfig()
    done.ParseFromString(completed)
    where = f"model {config.name!r}: the config its auto_complete_config answered"
    if done.name != config.name or done.backend != config.backend:
        raise RepositoryError(f"{where} changes its name or backend")
    if done.model_transaction_policy.decoupled != config.model_transaction_policy.decoupled:
        raise RepositoryError(
            f"{where} changes model_transaction_policy; set it in config.pbtxt "
            "(paddlequic starts a decoupled model's workers differently)"
        )
    if done.HasField("sequence_batching") != config.HasField("sequence_batching"):
        raise RepositoryError(f"{where} changes sequence_batching; set it in config.pbtxt")
    check_config(done, where)
    return done


def check_python_tensors(config: mc.ModelConfig) -> None:
    if not config.input or not config.output:
        raise RepositoryError(
            f"model {config.name!r}: a Python model must list its inputs and outputs, in "
            "config.pbtxt or through auto_complete_config"
        )


def select_versions(policy: mc.ModelVersionPolicy, available: Sequence[int]) -> list[int]:
    """Triton's version_policy: latest N (default 1), all, or specific versions."""
    kind = policy.WhichOneof("policy_choice")
    if kind == "all":
        return list(available)
    if kind == "specific":
        wanted = set(policy.specific.versions)
        return [v for v in available if v in wanted]
    count = policy.latest.num_versions if kind == "latest" else 1
    return list(available[-max(count, 1) :])


def _version_dirs(path: Path) -> dict[int, Path]:
    return {
        int(p.name): p
        for p in path.iterdir()
        if p.is_dir() and p.name.isdigit() and p.name.isascii() and int(p.name) <= MAX_VERSION
    }


def _python_files(path: Path, version: int) -> ModelFiles:
    model = path / "model.py"
    if not model.is_file():
        raise RepositoryError(f"{path} holds no model.py for this Python model")
    return ModelFiles(version, path, model, model)


def _model_files(path: Path, version: int) -> ModelFiles:
    """Prefer `inference.*`; otherwise the single program file in the directory."""
    for program_ext in (".json", ".pdmodel"):
        candidates = [path / f"inference{program_ext}"]
        if not candidates[0].is_file():
            candidates = sorted(path.glob(f"*{program_ext}"))
        for program in candidates:
            params = program.with_suffix(".pdiparams")
            if program.is_file() and params.is_file():
                return ModelFiles(version, path, program, params)
    raise RepositoryError(
        f"{path} holds no Paddle model (expected inference.json or inference.pdmodel with "
        "inference.pdiparams); export one with `make models`"
    )


def complete_config(
    config: mc.ModelConfig, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]
) -> mc.ModelConfig:
    """Fill inputs/outputs the config omits from what the model file declares, and check the
    ones it lists against the model, so a wrong config fails at load and not per request."""
    done = mc.ModelConfig()
    done.CopyFrom(config)
    batched = config.max_batch_size > 0
    if _renames_outputs(config, outputs):
        _check_renamed_outputs(config, outputs)
        outputs = tuple(
            TensorSpec(entry.name, spec.datatype, spec.shape)
            for entry, spec in zip(config.output, outputs, strict=True)
        )
    for kind, declared, listed in (
        ("input", inputs, done.input),
        ("output", outputs, done.output),
    ):
        by_name = {t.name: t for t in declared}
        listed_entries: Sequence[mc.ModelInput | mc.ModelOutput] = listed
        if not listed_entries:
            for spec in declared:
                entry = listed.add()
                entry.name = spec.name
                entry.data_type = BY_NAME[spec.datatype].config_type
                entry.dims.extend(_config_dims(spec, batched))
            continue
        for entry in listed_entries:
            found = by_name.get(entry.name)
            if found is None:
                raise RepositoryError(
                    f"model {config.name!r}: config.pbtxt lists {kind} {entry.name!r} but the "
                    f"model has {sorted(by_name)}"
                )
            spec = found
            want = BY_NAME[spec.datatype].config_type
            if entry.data_type != want:
                raise RepositoryError(
                    f"model {config.name!r}: {kind} {entry.name!r} is "
                    f"{config_type_name(entry.data_type)} in config.pbtxt but "
                    f"{config_type_name(want)} in the model"
                )
            dims = list(reshape.model_dims(entry))
            if kind == "input" and len(dims) + batched != len(spec.shape):
                raise RepositoryError(
                    f"model {config.name!r}: input {entry.name!r} has dims {dims} in "
                    f"config.pbtxt but shape {list(spec.shape)} in the model"
                    + (" (the batch dimension is implied by max_batch_size)" if batched else "")
                )
    for entry in list(done.input) + list(done.output):
        if entry.data_type not in BY_CONFIG_TYPE:
            raise RepositoryError(
                f"model {config.name!r}: {entry.name!r} has unsupported data_type "
                f"{config_type_name(entry.data_type)}"
            )
    return done


def fetch_names(config: mc.ModelConfig, outputs: Sequence[TensorSpec]) -> dict[str, str]:
    """Configured output name -> the program's fetch name, for the outputs config.pbtxt
    renames (empty when it renames none)."""
    if not _renames_outputs(config, outputs):
        return {}
    return {
        entry.name: spec.name
        for entry, spec in zip(config.output, outputs, strict=True)
        if entry.name != spec.name
    }


def _renames_outputs(config: mc.ModelConfig, outputs: Sequence[TensorSpec]) -> bool:
    """Paddle 3 names every program output fetch_name_N; a config.pbtxt that lists names the
    program lacks gives its outputs, in order, the names callers see."""
    program = {spec.name for spec in outputs}
    return any(entry.name not in program for entry in config.output)


def _check_renamed_outputs(config: mc.ModelConfig, outputs: Sequence[TensorSpec]) -> None:
    """Renamed outputs map by position, so the count, each datatype and rank must match."""
    model = f"model {config.name!r}"
    program = [spec.name for spec in outputs]
    listed = [entry.name for entry in config.output]
    if len(listed) != len(program):
        raise RepositoryError(
            f"{model}: config.pbtxt lists {len(listed)} output(s) {listed} but the model has "
            f"{len(program)} {program}; outputs named differently from the model's map to its "
            "outputs in order, so list all of them"
        )
    duplicated = sorted({name for name in listed if listed.count(name) > 1})
    if duplicated:
        raise RepositoryError(f"{model}: config.pbtxt lists output(s) {duplicated} twice")
    batched = config.max_batch_size > 0
    for position, (entry, spec) in enumerate(zip(config.output, outputs, strict=True)):
        if entry.name in program and entry.name != spec.name:
            raise RepositoryError(
                f"{model}: config.pbtxt lists output {entry.name!r} at position {position} but "
                f"the model's output {position} is {spec.name!r} (renamed outputs map in order)"
            )
        mapped = f"output {entry.name!r} (the model's output {position}, {spec.name!r})"
        want = BY_NAME[spec.datatype].config_type
        if entry.data_type != want:
            raise RepositoryError(
                f"{model}: {mapped} is {config_type_name(entry.data_type)} in config.pbtxt but "
                f"{config_type_name(want)} in the model"
            )
        dims = list(reshape.model_dims(entry))
        if spec.shape and len(dims) + batched != len(spec.shape):
            raise RepositoryError(
                f"{model}: {mapped} has dims {dims} in config.pbtxt but shape "
                f"{list(spec.shape)} in the model"
                + (" (the batch dimension is implied by max_batch_size)" if batched else "")
            )


def _config_dims(spec: TensorSpec, batched: bool) -> tuple[int, ...]:
    return spec.shape[1:] if batched and spec.shape else spec.shape
