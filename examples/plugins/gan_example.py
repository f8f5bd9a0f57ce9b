"""A GAN as a Trainyard `custom` job: two models, two optimizers, one loop the built-in trainer can't express.

The generator learns to map 2-D noise onto a ring of Gaussians (8 blobs on a circle); the
discriminator learns to tell its points from real ones. Install this file in the workers' plugin
directory (TRAINYARD_PLUGIN_DIR, default .trainyard/plugins) and submit examples/gan.json:

    {"model": {"kind": "custom", "entrypoint": "gan_example:train", "config": {"hidden": 64}}, ...}

`training.max_steps`, `micro_batch_size`, `seed`, `optimizer.lr` and `checkpoint.every_steps` of the
spec mean what they say; `model.config` takes `latent_dim`, `hidden`, `modes`, `radius`, `std`.
Each step's data comes from a generator seeded with (seed, step), so a resumed job sees the same
samples as one run straight through; after a loss-guard rollback the samples of `ctx.skip_steps`
steps are passed over (an offset, kept in every checkpoint after it).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def build_models(config: dict) -> tuple[nn.Module, nn.Module]:
    """(generator, discriminator) for `config`; also how a checkpoint's weights are loaded back."""
    latent, hidden = config.get("latent_dim", 2), config.get("hidden", 64)
    generator = nn.Sequential(nn.Linear(latent, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 2))
    discriminator = nn.Sequential(nn.Linear(2, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, 1))
    return generator, discriminator


def ring_of_gaussians(count: int, config: dict, rng: torch.Generator) -> torch.Tensor:
    """`count` points from `modes` Gaussians of std `std` evenly spaced on a circle of `radius`."""
    modes, radius, std = config.get("modes", 8), config.get("radius", 2.0), config.get("std", 0.05)
    angles = torch.randint(modes, (count,), generator=rng) * (2 * math.pi / modes)
    centres = radius * torch.stack([angles.cos(), angles.sin()], dim=1)
    return centres + std * torch.randn(count, 2, generator=rng)


def train(ctx) -> None:
    spec, config, accelerator = ctx.spec, ctx.config, ctx.accelerator
    batch, latent = spec.training.micro_batch_size, config.get("latent_dim", 2)
    generator, discriminator = build_models(config)
    # Adam with beta1 0.5, as GANs usually are (DCGAN).
    g_optimizer = torch.optim.Adam(generator.parameters(), lr=spec.optimizer.lr, betas=(0.5, 0.999))
    d_optimizer = torch.optim.Adam(discriminator.parameters(), lr=spec.optimizer.lr, betas=(0.5, 0.999))
    generator, discriminator, g_optimizer, d_optimizer = accelerator.prepare(generator, discriminator, g_optimizer, d_optimizer)
    ctx.register_model("generator", generator)
    ctx.register_model("discriminator", discriminator)

    resumed = ctx.load_checkpoint()
    step = resumed["step"] if resumed else 0
    # Which step's samples a step trains on: its own, past those a rollback skipped (they spiked the loss).
    skipped = (resumed or {}).get("skipped_steps", 0) + ctx.skip_steps
    while step < spec.training.max_steps:
        sample = step + skipped
        rng = torch.Generator().manual_seed(spec.training.seed * 1_000_003 + sample * accelerator.num_processes + accelerator.process_index)
        real = ring_of_gaussians(batch, config, rng).to(accelerator.device)
        noise = torch.randn(batch, latent, generator=rng).to(accelerator.device)
        ones, zeros = torch.ones(batch, 1, device=accelerator.device), torch.zeros(batch, 1, device=accelerator.device)

        # Discriminator: real points are 1, generated ones 0 (the generator is not updated here).
        fake = generator(noise)
        d_loss = F.binary_cross_entropy_with_logits(discriminator(real), ones) + F.binary_cross_entropy_with_logits(
            discriminator(fake.detach()), zeros
        )
        d_optimizer.zero_grad(set_to_none=True)
        accelerator.backward(d_loss)
        d_optimizer.step()

        # Generator: make the discriminator call its points real (its gradients reach D too, and are dropped).
        g_loss = F.binary_cross_entropy_with_logits(discriminator(fake), ones)
        g_optimizer.zero_grad(set_to_none=True)
        accelerator.backward(g_loss)
        g_optimizer.step()
        d_optimizer.zero_grad(set_to_none=True)

        step += 1
        d_loss, g_loss = accelerator.reduce(torch.stack([d_loss.detach(), g_loss.detach()]), reduction="mean").tolist()
        ctx.log_metric(step, {"d_loss": d_loss, "g_loss": g_loss})
        stop = ctx.should_stop()
        if ctx.checkpoint_due(step) or stop:
            ctx.save_checkpoint(step, {"skipped_steps": skipped})
        if stop:
            return


@torch.no_grad()
def mean_distance_to_ring(generator: nn.Module, config: dict, count: int = 512, seed: int = 0) -> float:
    """How far generated points lie from the ring, on average: a quality measure for tests and curious users."""
    rng = torch.Generator().manual_seed(seed)
    points = generator(torch.randn(count, config.get("latent_dim", 2), generator=rng))
    return (points.norm(dim=1) - config.get("radius", 2.0)).abs().mean().item()
