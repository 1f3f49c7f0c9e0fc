"""How a caller names a model and a version: checked before anything is looked up by them."""

from __future__ import annotations

import re

from service.inference import errors

NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


MAX_VERSION = 2**63 - 1


def check_model_name(name: str) -> str:
    """Refuse anything but a plain directory name (no separators, no `..`)."""
    if not NAME_RE.fullmatch(name) or ".." in name:
        raise errors.invalid(
            f"model name {errors.echoed(name)!r} is not a plain name (letters, digits, '_', "
            "'-', '.'; no path separators or '..')"
        )
    return name


def parse_version(version: str) -> int | None:
    """'' means "the newest ready version"; otherwise a non-negative decimal integer. The
    refusal starts with Triton's words, which its clients compare."""
    if version == "":
        return None
    digits = version.lstrip("0") or "0"
    if (
        not version.isdigit()
        or not version.isascii()
        or len(digits) > len(str(MAX_VERSION))  # before int(), whose cost grows with them
        or int(digits) > MAX_VERSION
    ):
        raise errors.invalid(
            "failed to get model version from specified version string "
            f"'{errors.echoed(version)}' is not a version number (a decimal integer from 0 to "
            f"{MAX_VERSION})"
        )
    return int(digits)
