"""The checks on a model's files sent with RepositoryModelLoad: which names and sizes are
written, and where."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path, PurePosixPath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.lifecycle.uploads import (
    MAX_DEPTH,
    MAX_PART_CHARS,
    Refused,
    UploadLimits,
    plan_upload,
    remove_upload,
    write_upload,
)

LIMITS = UploadLimits(max_files=8, max_bytes=1000)
ROOT = "/srv/upload/model"
parts = st.sampled_from(["1", "model.py", "..", ".", "", "a b", "x\\y", "é", "\0", "/", "data"])
names = st.lists(parts, min_size=1, max_size=5).map("/".join)


@given(st.dictionaries(names, st.integers(0, 100), max_size=LIMITS.max_files))
def test_an_accepted_path_stays_inside_the_models_directory(sizes: dict[str, int]) -> None:
    plan = plan_upload(sizes, LIMITS)
    if isinstance(plan, Refused):
        assert not plan.too_large  # within both bounds: refused for a path
        return
    assert {str(p) for p in plan} == set(sizes)
    for path in plan:
        joined = os.path.join(ROOT, str(path))
        assert os.path.normpath(joined) == joined  # no `.`, `..` or `//` to resolve
        assert joined.startswith(ROOT + "/")
        assert str(path).isascii() and str(path).isprintable() and "\\" not in str(path)


@given(names.filter(lambda n: ".." in n.split("/") or n.startswith("/")))
def test_parent_and_absolute_paths_are_refused(name: str) -> None:
    plan = plan_upload({name: 1, "1/model.py": 1}, LIMITS)
    assert isinstance(plan, Refused) and not plan.too_large
    assert repr(name) in plan.reason


@given(st.lists(st.integers(0, 400), min_size=1, max_size=12))
def test_count_and_total_size_are_bounded_per_load(sizes: list[int]) -> None:
    plan = plan_upload({f"1/f{i}": size for i, size in enumerate(sizes)}, LIMITS)
    fits = len(sizes) <= LIMITS.max_files and sum(sizes) <= LIMITS.max_bytes
    assert isinstance(plan, Refused) is not fits
    if isinstance(plan, Refused):
        assert plan.too_large
        assert "--max-upload-files" in plan.reason or "--max-upload-bytes" in plan.reason


def test_exactly_the_bounds_fit() -> None:
    exact = {f"1/f{i}": LIMITS.max_bytes // LIMITS.max_files for i in range(LIMITS.max_files)}
    assert not isinstance(plan_upload(exact, LIMITS), Refused)
    over = {**exact, "1/f0": exact["1/f0"] + 1}
    assert isinstance(plan_upload(over, LIMITS), Refused)
    assert isinstance(plan_upload({**exact, "1/more": 0}, LIMITS), Refused)


def test_a_file_where_another_needs_a_directory_is_refused() -> None:
    plan = plan_upload({"1": 1, "1/model.py": 1}, LIMITS)
    assert isinstance(plan, Refused) and "'1' as a directory" in plan.reason


def test_depth_and_the_config_file_are_refused() -> None:
    deep = "/".join(["d"] * (MAX_DEPTH + 1)) + "/f"
    assert isinstance(plan_upload({deep: 1}, LIMITS), Refused)
    assert not isinstance(plan_upload({"/".join(["d"] * MAX_DEPTH) + "/f": 1}, LIMITS), Refused)
    refused = plan_upload({"config.pbtxt": 1}, LIMITS)
    assert isinstance(refused, Refused) and "`config` parameter" in refused.reason


def test_written_into_a_fresh_private_directory() -> None:
    contents = {"1/model.py": b"code", "1/data/weights.bin": b"\0" * 10}
    plan = plan_upload({k: len(v) for k, v in contents.items()}, LIMITS)
    assert not isinstance(plan, Refused)
    root = write_upload("m", plan, contents, 'name: "m"\n')
    try:
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        written = {
            p.relative_to(root / "m").as_posix(): p.read_bytes()
            for p in (root / "m").rglob("*")
            if p.is_file()
        }
        assert written == {**contents, "config.pbtxt": b'name: "m"\n'}
        assert all(
            stat.S_IMODE(p.stat().st_mode) == 0o600 for p in (root / "m").rglob("*") if p.is_file()
        )
    finally:
        remove_upload(root)
    assert not root.exists()


def test_a_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(KeyError):
        write_upload("m", (PurePosixPath("1/model.py"),), {}, "")  # no bytes for the file
    assert list(tmp_path.iterdir()) == []


def test_a_name_longer_than_a_file_system_holds_is_a_bound_passed() -> None:
    """Triton answers it INTERNAL (simple_grpc_model_control.py checks): as a bound, not as a
    bad path."""
    plan = plan_upload({"1/" + "A" * (MAX_PART_CHARS + 1): 1}, LIMITS)
    assert isinstance(plan, Refused) and plan.too_large
    assert "NAME_MAX" in plan.reason
    assert not isinstance(plan_upload({"1/" + "A" * MAX_PART_CHARS: 1}, LIMITS), Refused)
