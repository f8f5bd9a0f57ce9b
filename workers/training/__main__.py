"""Entry point: `accelerate launch -m workers.training --spec spec.json [--stored] --data-root DIR --run-dir DIR [--resume-from CKPT] [--plugin-dir DIR]`.

Parse → build → train → close. Exits 0 when done, 2 on a bad spec (one line on stderr naming the
field), 75 when preempted (SIGTERM) after saving a checkpoint, 76 when the loss guard stopped a diverging
run (roll back), anything else on a failure.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import ValidationError

from api_schemas import JobSpec, field_location
from api_schemas.worker_protocol import EXIT_PREEMPTED, EXIT_ROLLBACK
from workers.process_group_exit import guard_process_group_exit
from workers.training.custom import run_custom
from workers.training.data import SpecError
from workers.training.loop import train
from workers.training.reporter import Reporter, reporter_from_env

EXIT_BAD_SPEC = 2


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.training", description="Run one Trainyard training job.")
    parser.add_argument("--spec", type=Path, required=True, help="job spec (JSON)")
    parser.add_argument("--stored", action="store_true",
                        help="the spec is a job's as the service stored it, maybe by an earlier version: a field this version no longer has is left out (the worker passes it); without it, an unknown field is an error")
    parser.add_argument("--data-root", type=Path, required=True, help="directory that dataset.path is relative to")
    parser.add_argument("--run-dir", type=Path, required=True, help="where checkpoints are written")
    parser.add_argument("--resume-from", type=Path, help="checkpoint directory to resume from")
    parser.add_argument("--skip-steps", type=int, default=0, help="after a rollback: go on past the batches of this many steps (workers/loss_guard.py)")
    parser.add_argument("--plugin-dir", type=Path, help="the only directory a `custom` job's entrypoint module is loaded from")
    args = parser.parse_args()

    try:
        text = args.spec.read_text()
        spec = JobSpec.from_stored(json.loads(text)) if args.stored else JobSpec.model_validate_json(text)
    except OSError as exc:
        return bad_spec(f"cannot read {args.spec}: {exc.strerror}")
    except json.JSONDecodeError as exc:
        return bad_spec(f"{args.spec} is not JSON: {exc}")
    except ValidationError as exc:
        return bad_spec("; ".join(describe(error) for error in exc.errors()))

    guard_process_group_exit()
    reporter = reporter_from_env()
    try:
        if spec.model.kind == "custom":
            result = run_custom(spec, args.data_root, args.run_dir, reporter, args.resume_from, args.plugin_dir, args.skip_steps)
        else:
            result = train(spec, args.data_root, args.run_dir, reporter, args.resume_from, args.skip_steps)
    except SpecError as exc:
        return bad_spec(str(exc), reporter)
    finally:
        reporter.close()
    return EXIT_PREEMPTED if result.preempted else EXIT_ROLLBACK if result.spike else 0


def describe(error: dict) -> str:
    """`training.max_steps: Input should be …`; cross-field rules already name their fields."""
    field = ".".join(map(str, field_location(error["loc"])))
    return f"{field}: {error['msg']}" if field else error["msg"].removeprefix("Value error, ")


def bad_spec(message: str, reporter: Reporter | None = None) -> int:
    """Say so on stderr, and to the worker (which then fails the job without retrying it)."""
    print(f"error: invalid job spec: {message}", file=sys.stderr)
    if reporter is not None:
        reporter.invalid_spec(message)
    return EXIT_BAD_SPEC


if __name__ == "__main__":
    sys.exit(main())
