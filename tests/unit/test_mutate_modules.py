"""`make mutate`'s table of modules and their unit tests (scripts/mutate.py): every row names
files that exist, so a module added with a misspelt test is refused instead of being run with
fewer tests than it names, and `--module` adds a row without editing the table."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.mutate import MODULES, ROOT, module_table
from scripts.mutations import mutants


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_and_its_tests_exist_and_it_has_mutants(module: str) -> None:
    assert MODULES[module], f"{module}: no tests"
    for path in (module, *MODULES[module]):
        assert (ROOT / path).is_file(), path
        assert Path(path).as_posix() == path and not Path(path).is_absolute()
    assert mutants((ROOT / module).read_bytes())


def test_a_module_row_on_the_command_line_adds_or_replaces_one() -> None:
    added, replaced = "transport/h3/address_tokens.py", "service/tickets/outage.py"
    assert added not in MODULES and replaced in MODULES
    table = module_table(
        [
            f"{added}=tests/unit/test_address_tokens.py",
            f"{replaced}=tests/unit/test_shared_tickets.py,tests/unit/test_tickets.py",
        ]
    )
    assert table[added] == ("tests/unit/test_address_tokens.py",)
    assert table[replaced] == ("tests/unit/test_shared_tickets.py", "tests/unit/test_tickets.py")
    assert {m: table[m] for m in MODULES if m != replaced} == {
        m: t for m, t in MODULES.items() if m != replaced
    }


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("service/tickets/outage.py=tests/unit/test_missing.py", "tests/unit/test_missing.py"),
        ("service/missing.py=tests/unit/test_tickets.py", "service/missing.py"),
        ("service/tickets/outage.py", "expected PATH=TEST"),
        ("service/tickets/outage.py=", "expected PATH=TEST"),
    ],
)
def test_a_row_naming_a_missing_file_or_no_tests_is_refused(row: str, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        module_table([row])
