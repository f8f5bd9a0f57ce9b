"""Checkpoint ingest: the CPU a worker host spends taking a finished checkpoint into the artifact store.

    PYTHONPATH=$PWD .venv/bin/python bench/checkpoint_ingest.py [--size-mb 400] [--rounds 3]

Every checkpoint a job reports is taken into the store by the worker's supervisor, on the host
where training goes on, so whatever CPU that takes comes out of the training. A checkpoint of
`--size-mb` (split as the 25M-parameter GPT's: model.safetensors, state/model.safetensors and an
optimizer twice their size, random bytes, with its manifest) is written beside the store, as the
training loop writes it, then taken in with `ArtifactStore.ingest_checkpoint`. The peer is the
plainest safe way to do the same: copy the directory in (`shutil.copytree`) and check it against its
manifest (`verify_manifest`), what the store itself did before. CPU seconds (user + system) of
this process; rounds alternate. Prints one JSON line; ratio = Trainyard's CPU / the peer's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from api_schemas.manifest import MODEL_FILE, verify_manifest, write_manifest  # noqa: E402
from common.artifacts import ArtifactStore  # noqa: E402


def write_checkpoint(directory: Path, size_mb: int) -> Path:
    """model.safetensors and state/model.safetensors a quarter each, the optimizer half."""
    (directory / "state").mkdir(parents=True)
    quarter = (size_mb << 20) // 4
    for name, size in ((MODEL_FILE, quarter), ("state/model.safetensors", quarter), ("state/optimizer.bin", 2 * quarter)):
        (directory / name).write_bytes(os.urandom(size))
    write_manifest(directory, 1)
    return directory


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    # Beside the repository, on its filesystem, as a worker's work and artifact roots are by default.
    with tempfile.TemporaryDirectory(dir=REPO) as tmp_name:
        tmp = Path(tmp_name)
        store = ArtifactStore(tmp / "store")
        peer, trainyard = [], []
        for round_ in range(args.rounds):
            source = write_checkpoint(tmp / "run" / f"peer-{round_}", args.size_mb)
            start = cpu_seconds()
            copied = tmp / "copied" / f"step-{round_}"
            shutil.copytree(source, copied)
            verify_manifest(copied)
            peer.append(cpu_seconds() - start)
            shutil.rmtree(copied)

            source = write_checkpoint(tmp / "run" / f"trainyard-{round_}", args.size_mb)
            start = cpu_seconds()
            store.ingest_checkpoint(source, job_id=1, step=round_)
            trainyard.append(cpu_seconds() - start)
            store.delete(f"jobs/1/checkpoints/step-{round_:08d}")

    result = {
        "benchmark": "checkpoint_ingest",
        "machine": f"{os.cpu_count()} CPU cores",
        "size_mb": args.size_mb,
        "peer_cpu_s": {"median": round(statistics.median(peer), 3), "rounds": [round(s, 3) for s in peer]},
        "trainyard_cpu_s": {"median": round(statistics.median(trainyard), 3), "rounds": [round(s, 3) for s in trainyard]},
        "ratio": round(statistics.median(trainyard) / statistics.median(peer), 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
