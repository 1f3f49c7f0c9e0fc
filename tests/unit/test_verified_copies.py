"""What a version loads from under the signing policy (service/lifecycle/verified_copies.py):
the repository's files without a policy or for an allowed unsigned model, otherwise a private
copy of the bytes the signature was checked on, in one 0700 directory that goes at shutdown.
`make mutate` found no unit test importing the module."""

from __future__ import annotations

import asyncio
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from service.lifecycle.repository import ModelRepository
from service.lifecycle.signatures import sign
from service.lifecycle.signing import SignatureError, SigningPolicy
from service.lifecycle.verified_copies import VerifiedCopies, drop_copy
from service.model.files import ModelFiles
from service.registry.versions import ServedVersion
from tests.servers import EXAMPLE_MODELS
from tests.unit.test_signing import ENSEMBLE_CONFIG, key, trusted  # noqa: F401  # the fixture


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A repository with mlp and an ensemble of it; temporary directories (the copies) are
    made under tmp_path/tmp, so the test sees every one."""
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    repository = tmp_path / "repo"
    shutil.copytree(EXAMPLE_MODELS / "mlp", repository / "mlp")
    (repository / "pair").mkdir()
    (repository / "pair" / "config.pbtxt").write_text(ENSEMBLE_CONFIG)
    return repository


def version(root: Path, name: str) -> tuple[ServedVersion, ModelFiles]:
    """The version as the loader has it: read from the repository, before any check."""
    model = ModelRepository(root).load(name)
    files = model.versions[-1]
    return ServedVersion(name, files.version, model.config), files


def checked(
    copies: VerifiedCopies, served: ServedVersion, files: ModelFiles
) -> tuple[ModelFiles, object]:
    return asyncio.run(copies.checked(served, files))


def temporary(root: Path) -> list[Path]:
    return sorted((root.parent / "tmp").rglob("*"))


def test_without_a_signing_policy_the_repository_is_loaded(root: Path) -> None:
    served, files = version(root, "mlp")
    loaded, config = checked(VerifiedCopies(None), served, files)
    assert loaded is files and config is served.config
    assert served.copy is None and temporary(root) == []


def test_a_signed_version_loads_from_a_private_copy_of_what_was_checked(
    root: Path,
    key: Path,  # noqa: F811
) -> None:
    sign(root / "mlp", key)
    copies = VerifiedCopies(SigningPolicy(trusted(key), required=True))
    served, files = version(root, "mlp")
    loaded, config = checked(copies, served, files)
    assert served.copy is not None and served.copy.is_dir()
    assert loaded == ModelFiles(
        files.version,
        served.copy / "1",
        served.copy / "1" / files.model_file.name,
        served.copy / "1" / files.params_file.name,
    )
    assert loaded.model_file.read_bytes() == files.model_file.read_bytes()
    assert loaded.params_file.read_bytes() == files.params_file.read_bytes()
    assert config == served.config
    private = served.copy.parent
    assert private.name.startswith("paddlequic-verified-")
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    files.params_file.write_bytes(b"written after the check")
    assert loaded.params_file.read_bytes() != b"written after the check"
    copies.remove_all()
    assert temporary(root) == []


def test_versions_checked_at_once_share_one_private_directory(
    root: Path,
    key: Path,  # noqa: F811
) -> None:
    """An ensemble's copy is its config; its files are the copy's version directory."""
    for name in ("mlp", "pair"):
        sign(root / name, key)
    copies = VerifiedCopies(SigningPolicy(trusted(key), required=True))
    (mlp, mlp_files), (pair, pair_files) = version(root, "mlp"), version(root, "pair")

    async def both() -> list[tuple[ModelFiles, object]]:
        return list(
            await asyncio.gather(copies.checked(mlp, mlp_files), copies.checked(pair, pair_files))
        )

    (_, mlp_config), (pair_loaded, pair_config) = asyncio.run(both())
    assert mlp.copy is not None and pair.copy is not None
    assert mlp.copy.parent == pair.copy.parent and mlp.copy != pair.copy
    assert temporary(root)[0] == mlp.copy.parent  # the only directory made outside it
    assert (mlp_config, pair_config) == (mlp.config, pair.config)
    assert pair_loaded == ModelFiles(1, pair.copy / "1", pair.copy / "1", pair.copy / "1")
    assert (pair.copy / "config.pbtxt").read_text() == ENSEMBLE_CONFIG
    copies.remove_all()
    assert temporary(root) == []


def test_an_unsigned_model_loads_from_the_repository_when_allowed(
    root: Path,
    key: Path,  # noqa: F811
) -> None:
    """The copy made for the check goes at once: nothing is left behind."""
    copies = VerifiedCopies(SigningPolicy(trusted(key), required=False))
    served, files = version(root, "mlp")
    loaded, config = checked(copies, served, files)
    assert loaded is files and config is served.config
    assert served.copy is None
    (private,) = temporary(root)
    assert private.name.startswith("paddlequic-verified-")


def test_an_unsigned_model_is_refused_when_signatures_are_required(
    root: Path,
    key: Path,  # noqa: F811
) -> None:
    copies = VerifiedCopies(SigningPolicy(trusted(key), required=True))
    served, files = version(root, "mlp")
    with pytest.raises(SignatureError, match="not signed"):
        checked(copies, served, files)


def test_a_config_signed_after_it_was_read_is_refused(
    root: Path,
    key: Path,  # noqa: F811
) -> None:
    """The version was set up from the config read before the check; one signed since (a
    new max_batch_size) would load with settings nobody checked against the version's."""
    served, files = version(root, "mlp")
    config_file = root / "mlp" / "config.pbtxt"
    config_file.write_text(
        config_file.read_text().replace("max_batch_size: 64", "max_batch_size: 3")
    )
    sign(root / "mlp", key)
    copies = VerifiedCopies(SigningPolicy(trusted(key), required=True))
    with pytest.raises(SignatureError, match=r"mlp/config\.pbtxt changed while being loaded"):
        checked(copies, served, files)


def test_a_signed_config_that_cannot_be_served_is_refused(
    root: Path,
    key: Path,  # noqa: F811
) -> None:
    served, files = version(root, "mlp")
    config_file = root / "mlp" / "config.pbtxt"
    config_file.write_text(config_file.read_text().replace('name: "mlp"', 'name: "other"'))
    sign(root / "mlp", key)
    copies = VerifiedCopies(SigningPolicy(trusted(key), required=True))
    with pytest.raises(SignatureError, match=r"signed config\.pbtxt cannot be served.*'other'"):
        checked(copies, served, files)


def test_a_dropped_copy_is_gone_and_dropping_it_again_is_harmless(
    root: Path,
    key: Path,  # noqa: F811
) -> None:
    """A version retired after the shutdown removed every copy drops its own again."""
    sign(root / "mlp", key)
    copies = VerifiedCopies(SigningPolicy(trusted(key), required=True))
    served, files = version(root, "mlp")
    checked(copies, served, files)
    copy = served.copy
    assert copy is not None
    drop_copy(served)
    assert served.copy is None and not copy.exists()
    served.copy = copy  # already gone
    drop_copy(served)
    assert served.copy is None
    copies.remove_all()
    copies.remove_all()
    VerifiedCopies(None).remove_all()  # nothing was ever copied
