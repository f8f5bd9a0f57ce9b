"""What a Slurm try whose agent never started says: the last line of Slurm's output file, where
srun wrote why (a user saw only the path of a file on the scheduler's storage)."""

from __future__ import annotations

from service.backends.slurm import last_line


def test_the_error_an_agent_that_never_started_left_is_its_last_line(tmp_path):
    output = tmp_path / "slurm-49.out"
    output.write_bytes(b"x" * 10_000 + b"\nslurmstepd: error: execve(): /opt/nope/bin/python: No such file or directory\n\n  \n")
    assert last_line(output) == "slurmstepd: error: execve(): /opt/nope/bin/python: No such file or directory"
    output.write_bytes(b"\xff" * 500 + b"\n")  # not text: shown as what it is, cut short
    assert len(last_line(output, most=40)) == 40
    output.write_text("\n\n")
    assert last_line(output) is None and last_line(tmp_path / "missing.out") is None
