"""A job's run record: what it was, so that it can be run again and two runs told apart.

The service keeps the spec and each uploaded bundle's sha256; each attempt's worker adds, as it
starts, what only the host knows (RunEnvironment): the digest of every input file it gave the
training, its Python and packages, and the device. `trainyard rerun N` submits the spec again with
those digests to hold (JobSpec.inputs_sha256) and `environment.pip` pinned to what it resolved to;
`trainyard diff N M` shows where two records differ.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

Digest = Field(pattern=r"^[0-9a-f]{64}$")
MAX_PACKAGES = 2_000
MAX_INPUTS = 50


class RunEnvironment(BaseModel):
    """What one host ran an attempt with, as its worker saw it at the start."""

    python: str = Field(max_length=100, description="The Python version the training ran on, e.g. 3.11.7.")
    platform: str = Field(max_length=200, description="The host's operating system and machine, e.g. Linux-6.1.0-x86_64.")
    device: str = Field(max_length=300, description="The device model: the CPU's name, or each GPU's.")
    cpu_threads: int | None = Field(
        None, ge=1, le=65536,
        description="Threads of each CPU process (its slots' cores): a CPU run's sums are added in other orders with "
        "another count, so its weights match a run's bit for bit only with the same. Null on a GPU, or from an older worker.",
    )
    packages: dict[str, str] = Field(
        max_length=MAX_PACKAGES, description="Every package of the worker's interpreter and its version (torch, accelerate, …)."
    )
    environment_packages: dict[str, str] = Field(
        default_factory=dict, max_length=MAX_PACKAGES,
        description="What the job's `environment.pip` resolved to: every package of its own environment, exact versions.",
    )
    inputs: dict[str, str] = Field(
        default_factory=dict, max_length=MAX_INPUTS,
        description="sha256 of each input the worker gave the training, by its path under the data root (a dataset, "
        "tokenizer, model directory: a directory's digest covers its files' names and contents) or `plugin:<module>` "
        "for a custom loop's code. A script's code is the upload's (RunRecord.code_sha256); what a script reads on its own is its own.",
    )


class AttemptEnvironment(BaseModel):
    attempt: int = Field(description="The attempt's number (a multi-node job's nodes share it).")
    node_rank: int
    host_name: str
    started_at: datetime | None
    environment: RunEnvironment | None = Field(description="None: its worker reported none (it never started, or predates run records).")


class RunRecord(BaseModel):
    """GET /v1/jobs/{id}/record."""

    job_id: int
    name: str
    spec: dict = Field(description="The job's spec as stored (defaults filled in): what a rerun submits.")
    code_sha256: str | None = Field(description="A script job's uploaded code bundle: sha256 of the archive as uploaded.")
    attempts: list[AttemptEnvironment] = Field(description="Each attempt's environment, oldest first.")

    @property
    def environment(self) -> RunEnvironment | None:
        """The environment of the latest attempt that reported one: what the job's end was trained with."""
        reported = [a.environment for a in self.attempts if a.environment is not None]
        return reported[-1] if reported else None
