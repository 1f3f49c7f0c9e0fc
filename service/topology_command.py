"""`paddlequic topology`: the devices, their links, and where each configured model instance
would be placed and why, without starting anything."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from service.lifecycle.repository import ModelRepository, RepositoryError
from service.placement.host import load_topology
from service.placement.instance_groups import instance_requests, place_all
from service.placement.report import describe


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="paddlequic topology", description=__doc__)
    parser.add_argument("--topology", default="", help="a recorded host (JSON); default: NVML")
    parser.add_argument("--model-repository", type=Path, default=Path("models"))
    args = parser.parse_args(argv)
    topology = load_topology(args.topology)
    repository = ModelRepository(args.model_repository)
    requests, problems = {}, []
    for name in repository.model_names() if repository.root.is_dir() else []:
        try:
            model = repository.load(name)
        except RepositoryError as exc:
            problems.append(f"{name}: {exc}")
            continue
        for files in model.versions:
            key = f"{name}_{files.version}"
            requests[key] = instance_requests(key, model.config, topology)
    placements, unplaced = place_all(requests, topology)
    print(describe(topology, [p for key in requests for p in placements.get(key, [])]))
    for key, reason in unplaced.items():
        print(f"\n{key}: cannot be placed: {reason}")
    for problem in problems:
        print(f"\n{problem}")
    return 1 if unplaced or problems else 0
