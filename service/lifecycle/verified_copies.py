"""Signed models are loaded from a private copy of the bytes their signature was checked on:
every worker start and restart loads the copy, so nothing written to the repository after
the check (or a swapped symlink) ever runs, and the labels served (label_filename) are the
signed ones."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from pathlib import Path

from protos.inference import model_config_pb2 as mc
from service.inference.classification import LabelFileError, read_labels
from service.lifecycle.repository import RepositoryError, read_config
from service.lifecycle.signing import CONFIG_FILE, SignatureError, SigningPolicy
from service.model.files import ENSEMBLE, ModelFiles
from service.registry.versions import ServedVersion


class VerifiedCopies:
    """The signing policy's checks, and the private copies of the versions it verified."""

    def __init__(self, signing: SigningPolicy | None) -> None:
        self.signing = signing
        self._copies: Path | None = None  # the private copies of verified versions (0700)
        self._copies_made = threading.Lock()

    async def checked(
        self, served: ServedVersion, files: ModelFiles
    ) -> tuple[ModelFiles, mc.ModelConfig]:
        """The files and config to load the version from; SignatureError when the signing
        policy refuses it."""
        if self.signing is None:
            return files, served.config
        return await asyncio.to_thread(self._verified, served, files)

    def _verified(
        self, served: ServedVersion, files: ModelFiles
    ) -> tuple[ModelFiles, mc.ModelConfig]:
        """Check the version's signature, copying the checked bytes into a private directory:
        the files and the config to load from then, the repository's if it is unsigned and
        that is allowed. Every worker start and restart loads the copy, so nothing written to
        the repository after the check (or a swapped symlink) ever runs."""
        assert self.signing is not None
        with self._copies_made:  # versions are verified in threads, several at once
            if self._copies is None:
                self._copies = Path(tempfile.mkdtemp(prefix="paddlequic-verified-"))  # mode 0700
        copy = Path(tempfile.mkdtemp(prefix=f"{served.name}-{served.version}-", dir=self._copies))
        served.copy = copy
        ensemble = served.config.platform == ENSEMBLE
        # The model's directory: the repository's, or the one a load's uploaded files went to.
        model_dir = files.path if ensemble else files.path.parent
        labels = tuple(o.label_filename for o in served.config.output if o.label_filename)
        if not self.signing.check(
            model_dir, served.name, served.version, copy, ensemble=ensemble, served_files=labels
        ):
            drop_copy(served)
            return files, served.config
        try:
            config = read_config(copy, served.name)
        except RepositoryError as exc:
            raise SignatureError(f"the signed {CONFIG_FILE} cannot be served: {exc}") from exc
        if config != served.config:
            raise SignatureError(
                f"{served.name}/{CONFIG_FILE} changed while being loaded, or the load's `config` "
                "parameter differs from the signed one"
            )
        try:
            signed_labels = read_labels(copy, config)
        except LabelFileError as exc:
            raise SignatureError(f"the signed label file cannot be served: {exc}") from exc
        if signed_labels != served.labels:
            raise SignatureError(f"a label file of {served.name} changed while being loaded")
        version_dir = copy / str(served.version)
        relocated = ModelFiles(
            files.version,
            version_dir,
            version_dir / files.model_file.relative_to(files.path),
            version_dir / files.params_file.relative_to(files.path),
        )
        return relocated, config

    def remove_all(self) -> None:
        """At shutdown: every copy goes."""
        if self._copies is not None:
            shutil.rmtree(self._copies, ignore_errors=True)


def drop_copy(served: ServedVersion) -> None:
    if served.copy is not None:
        shutil.rmtree(served.copy, ignore_errors=True)
        served.copy = None
