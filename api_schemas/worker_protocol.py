"""How the worker and the training processes it launches talk: an environment variable and exit codes.

The training loop appends JSON lines to the file named by EVENTS_FILE_ENV:
    {"type": "metrics", "step": N, "values": {"train_loss": …, …}}
    {"type": "checkpoint", "step": N, "path": "/abs/dir"}   (a complete directory, see manifest.py)
and exits 0 when done, EXIT_PREEMPTED after checkpointing on SIGTERM, anything else on failure.
"""

EVENTS_FILE_ENV = "TRAINYARD_EVENTS_FILE"
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped at a checkpoint, resume later

# A `script` job's processes also get (see workers/script_hooks.py):
CHECKPOINT_DIR_ENV = "TRAINYARD_CHECKPOINT_DIR"  # where save_state() without a directory of its own writes
RESUME_FROM_ENV = "TRAINYARD_RESUME_FROM"  # the checkpoint directory to load_state() from, when resuming
