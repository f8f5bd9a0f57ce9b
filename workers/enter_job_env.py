"""The last step into an attempt: give its command the job's environment, then run it.

    python -I -S enter_job_env.py [--init] ENV_FILE -- COMMAND...

Why a step of its own: a job's environment is the user's (`script.env` may name LD_PRELOAD, PATH,
PYTHONPATH...), so nothing that runs before the sandbox has dropped to the job's user may see it:
not the shell that enters the cgroups, not bwrap, not setpriv (they run as the worker's user,
root on most hosts, and LD_PRELOAD would run the user's library in each). The worker starts them
with an empty environment and writes the job's to ENV_FILE in the attempt's directory (not on a
command line, where every user of the host could read its tokens in `ps`); this program runs last,
as the job's user inside the sandbox, reads the file, removes it and runs COMMAND with that
environment, plus what the sandbox itself set (HOME, TMPDIR, its GPUs, its network interface),
which the job can't override.

`--init`: this process is PID 1 of the attempt's PID namespace (bwrap --as-pid-1). It runs COMMAND
as its child, reaps whatever is left to it, and exits with COMMAND's status as soon as COMMAND
ends: the kernel then kills every other process of the namespace (asked to stop, it first lets
them end, up to a grace: they may be saving a checkpoint). Bubblewrap's own PID 1 would
wait for all of them: a script's daemonised helper kept a finished job `running` for minutes, and
its worker from stopping. Signals are the training's: SIGTERM reaches COMMAND through the process
group, and this process only outlives it (as PID 1 it would otherwise ignore them). Without
`--init` it becomes COMMAND (exec).

Standard library only and run with -I -S: it must not import anything of the job's environment.
"""

import ctypes
import json
import os
import signal
import sys
import time

PR_SET_DUMPABLE = 4  # <linux/prctl.h>
STOP_GRACE_SECONDS = 60.0  # at most; the worker's own stop, and a cluster's grace time, end it sooner


def main(argv: list[str]) -> None:
    init = argv[:1] == ["--init"]
    env_file, separator, *command = argv[1:] if init else argv
    if separator != "--" or not command:
        sys.exit("usage: enter_job_env.py [--init] ENV_FILE -- COMMAND...")
    with open(env_file) as file:
        env = json.load(file)
    os.unlink(env_file)  # read once: it must not stay among the attempt's files (outputs, checkpoints)
    env.update(os.environ)  # the sandbox's own (bwrap --setenv): the job doesn't override those
    if not init:
        os.execvpe(command[0], command, env)
    stopping = []
    for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(stop, lambda *_: stopping.append(True))  # a handler, not SIG_IGN, which the command would inherit
    child = os.fork()
    if child == 0:
        try:
            os.execvpe(command[0], command, env)
        finally:
            os._exit(127)  # only if the exec failed
    # Not dumpable: the job's processes (the same user) can't read this one's memory or /proc/1/environ.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    while True:
        pid, status = os.wait()  # orphans of the namespace are reaped here too
        if pid == child:
            break
    if stopping:
        outlive_the_others()
    sys.exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def outlive_the_others(grace_seconds: float = STOP_GRACE_SECONDS) -> None:
    """Asked to stop, COMMAND may end before the processes that do the stopping: Accelerate's
    single-process launcher dies of the SIGTERM its training answers with a checkpoint, when the
    signal reaches every process at once (a cluster preempting its job; a group's SIGTERM). Those
    are given their grace before this process's exit ends the namespace."""
    deadline = time.monotonic() + grace_seconds
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                time.sleep(0.05)
        except ChildProcessError:  # none left
            return


if __name__ == "__main__":
    main(sys.argv[1:])
