"""python_code.bls_reason: a Python model whose config says nothing of its instance queues
takes them only when no file of its directory names pb_utils.InferenceRequest, and any doubt
(code the server cannot read, a directory past what it reads, a source that is no file) keeps
it off them. Real directories, real files."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from service.model.python_code import BLS_NAME, MAX_BYTES, MAX_ENTRIES, bls_reason

PLAIN = b"import triton_python_backend_utils as pb_utils\n\nclass TritonPythonModel:\n    pass\n"
CALLS = (
    PLAIN
    + b"call = pb_utils.InferenceRequest(model_name='m', inputs=[], "
    + (b"requested_output_names=[])\n")
)
names = st.text("abcdefghij_", min_size=1, max_size=8)


def model(root: Path, files: dict[str, bytes]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(text)
    return root


def test_a_model_that_names_no_bls_call_has_no_reason(tmp_path: Path) -> None:
    assert bls_reason(model(tmp_path, {"1/model.py": PLAIN, "labels.txt": b"a\nb\n"})) is None


def test_a_helper_module_that_names_one_is_the_reason(tmp_path: Path) -> None:
    root = model(tmp_path, {"1/model.py": PLAIN, "1/helpers/calls.py": CALLS})
    assert bls_reason(root) == "1/helpers/calls.py names pb_utils.InferenceRequest (BLS calls)"


@settings(max_examples=40, deadline=None)
@given(
    before=st.binary(max_size=300),
    after=st.binary(max_size=300),
    depth=st.lists(names, max_size=3),
    name=names,
    calls=st.booleans(),
)
def test_the_name_anywhere_in_any_python_file_is_found(
    before: bytes, after: bytes, depth: list[str], name: str, calls: bool
) -> None:
    text = before + (BLS_NAME if calls else b"") + after
    with tempfile.TemporaryDirectory() as directory:
        relative = "/".join(["1", *depth, f"{name}.py"])
        reason = bls_reason(model(Path(directory), {"1/model.py": PLAIN, relative: text}))
    assert (reason is not None) == (BLS_NAME in text)
    if reason is not None:
        assert "names pb_utils.InferenceRequest" in reason


def test_code_the_server_cannot_read_is_a_reason(tmp_path: Path) -> None:
    root = model(tmp_path, {"1/model.py": PLAIN, "1/fast.cpython-311-x86_64-linux-gnu.so": b""})
    assert (
        bls_reason(root) == "1/fast.cpython-311-x86_64-linux-gnu.so is code the server cannot read"
    )
    (tmp_path / "1" / "fast.cpython-311-x86_64-linux-gnu.so").unlink()
    model(tmp_path, {"1/helper.pyc": b"\x00"})  # importable without its source
    assert bls_reason(root) == "1/helper.pyc is code the server cannot read"


def test_bytecode_of_the_source_beside_it_is_no_reason(tmp_path: Path) -> None:
    """Python imports __pycache__'s bytecode only in its source's place."""
    root = model(tmp_path, {"1/model.py": PLAIN, "1/__pycache__/model.cpython-311.pyc": CALLS})
    assert bls_reason(root) is None


def test_a_source_that_is_no_file_is_a_reason_not_a_hang(tmp_path: Path) -> None:
    model(tmp_path, {"1/model.py": PLAIN})
    os.mkfifo(tmp_path / "1" / "waits.py")  # opening it would wait for a writer
    assert bls_reason(tmp_path) == "1/waits.py is not a file the server reads"


def test_a_linked_directory_is_a_reason(tmp_path: Path) -> None:
    """Its files are not read (os.walk does not follow it): what they name is unknown."""
    elsewhere = model(tmp_path / "elsewhere", {"calls.py": CALLS})
    root = model(tmp_path / "model", {"1/model.py": PLAIN})
    (root / "1" / "helpers").symlink_to(elsewhere)
    assert bls_reason(root) == "1/helpers is a link the server does not follow"


def test_a_directory_past_what_the_server_reads_is_a_reason(tmp_path: Path) -> None:
    model(tmp_path, {"1/model.py": PLAIN})
    for index in range(MAX_ENTRIES):
        (tmp_path / "1" / f"data{index}.txt").touch()
    assert bls_reason(tmp_path) == (
        f"its directory holds more than {MAX_ENTRIES} entries, more than the server reads"
    )


def test_python_source_past_what_the_server_reads_is_a_reason(tmp_path: Path) -> None:
    half = b"#" * (MAX_BYTES // 2)
    root = model(tmp_path, {"1/model.py": PLAIN, "1/a.py": half})
    assert bls_reason(root) is None
    model(tmp_path, {"1/b.py": half})  # the two and model.py: past MAX_BYTES
    assert bls_reason(root) == (
        f"its Python files hold more than the {MAX_BYTES} bytes the server reads"
    )


def test_a_directory_that_cannot_be_read_is_a_reason(tmp_path: Path) -> None:
    reason = bls_reason(tmp_path / "gone")
    assert reason == "its directory cannot be read (No such file or directory)"
