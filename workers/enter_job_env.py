"""The last step into an attempt: give its command the job's environment, then become it.

    python -I -S enter_job_env.py ENV_FILE -- COMMAND...

Why a step of its own: a job's environment is the user's (`script.env` may name LD_PRELOAD, PATH,
PYTHONPATH...), so nothing that runs before the sandbox has dropped to the job's user may see it:
not the shell that enters the cgroups, not bwrap, not setpriv (they run as the worker's user,
root on most hosts, and LD_PRELOAD would run the user's library in each). The worker starts them
with an empty environment and writes the job's to ENV_FILE in the attempt's directory (not on a
command line, where every user of the host could read its tokens in `ps`); this program runs last,
as the job's user inside the sandbox, reads the file, removes it and execs COMMAND with that
environment, plus what the sandbox itself set (HOME, TMPDIR, its GPUs, its network interface),
which the job can't override.

Standard library only and run with -I -S: it must not import anything of the job's environment.
"""

import json
import os
import sys


def main(argv: list[str]) -> None:
    env_file, separator, *command = argv
    if separator != "--" or not command:
        sys.exit("usage: enter_job_env.py ENV_FILE -- COMMAND...")
    with open(env_file) as file:
        env = json.load(file)
    os.unlink(env_file)  # read once: it must not stay among the attempt's files (outputs, checkpoints)
    env.update(os.environ)  # the sandbox's own (bwrap --setenv): the job doesn't override those
    os.execvpe(command[0], command, env)


if __name__ == "__main__":
    main(sys.argv[1:])
