"""What a training command of another project needs installed, said before that project starts: its own errors
would come late (an import error once its trainer is being assembled) and name no install command."""

from __future__ import annotations

from collections.abc import Sequence
from importlib import metadata, util


def missing_install(imports: Sequence[tuple[str, str]], distribution: str, series: str, other_series: str) -> str | None:
    """The first of `imports` (module, package that installs it) not installed, or `distribution` installed in a
    release series other than `series` ("0.9"), in words ending with `other_series` (why that one will not do);
    None when everything is there.  A distribution on sys.path without its metadata (a source checkout) is taken
    as the series wanted."""
    for module, package in imports:
        if util.find_spec(module) is None:
            return f"{package} is not installed"
    try:
        version = metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None
    if not version.startswith(series):
        return f"{distribution} {version} is installed; {other_series}"
    return None
