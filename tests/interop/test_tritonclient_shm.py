"""tritonclient's system shared-memory example (`tritonclient.utils.shared_memory`), unmodified,
in its own process (tritonclient_shm_check.py): the input read from the client's region and the
output written into one give what in-process Paddle gives, the status lists the regions, and
unregistering removes them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.reference import example_inputs, output_names, run_reference
from tests.servers import REPO_ROOT, ServerProcess

SCRIPT = Path(__file__).with_name("tritonclient_shm_check.py")


def test_tritonclient_shared_memory_example(server: ServerProcess, tmp_path: Path) -> None:
    array = example_inputs("mlp", seed=3)["input"]
    np.savez(tmp_path / "in.npz", input=array)
    command = [sys.executable, str(SCRIPT), "--url", server.address]
    command += ["--inputs", str(tmp_path / "in.npz"), "--out", str(tmp_path / "out.npz")]
    finished = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert finished.returncode == 0, finished.stderr
    with np.load(tmp_path / "out.npz") as data:
        served, status = data["served"], json.loads(str(data["status"]))
    expected = run_reference("mlp", {"input": array})[output_names("mlp")[0]]
    np.testing.assert_allclose(served, expected, rtol=1e-4, atol=1e-5)
    assert set(status["listed"]["regions"]) == {"input_data", "output_data"}
    assert status["listed"]["regions"]["input_data"]["byte_size"] == str(array.nbytes)
    assert status["left"] == {}
    assert status["raw_lengths"] == [0]  # the output travelled in shared memory only
