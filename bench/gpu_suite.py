"""Every GPU check of issue #41 in one command, each Trainyard figure beside its peer from the same run.

    PYTHONPATH=$PWD python bench/gpu_suite.py [--only throughput,profile,checkpoint,fsdp,sandbox,service,large_batch,variants] [--out FILE]

Needs one CUDA GPU; `sandbox` and `service` need `bwrap` on the PATH, `service` the service's
packages. Each check prints one JSON line as it ends (also appended to `--out`); a table comes last.
A check that fails prints its error and the others still run.

- throughput: GPT-2 small (12×768, block 1024, GPT-2's vocabulary padded to 50304 as nanoGPT: a
  word-level tokenizer over Tiny Shakespeare, the rest unused; 124M parameters), bf16, micro-batch
  `--batch` (default 64), with the GPU defaults (torch.compile, fused AdamW, TF32), through the training entry
  point as a worker launches it (`accelerate launch -m workers.training`). Peers, same model, batch
  and data: bench/plain_accelerate_loop.py with the same settings (`--gpu-defaults`), the same loop
  as it is (eager, unfused), and a nanoGPT-style loop (this file's `--nanogpt-peer`: torch.autocast,
  torch.compile, fused AdamW, random batches from pinned memory, no Accelerate). tokens/s from step
  `--skip` on, MFU, peak allocated memory. The entry point runs first, on an empty compile cache, so
  its launch → first step is a cold start (the peer of the `service` start).
  MFU = tokens/s × (6·N + 12·L·C·T) / 989e12: N the parameters without the position embedding
  (nanoGPT's estimate_mfu), 989 TFLOP/s the datasheet's dense bf16 peak of an H100/H200 SXM; the
  8192³ bf16 matmul this GPU reaches is measured first and printed beside it.
- profile: the same training in this process under torch.profiler, a few steps after warm-up:
  GPU busy share of the step, the top kernels and host calls, torch.compile's graph breaks.
- checkpoint: the stall per checkpoint (step after a save minus the median step away from saves,
  as bench/checkpoint_stall.py) of the entry point's background checkpoint, against the plain
  loop's synchronous `accelerator.save_state`, same model and settings. Target ≤ 0.1×.
- fsdp: strategy `fsdp` (FSDP2, param_dtype bfloat16, reduce float32) on the one GPU: a run, the
  same run resumed from its middle checkpoint (losses after the resume compared step by step), and
  peak memory against `ddp` with the same bf16 precision (both eager).
- sandbox: a command in an attempt's sandbox (workers/sandbox.py) given GPU 0, and given none:
  `torch.cuda.device_count()` and `nvidia-smi -L` inside.
- variants (only when named in `--only`): settings a job could use, through the entry
  point, each its own line: `--variants 32,32x4,64,peer,best+autotune` (micro-batch × gradient
  accumulation; `peer` the nanoGPT-style loop at the best so far; `+autotune` torch.compile's
  max-autotune-no-cudagraphs mode, through Inductor's environment variables).
- service: the throughput job submitted to an embedded stack (`trainyard up`: API, scheduler,
  worker with `--devices cuda:all`, the attempt in its sandbox): tokens/s against the entry point's
  (target ≥ 0.98×), submit → first step against the entry point's cold launch → first step, and the
  attempt's NVML samples (`sys/gpu_*`) as the job's page reads them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# GPT-2 small as nanoGPT builds it: the head tied to the token embedding (124M parameters), no biases.
# The built-in GPT's own defaults (untied, biases: chosen for the small CPU model) would make it 162M,
# and the MFU's FLOPs count the untied input embedding as matmul work.
GPT2_SMALL = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block_size": 1024, "dropout": 0.0, "tie_embeddings": True, "bias": False}
VOCAB_SIZE = 50304  # GPT-2's 50257 padded to a multiple of 64, as nanoGPT trains it
TOKENIZER_FILE = "words-50304.json"
PEAK_BF16_FLOPS = 989e12  # dense bf16, H100/H200 SXM datasheet
CHILD_TIMEOUT_S = 300


# ---------------------------------------------------------------- shared set-up


def build_tokenizer(text: str, path: Path) -> None:
    """A word-level tokenizer.json of VOCAB_SIZE ids: every word and punctuation run of the corpus,
    then unused fillers, so the model has GPT-2's embedding and head sizes."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = sorted(set(re.findall(r"\w+|[^\w\s]+", text)))  # what the Whitespace pre-tokenizer cuts
    vocab = {"[UNK]": 0, **{word: i + 1 for i, word in enumerate(words)}}
    vocab.update({f"[unused{i}]": i for i in range(len(vocab), VOCAB_SIZE)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))


def prepare_data_root(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    corpus = REPO / "data" / "tinyshakespeare.txt"
    shutil.copy(corpus, root / corpus.name)
    build_tokenizer(corpus.read_text(encoding="utf-8"), root / TOKENIZER_FILE)


def base_spec(steps: int, batch: int) -> dict:
    """GPT-2 small in bf16 with the GPU defaults (compile and fused AdamW left to the engine)."""
    spec = json.loads((REPO / "examples" / "shakespeare-char.json").read_text())
    spec["model"].update(GPT2_SMALL)
    spec["dataset"]["tokenizer_file"] = TOKENIZER_FILE
    spec["training"].update(max_steps=steps, micro_batch_size=batch, precision="bf16", eval_every=steps, eval_batches=1)
    spec["training"].pop("compile")
    spec["resources"]["device"] = "cuda"
    spec["checkpoint"] = {"every_steps": None, "keep_last": 1}
    spec["schedule"]["warmup_steps"] = 10
    return spec


def flops_per_token(spec: dict) -> float:
    """nanoGPT's estimate_mfu: 6·N + 12·L·C·T, N the parameters without the position embedding."""
    import torch

    from api_schemas import JobSpec
    from workers.training.model import GPT

    config = JobSpec.model_validate(spec).model
    with torch.device("meta"):
        model = GPT(config, VOCAB_SIZE)
    n = sum(p.numel() for p in model.parameters()) - model.wpe.weight.numel()
    return 6 * n + 12 * config.n_layer * config.n_embd * config.block_size


class Suite:
    def __init__(self, scratch: Path, args: argparse.Namespace):
        self.scratch, self.args = scratch, args
        self.data_root = scratch / "data"
        prepare_data_root(self.data_root)
        # One compile cache for the runs on the host; the entry point's first run finds it empty.
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"),
            "TRITON_CACHE_DIR": str(scratch / "inductor" / "triton"),
        }
        self.results: list[dict] = []
        self.entry_cold_start_s: float | None = None
        self.entry_tokens_per_s: float | None = None
        self.flops_per_token = flops_per_token(base_spec(args.steps, args.batch))

    def report(self, result: dict) -> None:
        line = json.dumps(result)
        print(line, flush=True)
        if self.args.out:
            with open(self.args.out, "a") as out:
                out.write(line + "\n")
        self.results.append(result)

    def mfu(self, tokens_per_s: float) -> float:
        return round(tokens_per_s * self.flops_per_token / PEAK_BF16_FLOPS, 3)

    # ------------------------------------------------------------ runners

    def run_entry(self, name: str, spec: dict, resume_from: Path | None = None, stager_fix: bool = False, env: dict | None = None) -> dict:
        """The training entry point as a worker launches it; its events, and launch → first step.
        `stager_fix`: in one interpreter (no launcher) with STAGER_FIX applied first. `env`: added to
        the worker's environment (a built-in job inherits the worker's)."""
        run_dir = self.scratch / name
        run_dir.mkdir(parents=True)
        (run_dir / "spec.json").write_text(json.dumps(spec))
        events = run_dir / "events.jsonl"
        launcher = [sys.executable, "-c", STAGER_FIX] if stager_fix else [
            sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
            "--mixed_precision", spec["training"]["precision"], "--dynamo_backend", "no", "-m", "workers.training",
        ]
        command = [*launcher, "--spec", str(run_dir / "spec.json"), "--data-root", str(self.data_root), "--run-dir", str(run_dir)]
        if resume_from is not None:
            command += ["--resume-from", str(resume_from)]
        started = time.perf_counter()
        with open(run_dir / "log.txt", "w") as log:
            process = subprocess.Popen(command, cwd=REPO, env={**self.env, **(env or {}), "TRAINYARD_EVENTS_FILE": str(events)}, stdout=log, stderr=subprocess.STDOUT)
            first_step = first_step_seen(events, started, process)
            code = process.wait(CHILD_TIMEOUT_S)
        if code != 0:
            raise RuntimeError(f"{name}: exit {code}: {(run_dir / 'log.txt').read_text()[-3000:]}")
        lines = [json.loads(line) for line in events.read_text().splitlines()]
        return {
            "metrics": {e["step"]: e["values"] for e in lines if e["type"] == "metrics"},
            "checkpoints": {e["step"]: Path(e["path"]) for e in lines if e["type"] == "checkpoint"},
            "launch_to_first_step_s": first_step,
            "run_dir": run_dir,
        }

    def run_plain_loop(self, spec: dict, name: str, *extra: str) -> dict:
        spec_file = self.scratch / f"{name}.json"
        spec_file.write_text(json.dumps(spec))
        command = [
            sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
            "--mixed_precision", spec["training"]["precision"], "--dynamo_backend", "no",
            str(REPO / "bench" / "plain_accelerate_loop.py"), "--spec", str(spec_file),
            "--data", str(self.data_root / "tinyshakespeare.txt"), "--skip", str(self.args.skip), *extra,
        ]
        return json.loads(run_child(command, self.env).strip().splitlines()[-1])

    def run_nanogpt_peer(self, spec: dict, skip: int | None = None) -> dict:
        spec_file = self.scratch / "nanogpt.json"
        spec_file.write_text(json.dumps(spec))
        skip = self.args.skip if skip is None else skip
        command = [sys.executable, __file__, "--nanogpt-peer", str(spec_file), "--data-root", str(self.data_root), "--skip", str(skip)]
        return json.loads(run_child(command, self.env).strip().splitlines()[-1])


def run_child(command: list[str], env: dict) -> str:
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:6])}…: exit {done.returncode}: {done.stderr[-3000:]}")
    return done.stdout


def first_step_seen(events: Path, since: float, process: subprocess.Popen | None = None, timeout: float = CHILD_TIMEOUT_S) -> float:
    """Seconds from `since` until `events` holds a metrics line (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if '"type": "metrics"' in events.read_text():
                return time.perf_counter() - since
        except FileNotFoundError:
            pass
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the training exited ({process.returncode}) before its first step")
        time.sleep(0.01)
    raise RuntimeError(f"no step in {events} within {timeout:.0f} s")


def nvidia_smi_list() -> str:
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout.strip()
    except FileNotFoundError:
        return "no nvidia-smi"


def tokens_per_s(metrics: dict[int, dict], skip: int, tokens_per_step: int) -> float:
    """From the loop's own step_time_s (wall time between optimizer steps), steps after `skip`."""
    steps = [step for step in metrics if step > skip]
    return len(steps) * tokens_per_step / sum(metrics[step]["step_time_s"] for step in steps)


# ---------------------------------------------------------------- checks


def check_throughput(suite: Suite) -> dict:
    args = suite.args
    spec = base_spec(args.steps, args.batch)
    tokens_per_step = args.batch * GPT2_SMALL["block_size"]
    yard = suite.run_entry("throughput", spec)  # first: the compile cache is empty (a cold start)
    yard_tps = tokens_per_s(yard["metrics"], args.skip, tokens_per_step)
    suite.entry_cold_start_s, suite.entry_tokens_per_s = yard["launch_to_first_step_s"], yard_tps
    same = suite.run_plain_loop(spec, "plain-gpu-defaults", "--gpu-defaults")
    eager = suite.run_plain_loop(spec, "plain-eager")
    nanogpt = suite.run_nanogpt_peer(spec)
    yard_peak = max(m["peak_memory_mb"] for m in yard["metrics"].values())
    return {
        "check": "throughput",
        "model": "GPT-2 small 12x768, block 1024, vocab 50304", "batch": args.batch, "steps": args.steps, "skip": args.skip,
        "flops_per_token": suite.flops_per_token, "peak_flops": PEAK_BF16_FLOPS,
        "trainyard": {"tokens_per_s": round(yard_tps), "mfu": suite.mfu(yard_tps), "peak_memory_mb": round(yard_peak),
                      "launch_to_first_step_s": round(yard["launch_to_first_step_s"], 2),
                      "final_train_loss": round(yard["metrics"][max(yard["metrics"])]["train_loss"], 4)},
        "peer_plain_loop_same_settings": summary(suite, same),
        "peer_plain_loop_eager": summary(suite, eager),
        "peer_nanogpt_style": summary(suite, nanogpt),
        "ratio_vs_plain_same_settings": round(yard_tps / same["tokens_per_s"], 3),
        "ratio_vs_nanogpt_style": round(yard_tps / nanogpt["tokens_per_s"], 3),
        "ratio_vs_plain_eager": round(yard_tps / eager["tokens_per_s"], 3),
        "targets": {"mfu": 0.45, "ratio_vs_plain": 1.0},
    }


def summary(suite: Suite, peer: dict) -> dict:
    peak = peer.get("peak_memory_mb")
    return {"tokens_per_s": round(peer["tokens_per_s"]), "mfu": suite.mfu(peer["tokens_per_s"]), "peak_memory_mb": round(peak) if peak else None}


def check_profile(suite: Suite) -> dict:
    spec_file = suite.scratch / "profile.json"
    spec_file.write_text(json.dumps(base_spec(suite.args.skip + 12, suite.args.batch)))
    table = Path(suite.args.profile_table) if suite.args.profile_table else suite.scratch / "profile.txt"
    command = [sys.executable, __file__, "--profile-worker", str(spec_file), "--data-root", str(suite.data_root),
               "--skip", str(suite.args.skip), "--profile-table", str(table)]
    result = json.loads(run_child(command, suite.env).strip().splitlines()[-1])
    return {"check": "profile", **result, "table": str(table)}


def check_checkpoint(suite: Suite) -> dict:
    from bench.checkpoint_stall import stall

    args = suite.args
    every, steps, window = args.checkpoint_every, 4 * args.checkpoint_every + 20, 3
    spec = base_spec(steps, args.batch)
    spec["checkpoint"] = {"every_steps": every, "keep_last": 2}
    yard = suite.run_entry("checkpoint", spec)
    yard_times = {step: values["step_time_s"] for step, values in yard["metrics"].items()}
    peer_dir = suite.scratch / "checkpoint-peer"
    peer = suite.run_plain_loop(spec, "checkpoint-peer", "--gpu-defaults", "--checkpoint-every", str(every), "--checkpoint-dir", str(peer_dir))
    shutil.rmtree(peer_dir, ignore_errors=True)
    peer_times = {int(step): t for step, t in peer["step_times"].items()}
    yard_stall, yard_lost = stall(yard_times, every, args.skip, window)
    peer_stall, peer_lost = stall(peer_times, every, args.skip, window)
    state_mb = sum(f.stat().st_size for f in (max(yard["checkpoints"].values()) / "state").rglob("*") if f.is_file()) / 2**20
    return {
        "check": "checkpoint_stall", "model": "GPT-2 small, bf16, GPU defaults", "every": every, "steps": steps, "state_mb": round(state_mb),
        "trainyard_stall_s": round(yard_stall, 4), "peer_save_state_stall_s": round(peer_stall, 4),
        "ratio": round(yard_stall / peer_stall, 3),
        f"trainyard_lost_s_over_{window}_steps": round(yard_lost, 4), f"peer_lost_s_over_{window}_steps": round(peer_lost, 4),
        "median_step_s": round(statistics.median(yard_times[s] for s in yard_times if s > args.skip), 4),
        "target_ratio": 0.1,
    }


def check_fsdp(suite: Suite) -> dict:
    steps, middle = 40, 20
    spec = base_spec(steps, suite.args.batch)
    spec["training"].update(strategy="fsdp", precision="no", fsdp={"param_dtype": "bfloat16", "reduce_dtype": "float32"})
    spec["checkpoint"] = {"every_steps": middle, "keep_last": 2}
    straight = suite.run_entry("fsdp", spec, stager_fix=True)
    resumed = suite.run_entry("fsdp-resumed", spec, resume_from=straight["checkpoints"][middle], stager_fix=True)
    ddp_spec = base_spec(steps, suite.args.batch)
    ddp_spec["training"]["compile"] = False  # fsdp's default is eager too
    ddp = suite.run_entry("ddp-eager", ddp_spec)

    def differences(a: dict, b: dict) -> dict:
        after = range(middle + 1, steps + 1)
        return {
            "train_loss_max_abs_diff": max(abs(a[s]["train_loss"] - b[s]["train_loss"]) for s in after),
            "eval_loss_abs_diff": abs(a[steps]["eval_loss"] - b[steps]["eval_loss"]),
        }

    result = {
        "check": "fsdp_one_gpu", "steps": steps, "resumed_from": middle,
        "resumed_vs_straight": differences(straight["metrics"], resumed["metrics"]),
        "fsdp_peak_memory_mb": round(max(m["peak_memory_mb"] for m in straight["metrics"].values())),
        "ddp_peak_memory_mb": round(max(m["peak_memory_mb"] for m in ddp["metrics"].values())),
        "fsdp_final_train_loss": round(straight["metrics"][steps]["train_loss"], 4),
        "ddp_final_train_loss": round(ddp["metrics"][steps]["train_loss"], 4),
        "fsdp_tokens_per_s": round(tokens_per_s(straight["metrics"], 5, suite.args.batch * 1024)),
        "ddp_tokens_per_s": round(tokens_per_s(ddp["metrics"], 5, suite.args.batch * 1024)),
    }
    result["peak_memory_fraction"] = round(result["fsdp_peak_memory_mb"] / result["ddp_peak_memory_mb"], 3)
    resumed_diff = result["resumed_vs_straight"]
    result["resumes_exactly"] = not any(resumed_diff.values())
    if not result["resumes_exactly"]:
        # Not bit for bit: is that the resume, or the GPU's own run-to-run noise (atomics in backward)?
        again = suite.run_entry("fsdp-again", spec, stager_fix=True)
        noise = result["straight_vs_straight_again"] = differences(straight["metrics"], again["metrics"])
        result["within_run_to_run_noise"] = all(resumed_diff[key] <= noise[key] for key in resumed_diff)
    return result


def check_sandbox(suite: Suite) -> dict:
    from workers.sandbox import AttemptView, prepare_attempt, sandbox_command

    probe = "import torch; print(torch.cuda.device_count())"
    result = {"check": "sandbox_gpu_isolation"}
    for label, gpus in (("given_gpu_0", (0,)), ("given_none", ())):
        run_dir = suite.scratch / f"sandbox-{label}"
        run_dir.mkdir()
        prepare_attempt(run_dir, [])
        view = AttemptView(run_dir, (), (), host_network=False, gpus=gpus)
        torch_out = subprocess.run(sandbox_command([sys.executable, "-c", probe], run_dir, view), env=suite.env, capture_output=True, text=True, timeout=120)
        smi = subprocess.run(sandbox_command(["nvidia-smi", "-L"], run_dir, view), env=suite.env, capture_output=True, text=True, timeout=60)
        result[label] = {
            "torch_device_count": torch_out.stdout.strip() or torch_out.stderr.strip()[-300:],
            "nvidia_smi_exit": smi.returncode,
            "nvidia_smi": (smi.stdout.strip() or smi.stderr.strip())[-300:],
            "dev_nodes": subprocess.run(sandbox_command(["sh", "-c", "ls /dev | grep nvidia || true"], run_dir, view),
                                        env=suite.env, capture_output=True, text=True, timeout=60).stdout.split(),
        }
    result["host_nvidia_smi"] = nvidia_smi_list()
    result["isolated"] = result["given_gpu_0"]["torch_device_count"] == "1" and result["given_none"]["torch_device_count"] == "0"
    return result


def check_service(suite: Suite) -> dict:
    import httpx

    from stack.embedded import embedded_stack
    from common.settings import Settings
    from workers.launch import EVENTS_FILE_NAME, attempt_dir
    from workers.supervisor import free_port

    args = suite.args
    spec = base_spec(args.steps, args.batch)
    data_dir = suite.scratch / "stack"
    settings = Settings(data_dir=data_dir)
    settings.resolved_data_root.mkdir(parents=True, exist_ok=True)
    shutil.copy(suite.data_root / TOKENIZER_FILE, settings.resolved_data_root / TOKENIZER_FILE)
    gpu_names = ["sys/gpu_utilization_percent", "sys/gpu_memory_mb", "sys/gpu_power_w", "sys/cpu_percent"]
    with embedded_stack(data_dir, free_port(), workers=1, devices="cuda:all") as stack:
        client = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.token}"}, timeout=30)
        started = time.perf_counter()
        response = client.post("/v1/jobs", json=spec)
        response.raise_for_status()
        job_id = response.json()["id"]
        first_step = first_step_seen(attempt_dir(settings.resolved_work_root, job_id, 1) / EVENTS_FILE_NAME, started)
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while (job := client.get(f"/v1/jobs/{job_id}").json())["status"] not in ("succeeded", "failed", "cancelled"):
            if time.monotonic() > deadline:
                raise RuntimeError("the service's job did not end in time")
            time.sleep(0.5)
        if job["status"] != "succeeded":
            logs = client.get(f"/v1/jobs/{job_id}/logs").text[-3000:]
            raise RuntimeError(f"the job {job['status']}: {job.get('failure_reason')}\n{logs}")
        series = client.get(f"/v1/jobs/{job_id}/metrics", params={"names": ",".join(["step_time_s", *gpu_names])}).json()["series"]
    step_times = series["step_time_s"]
    metrics = {step: {"step_time_s": t} for step, t in zip(step_times["steps"], step_times["values"])}
    tps = tokens_per_s(metrics, args.skip, args.batch * GPT2_SMALL["block_size"])
    samples = {
        name: {"points": len(values), "max": round(max(values), 1), "median": round(statistics.median(values), 1)}
        for name in gpu_names if (values := series.get(name, {}).get("values"))
    }
    return {
        "check": "service",
        "trainyard_service_tokens_per_s": round(tps), "entry_point_tokens_per_s": round(suite.entry_tokens_per_s) if suite.entry_tokens_per_s else None,
        "ratio": round(tps / suite.entry_tokens_per_s, 3) if suite.entry_tokens_per_s else None, "target_ratio": 0.98,
        "mfu": suite.mfu(tps),
        "submit_to_first_step_s": round(first_step, 2),
        "peer_bare_launch_to_first_step_s": round(suite.entry_cold_start_s, 2) if suite.entry_cold_start_s else None,
        "start_note": "both cold: the attempt's sandbox has a private /tmp, so torch.compile's cache starts empty; the peer ran on an empty cache",
        "system_metrics": samples,
    }


def check_large_batch(suite: Suite) -> dict:
    """Throughput at a larger micro-batch, the entry point against the nanoGPT-style peer."""
    args, batch = suite.args, suite.args.large_batch
    spec = base_spec(args.steps, batch)
    yard = suite.run_entry(f"throughput-batch-{batch}", spec)
    yard_tps = tokens_per_s(yard["metrics"], args.skip, batch * GPT2_SMALL["block_size"])
    nanogpt = suite.run_nanogpt_peer(spec)
    return {
        "check": "throughput_large_batch", "batch": batch, "steps": args.steps,
        "trainyard": {"tokens_per_s": round(yard_tps), "mfu": suite.mfu(yard_tps),
                      "peak_memory_mb": round(max(m["peak_memory_mb"] for m in yard["metrics"].values()))},
        "peer_nanogpt_style": summary(suite, nanogpt),
        "ratio_vs_nanogpt_style": round(yard_tps / nanogpt["tokens_per_s"], 3),
    }


# torch.compile's mode "max-autotune-no-cudagraphs" for every compile of the process, through
# Inductor's configuration read from the environment (the spec has no compile mode).
AUTOTUNE_ENV = {"TORCHINDUCTOR_MAX_AUTOTUNE": "1", "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1"}


def check_variants(suite: Suite) -> dict:
    """Settings a job could use, through the entry point: `--variants` is a comma-separated list of
    MICRO_BATCH[xACCUMULATION][+autotune] (e.g. 32, 32x4, 64x2+autotune), `best+autotune` (the best
    so far, compiled in max-autotune-no-cudagraphs mode) and `peer` (the nanoGPT-style loop with the
    best so far's micro-batch and accumulation). Steps scale so each variant times about as many
    tokens as the throughput check (`--steps` − `--skip` micro-batches of 16), at least 5 skipped.
    Each variant prints its own line; `--budget-s` skips those that would start after it."""
    args, started = suite.args, time.perf_counter()
    rows, best = [], None
    for text in args.variants.split(","):
        if args.budget_s and time.perf_counter() - started > args.budget_s:
            rows.append({"variant": text, "skipped": "over --budget-s"})
            suite.report({"check": "variant", **rows[-1]})
            continue
        autotune = text.endswith("+autotune")
        name = text.removesuffix("+autotune")
        if name in ("best", "peer"):
            if best is None:
                rows.append({"variant": text, "skipped": "no variant measured before it"})
                suite.report({"check": "variant", **rows[-1]})
                continue
            batch, accumulation = best["micro_batch"], best["accumulation"]
        else:
            batch, _, accumulation = name.partition("x")
            batch, accumulation = int(batch), int(accumulation or 1)
        per_step = batch * accumulation
        skip = max(5, round(args.skip * 16 / per_step))
        steps = skip + max(10, round((args.steps - args.skip) * 16 / per_step))
        spec = base_spec(steps, batch)
        spec["training"]["gradient_accumulation_steps"] = accumulation
        tokens_per_step = per_step * GPT2_SMALL["block_size"]
        row = {"variant": text, "micro_batch": batch, "accumulation": accumulation, "steps": steps, "skip": skip,
               "compile_mode": "max-autotune-no-cudagraphs" if autotune else "default"}
        one_started = time.perf_counter()
        try:
            if name == "peer":
                peer = suite.run_nanogpt_peer(spec, skip)
                row.update(runner="nanoGPT-style peer", **summary(suite, peer))
            else:
                yard = suite.run_entry(f"variant-{len(rows)}", spec, env=AUTOTUNE_ENV if autotune else None)
                tps = tokens_per_s(yard["metrics"], skip, tokens_per_step)
                row.update(runner="trainyard", tokens_per_s=round(tps), mfu=suite.mfu(tps),
                           peak_memory_mb=round(max(m["peak_memory_mb"] for m in yard["metrics"].values())),
                           launch_to_first_step_s=round(yard["launch_to_first_step_s"], 1),
                           final_train_loss=round(yard["metrics"][max(yard["metrics"])]["train_loss"], 4))
                if best is None or tps > best["tokens_per_s"]:
                    best = row
        except Exception as exc:
            traceback.print_exc()
            row["error"] = f"{type(exc).__name__}: {exc}"[-2000:]
        row["seconds"] = round(time.perf_counter() - one_started, 1)
        rows.append(row)
        suite.report({"check": "variant", **row})
    return {"check": "variants", "best": best["variant"] if best else None, "best_mfu": best["mfu"] if best else None,
            "variants": rows, "target_mfu": 0.45}


CHECKS = {
    "throughput": check_throughput,
    "profile": check_profile,
    "checkpoint": check_checkpoint,
    "fsdp": check_fsdp,
    "sandbox": check_sandbox,
    "service": check_service,
    "large_batch": check_large_batch,
    "variants": check_variants,
}

# For the fsdp runs on torch 2.11 (pytorch/pytorch#183413): its DefaultStager closes its
# StateDictStager after every stage, which empties the copy table a second save needs (KeyError:
# <class 'type'>); the project pins a torch without that bug. Here close() keeps the table.
STAGER_FIX = """
import runpy, sys
import torch
from torch.distributed.checkpoint import _state_dict_stager
if torch.__version__.startswith("2.11."):
    _state_dict_stager.StateDictStager.close = lambda self: self._cached_storage_mapping.clear()
sys.argv[0] = "workers.training"
runpy.run_module("workers.training", run_name="__main__", alter_sys=True)
"""


# ---------------------------------------------------------------- child processes


def nanogpt_peer(spec_file: Path, data_root: Path, skip: int) -> None:
    """nanoGPT's train.py loop, single GPU: autocast bf16, compiled model, fused AdamW, random
    windows stacked on the host, pinned and copied without blocking, the next batch fetched while
    the GPU runs. Same model class, data and optimizer settings as the job."""
    import math

    import torch

    from api_schemas import JobSpec
    from workers.training.data import load_text_corpus
    from workers.training.model import GPT

    spec = JobSpec.model_validate_json(spec_file.read_text())
    cfg, block, batch = spec.training, spec.model.block_size, spec.training.micro_batch_size
    accumulation = cfg.gradient_accumulation_steps
    torch.manual_seed(cfg.seed)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    corpus = load_text_corpus(spec.dataset, data_root)
    data = corpus.train

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(data) - block, (batch,))
        x = torch.stack([data[i : i + block] for i in starts.tolist()])
        y = torch.stack([data[i + 1 : i + 1 + block] for i in starts.tolist()])
        return x.pin_memory().to("cuda", non_blocking=True), y.pin_memory().to("cuda", non_blocking=True)

    model = GPT(spec.model, corpus.tokenizer.vocab_size).cuda()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": spec.optimizer.weight_decay},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=spec.optimizer.lr, betas=spec.optimizer.betas, fused=True,
    )
    forward = torch.compile(model)
    warmup, lr, min_lr = spec.schedule.warmup_steps, spec.optimizer.lr, spec.schedule.min_lr

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        return min_lr + 0.5 * (1 + math.cos(math.pi * (step - warmup) / (cfg.max_steps - warmup))) * (lr - min_lr)

    x, y = get_batch()
    for step in range(cfg.max_steps):
        if step == skip:
            torch.cuda.synchronize()
            started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        for _ in range(accumulation):  # nanoGPT's gradient accumulation
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = forward(x, y)
                loss = loss / accumulation
            x, y = get_batch()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    print(json.dumps({
        "tokens_per_s": (cfg.max_steps - skip) * accumulation * batch * block / elapsed, "peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20,
        "final_loss": loss.item(),
    }))


def profile_worker(spec_file: Path, data_root: Path, skip: int, table: Path) -> None:
    """The training loop in this process under torch.profiler: steps skip+3 .. skip+8 recorded."""
    import torch
    import torch._dynamo.utils
    from torch.profiler import ProfilerActivity, profile, schedule

    from api_schemas import JobSpec
    from workers.training.loop import train

    spec = JobSpec.model_validate_json(spec_file.read_text())
    active = 6

    class ProfilingReporter:
        takes_checkpoints = False

        def __init__(self, profiler):
            self.profiler, self.step_times = profiler, []

        def metrics(self, step: int, values: dict) -> None:  # once per optimizer step (one step late)
            self.step_times.append(values["step_time_s"])
            self.profiler.step()

        def checkpoint(self, step: int, path: Path) -> None:
            pass

        def close(self) -> None:
            pass

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], schedule=schedule(wait=skip, warmup=2, active=active, repeat=1)) as profiler:
        reporter = ProfilingReporter(profiler)
        with tempfile.TemporaryDirectory() as run_dir:
            train(spec, data_root, Path(run_dir), reporter)
    averages = profiler.key_averages()

    def device_time(event) -> float:  # µs; the attribute was renamed from cuda to device
        return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)

    # Kernels, copies and fills only: the profiler also puts its step annotations on the GPU's timeline.
    kernel_us = sum(
        device_time(e) for e in averages
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.key.startswith("ProfilerStep") and not getattr(e, "is_user_annotation", False)
    )
    step_s = statistics.median(reporter.step_times[skip:skip + 2 + active])
    try:
        by_gpu = averages.table(sort_by="self_device_time_total", row_limit=30)
    except (AttributeError, KeyError, ValueError):  # older torch names it after cuda
        by_gpu = averages.table(sort_by="self_cuda_time_total", row_limit=30)
    table.write_text("== by GPU time ==\n" + by_gpu + "\n== by host time ==\n" + averages.table(sort_by="self_cpu_time_total", row_limit=30))
    counters = torch._dynamo.utils.counters
    print(json.dumps({
        "median_step_s": round(step_s, 4),
        "gpu_kernel_s_per_step": round(kernel_us / 1e6 / active, 4),
        "gpu_busy_share": round(kernel_us / 1e6 / active / step_s, 3),
        "graph_breaks": dict(counters["graph_break"]),
        "unique_graphs": counters["stats"].get("unique_graphs"),
    }))


# ---------------------------------------------------------------- main


def print_table(results: list[dict]) -> None:
    rows = []
    for r in results:
        check = r.get("check")
        if "error" in r:
            rows.append((check, "error", "", "", r["error"].strip().splitlines()[-1][:80]))
        elif check == "throughput":
            t = r["trainyard"]
            rows.append(("tokens/s (MFU, peak MB)", f"{t['tokens_per_s']:,} ({t['mfu']}, {t['peak_memory_mb']:,})",
                         "plain loop same settings {tokens_per_s:,} ({mfu}, {peak_memory_mb:,})".format(**r["peer_plain_loop_same_settings"]),
                         r["ratio_vs_plain_same_settings"], "MFU ≥ 0.45, ≥ 1.0×"))
            rows.append(("", "", "nanoGPT-style {tokens_per_s:,} ({mfu}, {peak_memory_mb:,})".format(**r["peer_nanogpt_style"]), r["ratio_vs_nanogpt_style"], ""))
            rows.append(("", "", "plain loop eager {tokens_per_s:,} ({mfu}, {peak_memory_mb:,})".format(**r["peer_plain_loop_eager"]), r["ratio_vs_plain_eager"], ""))
        elif check == "throughput_large_batch":
            t = r["trainyard"]
            rows.append((f"batch {r['batch']} tokens/s (MFU)", f"{t['tokens_per_s']:,} ({t['mfu']})",
                         "nanoGPT-style {tokens_per_s:,} ({mfu})".format(**r["peer_nanogpt_style"]), r["ratio_vs_nanogpt_style"], ""))
        elif check == "variants":
            for v in r["variants"]:
                shown = v.get("error", v.get("skipped", "")).strip().splitlines()[-1][:80] if "mfu" not in v else \
                    f"{v['tokens_per_s']:,} ({v['mfu']}, {v['peak_memory_mb']:,})"
                rows.append((f"variant {v['variant']}", shown, v.get("runner", ""), "", v.get("compile_mode", "")))
        elif check == "profile":
            rows.append(("profile", f"kernels {r['gpu_kernel_s_per_step']} s of a {r['median_step_s']} s step", "", "",
                         f"graph breaks {sum(r['graph_breaks'].values())}"))
        elif check == "checkpoint_stall":
            rows.append(("checkpoint stall (s)", r["trainyard_stall_s"], f"save_state {r['peer_save_state_stall_s']}", r["ratio"], "≤ 0.1×"))
        elif check == "fsdp_one_gpu":
            resumed = "exactly" if r["resumes_exactly"] else f"within noise: {r.get('within_run_to_run_noise')}"
            rows.append(("FSDP2 peak MB / resumed", f"{r['fsdp_peak_memory_mb']:,} / {resumed}", f"ddp {r['ddp_peak_memory_mb']:,}",
                         r["peak_memory_fraction"], "resumes exactly"))
        elif check == "sandbox_gpu_isolation":
            rows.append(("sandbox GPU view", f"given GPU 0: {r['given_gpu_0']['torch_device_count']}, none: {r['given_none']['torch_device_count']}",
                         "", "", f"isolated {r['isolated']}"))
        elif check == "service":
            rows.append(("service tokens/s", f"{r['trainyard_service_tokens_per_s']:,}", f"entry point {r['entry_point_tokens_per_s']}", r["ratio"], "≥ 0.98×"))
            rows.append(("submit → first step (s)", r["submit_to_first_step_s"], f"bare launch {r['peer_bare_launch_to_first_step_s']}", "", "cold"))
    widths = [max(len(str(row[i])) for row in rows) for i in range(5)] if rows else []
    for row in rows:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(c for c in CHECKS if c != "variants"), help=f"comma-separated, of: {', '.join(CHECKS)}")
    parser.add_argument("--steps", type=int, default=120, help="steps of the throughput runs")
    parser.add_argument("--skip", type=int, default=30, help="warm-up steps (compilation) left out of every timing")
    parser.add_argument("--batch", type=int, default=64,
                        help="micro-batch (sequences of 1024 tokens); 64 reached MFU 0.454 on an H200, 16 0.413 (bench/README.md)")
    parser.add_argument("--large-batch", type=int, default=32, help="micro-batch of the large_batch check (a second one beside --batch)")
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--variants", default="32,32x4,64,peer,best+autotune", help="the variants check's list (see check_variants)")
    parser.add_argument("--budget-s", type=float, help="variants: start none after this many seconds of the check")
    parser.add_argument("--out", help="also append each check's JSON line to this file")
    parser.add_argument("--profile-table", help="where the profile's tables go (default: the scratch directory)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory (runs' logs and events)")
    parser.add_argument("--nanogpt-peer", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--profile-worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--data-root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.nanogpt_peer:
        return nanogpt_peer(args.nanogpt_peer, args.data_root, args.skip)
    if args.profile_worker:
        return profile_worker(args.profile_worker, args.data_root, args.skip, Path(args.profile_table))

    scratch = Path(tempfile.mkdtemp(prefix="gpu-suite-"))
    scratch.chmod(0o755)  # the sandboxed checks' user passes through it
    suite = Suite(scratch, args)
    ceiling = subprocess.run([sys.executable, "-c", MATMUL_CEILING], capture_output=True, text=True, timeout=120)
    suite.report({"check": "machine", "gpu": nvidia_smi_list(),
                  "bf16_matmul_8192_tflops": ceiling.stdout.strip() or ceiling.stderr[-300:], "peak_used_for_mfu_tflops": PEAK_BF16_FLOPS / 1e12,
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())})
    for name in args.only.split(","):
        started = time.perf_counter()
        try:
            result = CHECKS[name](suite)
        except Exception as exc:
            traceback.print_exc()
            result = {"check": name, "error": f"{type(exc).__name__}: {exc}"[-3000:]}
        result["seconds"] = round(time.perf_counter() - started, 1)
        suite.report(result)
    print_table(suite.results)
    if not args.keep:
        shutil.rmtree(scratch, ignore_errors=True)


MATMUL_CEILING = """
import torch
a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
for _ in range(3):
    a @ b
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
for _ in range(20):
    a @ b
end.record()
torch.cuda.synchronize()
print(round(20 * 2 * 8192**3 / (start.elapsed_time(end) / 1e3) / 1e12))
"""


if __name__ == "__main__":
    main()
