"""Entry point: `accelerate launch -m workers.training --spec spec.json --data-root DIR --run-dir DIR [--resume-from CKPT]`.

Parse → build → train → close. Exits 0 when done, 2 on a bad spec, 75 when preempted (SIGTERM)
after saving a checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import ValidationError

from api_schemas import JobSpec
from api_schemas.worker_protocol import EXIT_PREEMPTED
from workers.training.loop import train
from workers.training.reporter import reporter_from_env


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.training", description="Run one Trainyard training job.")
    parser.add_argument("--spec", type=Path, required=True, help="job spec (JSON)")
    parser.add_argument("--data-root", type=Path, required=True, help="directory that dataset.path is relative to")
    parser.add_argument("--run-dir", type=Path, required=True, help="where checkpoints are written")
    parser.add_argument("--resume-from", type=Path, help="checkpoint directory to resume from")
    args = parser.parse_args()

    try:
        spec = JobSpec.model_validate_json(args.spec.read_text())
    except (OSError, ValidationError) as exc:
        print(f"error: invalid job spec {args.spec}: {exc}", file=sys.stderr)
        return 2

    reporter = reporter_from_env()
    try:
        result = train(spec, args.data_root, args.run_dir, reporter, args.resume_from)
    finally:
        reporter.close()
    return EXIT_PREEMPTED if result.preempted else 0


if __name__ == "__main__":
    sys.exit(main())
