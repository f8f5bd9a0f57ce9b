"""`script.requirements`: what a script says it needs, checked against what is there; installing is
`environment.pip`'s job (workers/environments.py). The API checks the names against the packages
the workers provide and those the job's environment installs; the worker checks the versions in the
job's environment before it launches the script."""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def package_name(requirement: str) -> str:
    return canonicalize_name(Requirement(requirement).name)


def unmet(requirements: list[str], path: list[str] | None = None) -> list[str]:
    """One message per requirement the installed packages don't satisfy; empty when all are met.
    `path`: where to look for them (a job's environment, then the worker's); default sys.path."""
    problems = []
    for text in requirements:
        requirement = Requirement(text)
        found = next(iter(metadata.distributions(name=requirement.name, path=path if path is not None else sys.path)), None)
        if found is None:
            problems.append(f"{requirement.name} is not installed")
            continue
        installed = found.version
        if not requirement.specifier.contains(installed, prereleases=True):
            problems.append(f"{requirement.name} {installed} is installed, the script needs {requirement.specifier}")
    return problems
