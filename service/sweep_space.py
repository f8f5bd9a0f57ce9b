"""A sweep's search space in Optuna's terms, and a trial's job spec: the base spec with its values put in."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from api_schemas import Dimension

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution


class NoSuchField(KeyError):
    """A dotted path that names no field of the job spec."""


def with_params(spec: dict, params: dict) -> dict:
    """A copy of `spec` (a job spec as JSON, every field present) with each dotted path set to its value."""
    spec = copy.deepcopy(spec)
    for path, value in params.items():
        *parents, leaf = path.split(".")
        node = spec
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            raise NoSuchField(path)
        node[leaf] = value
    return spec


def distribution(dimension: Dimension) -> BaseDistribution:
    # Imported here, at a sweep's first use: Optuna takes ~0.4 s of CPU to import, which every API
    # start paid (admission imports this module for with_params) though most never run a sweep.
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if dimension.choice is not None:
        return CategoricalDistribution(dimension.choice)
    if dimension.int_range is not None:
        return IntDistribution(*dimension.int_range, step=dimension.step or 1)
    if dimension.log_uniform is not None:
        return FloatDistribution(*dimension.log_uniform, log=True)
    return FloatDistribution(*dimension.uniform)


def distributions(space: dict[str, Dimension]) -> dict[str, BaseDistribution]:
    return {path: distribution(dimension) for path, dimension in space.items()}


def grid(space: dict[str, Dimension]) -> dict[str, list]:
    """Every value of each dimension (a grid sweep's are all discrete: the schema checks)."""
    return {path: dimension.grid_values for path, dimension in space.items()}


def grid_size(space: dict[str, Dimension]) -> int:
    size = 1
    for values in grid(space).values():
        size *= len(values)
    return size
