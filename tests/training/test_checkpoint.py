"""Checkpoints: complete, verified by their manifest, and enough to recompute the reported eval loss."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from api_schemas.manifest import MANIFEST_FILE, MODEL_FILE, CorruptCheckpoint, checkpoint_name, verify_manifest
from tests.helpers import job_spec
from tests.training.support import Collector, run_training, write_corpus
from workers.training import GPT, CheckpointWriter, eval_dataloader, evaluate, load_model, load_model_from_checkpoint, load_text_corpus
from workers.training.checkpoint import StateSnapshot

STEPS = 6


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """6 steps, a checkpoint and an evaluation every 2, keep_last 2."""
    root = tmp_path_factory.mktemp("checkpoints")
    data_root = root / "data"
    name = write_corpus(data_root)
    spec = job_spec(**{
        "dataset.path": name, "training.max_steps": STEPS, "training.eval_every": 2,
        "checkpoint.every_steps": 2, "checkpoint.keep_last": 2,
    })
    run = run_training(spec, data_root, root / "run")
    return spec, data_root, root / "run", run


def test_checkpoints_are_reported_and_only_the_last_keep_last_remain(trained):
    spec, _, run_dir, run = trained
    assert sorted(run.checkpoints) == [2, 4, 6]
    assert run.checkpoints[6] == run_dir / "checkpoints" / "step-00000006"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000004", "step-00000006"]


def test_the_final_checkpoint_holds_weights_state_spec_tokenizer_and_a_manifest_of_them(trained):
    spec, data_root, _, run = trained
    final = run.checkpoints[STEPS]
    assert {p.name for p in final.iterdir()} == {MODEL_FILE, "state", "trainer_state.json", "spec.json", "tokenizer.json", MANIFEST_FILE}
    assert any((final / "state").iterdir())

    manifest = verify_manifest(final)
    assert manifest["step"] == STEPS
    on_disk = {str(p.relative_to(final)) for p in final.rglob("*") if p.is_file() and p.name != MANIFEST_FILE}
    assert set(manifest["files"]) == on_disk  # every file, state/ included, is listed

    state = json.loads((final / "trainer_state.json").read_text())
    # And the loss guard's window, so a run resumed from it is guarded from its first step.
    assert state == {
        "step": STEPS, "epoch": 0, "batch_in_epoch": STEPS, "processes": 1, "recent_losses": state["recent_losses"],
        "eval_loss": run.steps[STEPS]["eval_loss"],  # the step's own evaluation (checkpoint.keep_best ranks by it)
    }
    assert len(state["recent_losses"]) == min(STEPS, spec.training.guard.window)
    model, tokenizer, saved_spec = load_model_from_checkpoint(final)
    assert saved_spec == spec
    assert not spec.model.tie_embeddings and not torch.equal(model.lm_head.weight, model.wte.weight)
    assert tokenizer.to_json() == load_text_corpus(spec.dataset, data_root).tokenizer.to_json()


def test_a_tied_head_is_saved_once_and_a_checkpoint_from_before_the_option_loads_tied(tmp_path):
    data_root = tmp_path / "data"
    spec = job_spec(**{
        "dataset.path": write_corpus(data_root), "model.tie_embeddings": True, "training.max_steps": 3, "checkpoint.every_steps": 3,
    })
    final = run_training(spec, data_root, tmp_path / "run").checkpoints[3]
    # Saved once (no "Removed shared tensor" warning from Accelerate), loaded back tied.
    for weights in (final / MODEL_FILE, final / "state" / MODEL_FILE):
        assert "wte.weight" in load_file(weights) and "lm_head.weight" not in load_file(weights)
    model, _, _ = load_model_from_checkpoint(final)
    assert model.lm_head.weight is model.wte.weight

    # A checkpoint written before model.tie_embeddings existed (every head was tied) says nothing of it.
    written = json.loads((final / "spec.json").read_text())
    del written["model"]["tie_embeddings"], written["model"]["init"]
    (final / "spec.json").write_text(json.dumps(written))
    model, _, spec_read = load_model_from_checkpoint(final)
    assert spec_read.model.tie_embeddings and model.lm_head.weight is model.wte.weight


def test_keep_best_saves_each_evaluation_that_beats_the_best_and_keeps_it_past_keep_last_also_after_a_resume(tmp_path):
    """A model that overfits 1,100 characters (its eval_loss bottoms out, then climbs): nanoGPT's
    always_save_checkpoint = False. The best is kept beside the last; a run resumed from the best
    remembers it, so the worse evaluations after it save nothing."""
    data_root = tmp_path / "data"
    spec = job_spec(**{
        "dataset.path": write_corpus(data_root, 1200), "model.n_layer": 2, "model.n_embd": 64, "training.micro_batch_size": 16,
        "training.max_steps": 240, "training.eval_every": 20, "training.eval_batches": None, "optimizer.lr": 1e-2,
        "schedule.warmup_steps": 2, "checkpoint.every_steps": None, "checkpoint.keep_last": 1, "checkpoint.keep_best": True,
    })
    run = run_training(spec, data_root, tmp_path / "run")

    losses = {step: values["eval_loss"] for step, values in run.metrics_log if "eval_loss" in values}
    improving, lowest = [], float("inf")
    for step, loss in sorted(losses.items()):
        if loss < lowest:
            improving, lowest = [*improving, step], loss
    best = improving[-1]
    assert best < 200 and losses[240] > losses[best] + 0.2  # it did overfit: the last checkpoint is much worse
    assert sorted(run.checkpoints) == sorted({*improving, 240})
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [checkpoint_name(best), checkpoint_name(240)]
    state = json.loads((run.checkpoints[best] / "trainer_state.json").read_text())
    assert state["eval_loss"] == state["best_value"] == losses[best]

    resumed = run_training(spec, data_root, tmp_path / "resumed", resume_from=run.checkpoints[best])
    assert sorted(resumed.checkpoints) == [240]
    assert json.loads((resumed.checkpoints[240] / "trainer_state.json").read_text())["best_value"] == losses[best]


@pytest.mark.parametrize("victim", [MODEL_FILE, "state", "trainer_state.json", "spec.json", "tokenizer.json"])
def test_one_flipped_byte_anywhere_fails_verification(trained, tmp_path, victim):
    copy = tmp_path / "checkpoint"
    shutil.copytree(trained[3].checkpoints[STEPS], copy)
    verify_manifest(copy)
    path = copy / victim
    if path.is_dir():
        path = max((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint):
        verify_manifest(copy)


@pytest.mark.parametrize("step", [4, STEPS])
def test_weights_loaded_into_a_fresh_model_reproduce_the_reported_eval_loss(trained, step):
    spec, data_root, _, run = trained
    weights_file = run.checkpoints[step] / MODEL_FILE
    corpus = load_text_corpus(spec.dataset, data_root)

    tensors = load_file(str(weights_file))
    assert not [name for name in tensors if "_orig_mod." in name or name.startswith("module.")]
    assert set(tensors) == set(GPT(spec.model, corpus.tokenizer.vocab_size).state_dict())

    model = load_model(spec, corpus.tokenizer.vocab_size, weights_file)  # strict load_state_dict
    # The last evaluation reads the whole validation split, the others a sample spread over it.
    recomputed = evaluate(model, eval_dataloader(corpus.val, spec, whole=step == STEPS))
    assert recomputed == pytest.approx(run.steps[step]["eval_loss"], abs=1e-4)  # measured: equal
    assert all(t.dtype == torch.float32 for t in tensors.values())


def tiny_training(tmp_path):
    """(spec, corpus, accelerator, model, train_one_step) of a 2-layer GPT prepared on the CPU."""
    data_root = tmp_path / "data"
    spec = job_spec(**{"dataset.path": write_corpus(data_root, 50_000), "model.n_layer": 2, "model.n_embd": 64})
    corpus = load_text_corpus(spec.dataset, data_root)
    accelerator = Accelerator(cpu=True)
    model = GPT(spec.model, corpus.tokenizer.vocab_size)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    windows = corpus.train[: 4 * 16 + 1]
    inputs, targets = windows[:-1].view(4, 16), windows[1:].view(4, 16)

    def train_one_step() -> None:
        _, loss = model(inputs, targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return spec, corpus, accelerator, model, train_one_step


def test_a_checkpoint_finished_in_the_background_is_the_state_of_its_step_byte_for_byte(tmp_path, monkeypatch):
    """save() returns once the step's state is taken; training then changes the weights and the
    optimizer's moments in place while the main process writes and hashes in the background. What
    lands is what a save waited for at once writes: every file, state/ included, the same bytes.
    The weights and moments are copied by the writer thread, slowed down here: the next optimizer
    step must wait for that copy, or the checkpoint would hold the step after its own."""
    copy_later = StateSnapshot.copy_later

    def slow_copy(pending):
        time.sleep(0.5)
        copy_later(pending)

    monkeypatch.setattr(StateSnapshot, "copy_later", staticmethod(slow_copy))
    spec, corpus, accelerator, model, train_one_step = tiny_training(tmp_path)
    train_one_step()
    accelerator.save_state(str(tmp_path / "plain"))  # what Accelerate itself writes at this step
    waited_for = Collector()
    synchronous = CheckpointWriter(accelerator, tmp_path / "waited-for", spec, waited_for, corpus.tokenizer)
    synchronous.save(model, {"step": 1})
    synchronous.finish()

    reported = Collector()
    writer = CheckpointWriter(accelerator, tmp_path / "background", spec, reported, corpus.tokenizer)
    path = writer.save(model, {"step": 1})
    assert reported.checkpoints == {}  # reported only once complete, and by the training thread
    saved = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    train_one_step()  # while the background thread writes
    assert any(not torch.equal(saved[name], tensor) for name, tensor in model.state_dict().items())
    writer.finish()

    assert reported.checkpoints == {1: path} and path.name == "step-00000001" and not list(path.parent.glob(".tmp-*"))
    assert verify_manifest(path) == verify_manifest(waited_for.checkpoints[1])  # size and sha256 of every file
    assert (path / MODEL_FILE).read_bytes() == (waited_for.checkpoints[1] / MODEL_FILE).read_bytes()
    assert all(torch.equal(tensor, saved[name]) for name, tensor in load_file(str(path / MODEL_FILE)).items())
    # state/ is written from a snapshot of the step, not by save_state: the same files, the same bytes.
    plain = sorted((tmp_path / "plain").iterdir())
    assert [file.name for file in plain] == sorted(file.name for file in (path / "state").iterdir())
    assert all((path / "state" / file.name).read_bytes() == file.read_bytes() for file in plain)


def test_a_setup_with_a_save_hook_is_saved_by_save_state_itself(tmp_path):
    # A snapshot would skip the hook (FSDP and DeepSpeed save their own way too): save_state runs.
    spec, corpus, accelerator, model, train_one_step = tiny_training(tmp_path)
    train_one_step()
    hooked = []
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: hooked.append(output_dir))
    reported = Collector()
    writer = CheckpointWriter(accelerator, tmp_path / "run", spec, reported, corpus.tokenizer)
    path = writer.save(model, {"step": 1})
    train_one_step()
    writer.finish()
    assert len(hooked) == 1 and reported.checkpoints == {1: path}
    assert {"model.safetensors", "optimizer.bin", "random_states_0.pkl"} <= {file.name for file in (path / "state").iterdir()}
    verify_manifest(path)
