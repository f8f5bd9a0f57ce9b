"""`script.requirements`: what a script says it needs, checked against what is there (nothing is
installed per job). The API checks the names against the packages the workers provide; the worker
checks the versions it has before it launches the script."""

from __future__ import annotations

from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def package_name(requirement: str) -> str:
    return canonicalize_name(Requirement(requirement).name)


def unmet(requirements: list[str]) -> list[str]:
    """One message per requirement the installed packages don't satisfy; empty when all are met."""
    problems = []
    for text in requirements:
        requirement = Requirement(text)
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{requirement.name} is not installed")
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            problems.append(f"{requirement.name} {installed} is installed, the script needs {requirement.specifier}")
    return problems
