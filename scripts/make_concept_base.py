"""Build the learning proof's tiny Flux base model (examples/concept-tiny/model) and its LoRA dataset.

Unlike the other tiny examples (random init, they render textures), this base model really generates: from a seed,
deterministically, on one CPU core in a few minutes,

1. the text encoders (CLIP, T5) and tokenizers are the family's tiny random-init ones, frozen: random encoders
   still give every caption its own embedding, which is all a denoiser needs to tell captions apart;
2. the VAE (a Flux-shaped AutoencoderKL, 2x downsampling, 4 latent channels) is trained as an autoencoder on
   shapes in random colours, so decoded latents are pictures; its shift and scaling factors are measured on the
   pretraining set, as Flux's are;
3. the transformer (FluxTransformer2DModel, 2 double + 2 single blocks, no guidance embedding) is pretrained from
   random init by full fine-tuning with a plain flow-matching loop (this script is a fixture generator, not a
   trainer: the pipeline trains LoRAs) on 4 colours x 3 shapes x 3 backgrounds, captioned, until its samples
   show the named colour (checked at the end: the script fails otherwise).

The LoRA dataset (examples/concept-tiny/data) shows a colour the base never saw, captioned "purple ...", plus one
image per base caption as prior preservation (regularisation images).
tests/test_concept_proof.py trains a LoRA on it through the pipeline and measures that colour in the samples.

Other families (`--family sdxl`): the family's own tiny random-init model (`build_tiny`, tokenizers trained on a
corpus that holds every caption word), its VAE replaced by the same kind of trained 2x AutoencoderKL, and its
denoiser pretrained by full fine-tuning through the adapter contract: the train stage's objective
(`noise_latents`), inputs (`conditioned_inputs`), layers (`pipeline_layers`) and loss. Their examples share
examples/concept-tiny/{data,pretrain}; only the model is theirs.

    python scripts/make_concept_base.py            # rewrites examples/concept-tiny/{model,data,pretrain}
    python scripts/make_concept_base.py --data-only   # the datasets only (the same bytes a full run writes)
    python scripts/make_concept_base.py --family sdxl --out examples/concept-sdxl-tiny   # model only
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from diffusion_pipe.concept_proof import (  # noqa: E402
    BACKGROUNDS, BASE_COLOURS, CONCEPT_WORD, SHAPES, autoencoder_images, base_items, caption, colour_fraction, lora_items,
    write_dataset,
)
from diffusion_pipe.models import adapter_class  # noqa: E402
from diffusion_pipe.models.base import Adapter  # noqa: E402
from diffusion_pipe.models.common import save_tiny_tokenizers  # noqa: E402
from diffusion_pipe.models.flux import MODEL_INDEX, FluxAdapter, image_ids, pack_latents  # noqa: E402

TEXT_MAX_LENGTH = 32  # encode.text_max_length of the example's params: the same embeddings the pipeline makes


def to_tensor(images: list) -> torch.Tensor:
    """PIL images -> (N, 3, H, W) in [-1, 1], as the encode stage feeds the VAE."""
    return torch.from_numpy(np.stack([np.asarray(i, dtype=np.float32) for i in images])).permute(0, 3, 1, 2) / 127.5 - 1


def build_text_encoders(out: Path, seed: int) -> None:
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    # trained on every caption word (the concept's too: a real tokenizer knows the word; the model does not)
    corpus = [caption(c, s, b) for c in (*BASE_COLOURS, CONCEPT_WORD) for s in SHAPES for b in BACKGROUNDS]
    clip_tok, t5_tok = save_tiny_tokenizers(out, corpus, vocab_sizes=(320, 200))
    torch.manual_seed(seed)
    CLIPTextModel(CLIPTextConfig(
        vocab_size=len(clip_tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=77, projection_dim=32, bos_token_id=clip_tok.bos_token_id,
        eos_token_id=clip_tok.eos_token_id, pad_token_id=clip_tok.pad_token_id,
    )).save_pretrained(out / "text_encoder")
    T5EncoderModel(T5Config(
        vocab_size=len(t5_tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=t5_tok.pad_token_id, eos_token_id=t5_tok.eos_token_id,
        decoder_start_token_id=t5_tok.pad_token_id,
    )).save_pretrained(out / "text_encoder_2")


def small_vae(like: dict | None) -> torch.nn.Module:
    """A VAE of the class of `like` (a tiny model's VAE config; None: Flux's AutoencoderKL with a shift factor)
    that downsamples 2x, keeping its latent channels: 32-pixel shapes become 16x16 latents."""
    from diffusers import AutoencoderKL, AutoencoderKLWan

    like = like or {"_class_name": "AutoencoderKL", "latent_channels": 4, "shift_factor": 0.0}
    if like["_class_name"] == "AutoencoderKLWan":  # one frame per image: no temporal downsampling
        return AutoencoderKLWan(base_dim=8, z_dim=like["z_dim"], dim_mult=[1, 2], num_res_blocks=1,
                                temperal_downsample=[False], scale_factor_spatial=2, scale_factor_temporal=1)
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=like["latent_channels"], block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1, norm_num_groups=4, sample_size=32, scaling_factor=1.0,
        shift_factor=0.0 if like.get("shift_factor") is not None else None,  # Flux's pipelines subtract one
        use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False,
    )


def set_latent_normalisation(vae: torch.nn.Module, latents: torch.Tensor) -> None:
    """What the family's pipeline undoes before decoding, measured on the pretraining set's latents: per-channel
    mean and std (Wan), or one scaling factor and, where the config has one, a shift factor (Flux)."""
    if vae.config.get("latents_mean") is not None:  # AutoencoderKL has the key too, set to None
        dims = [d for d in range(latents.dim()) if d != 1]
        vae.register_to_config(latents_mean=[round(x, 4) for x in latents.mean(dims).tolist()],
                               latents_std=[round(x, 4) for x in latents.std(dims).tolist()])
        return
    if vae.config.get("shift_factor") is not None:
        vae.register_to_config(shift_factor=round(latents.mean().item(), 4))
    vae.register_to_config(scaling_factor=round(1 / latents.std().item(), 4))


def train_vae(out: Path, pretrain_pixels: torch.Tensor, seed: int, steps: int, like: dict | None = None) -> None:
    """A small VAE (`small_vae`) trained to reconstruct random-colour shapes (MSE + a small KL term that keeps
    latents near unit scale), then its latent normalisation set from the pretraining set's latents."""
    torch.manual_seed(seed)
    vae = small_vae(like)
    video = type(vae).__name__ == "AutoencoderKLWan"  # it takes (B, C, F, H, W)
    if video:
        pretrain_pixels = pretrain_pixels[:, :, None]
    shapes = to_tensor(autoencoder_images(2048, seed))
    pixels = torch.cat([shapes[:, :, None] if video else shapes, pretrain_pixels])
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=max(0.1, 2 / steps))
    gen = torch.Generator().manual_seed(seed)
    start = time.time()
    for step in range(steps):
        x = pixels[torch.randint(len(pixels), (16,), generator=gen)]
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=gen)
        recon = vae.decode(z).sample
        mse = torch.nn.functional.mse_loss(recon, x)
        kl = posterior.kl().mean() / posterior.mean[0].numel()
        loss = mse + 1e-3 * kl
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 200 == 0 or step == steps - 1:
            print(f"vae step {step}: mse {mse.item():.4f} kl/elem {kl.item():.3f} ({time.time() - start:.0f} s)")
    vae.eval()
    with torch.no_grad():
        latents = vae.encode(pretrain_pixels).latent_dist.mode()
        recon = vae.decode(latents).sample.clamp(-1, 1)
    error = ((recon - pretrain_pixels).abs().mean() * 127.5).item()
    print(f"vae: pretraining set reconstructed to {error:.2f}/255 mean absolute error")
    set_latent_normalisation(vae, latents)
    shutil.rmtree(out / "vae", ignore_errors=True)
    vae.save_pretrained(out / "vae")


def encode_texts(adapter: Adapter, captions: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    encoders = adapter.load_text_encoders(torch.device("cpu"))
    entries = adapter.encode_text(encoders, captions, TEXT_MAX_LENGTH)
    return dict(zip(captions, entries))


def pretrain_transformer(out: Path, adapter: FluxAdapter, images: list, captions: list[str], seed: int,
                         steps: int) -> None:
    """Full fine-tuning of a random-init FluxTransformer2DModel with the flow-matching objective the train stage
    uses (x_t = (1 - t) x_0 + t noise, target noise - x_0), on precomputed latents and text embeddings."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel

    vae = AutoencoderKL.from_pretrained(out / "vae").eval()
    with torch.no_grad():
        latents = adapter.normalise_latents(vae.encode(to_tensor(images)).latent_dist.mode())
    texts = encode_texts(adapter, sorted(set(captions)))
    t5 = torch.stack([texts[c]["t5"] for c in captions])
    pooled = torch.stack([texts[c]["clip_pooled"] for c in captions])

    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),
    )
    batch = 16
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=max(0.05, 2 / steps))
    gen = torch.Generator().manual_seed(seed)
    h, w = latents.shape[-2:]
    img_ids = image_ids(h, w)
    txt_ids = torch.zeros(TEXT_MAX_LENGTH, 3)
    start, smoothed = time.time(), None
    for step in range(steps):
        idx = torch.randint(len(latents), (batch,), generator=gen)
        x0 = latents[idx]
        noise = torch.randn(x0.shape, generator=gen)
        t = torch.sigmoid(torch.randn(batch, generator=gen))  # logit-normal, as Flux trains
        tt = t.view(-1, 1, 1, 1)
        noisy = (1 - tt) * x0 + tt * noise
        pred = model(hidden_states=pack_latents(noisy), timestep=t, encoder_hidden_states=t5[idx],
                     pooled_projections=pooled[idx], img_ids=img_ids, txt_ids=txt_ids, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(pred, pack_latents(noise - x0))
        smoothed = optimise(loss, opt, sched, model, smoothed, f"transformer step {step}", step, steps, start)
    model.save_pretrained(out / "transformer")


def optimise(loss: torch.Tensor, opt, sched, model: torch.nn.Module, smoothed: float | None, what: str, step: int,
             steps: int, start: float) -> float:
    """One optimizer step on `loss` (gradients clipped to norm 1), and the smoothed loss, printed every 250 steps
    and at the last; returns it."""
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    smoothed = loss.item() if smoothed is None else 0.98 * smoothed + 0.02 * loss.item()
    if step % 250 == 0 or step == steps - 1:
        print(f"{what}: loss {smoothed:.4f} ({time.time() - start:.0f} s)")
    return smoothed


def pretrain_denoiser(adapter: Adapter, images: list, captions: list[str], seed: int, steps: int,
                      device: torch.device, sampling: str) -> None:
    """Full fine-tuning of the family's random-init denoiser as the train stage computes a step (objective,
    inputs, pipeline layers, loss; LoRA aside), on precomputed latents and text embeddings; saved in place."""
    from diffusion_pipe.train.data import noise_latents
    from diffusion_pipe.train.objectives import mse_loss

    vae = adapter.load_vae(torch.device("cpu"))
    with torch.no_grad():
        latents = adapter.normalise_latents(torch.stack(
            [e["latents"] for e in adapter.encode_media(vae, to_tensor(images)[:, :, None])]))
    texts = encode_texts(adapter, sorted(set(captions)))
    text = {name: torch.stack([texts[c][name] for c in captions]) for name in texts[captions[0]]}

    torch.manual_seed(seed)
    denoiser = adapter.load_denoiser(device).train().requires_grad_(True)
    layers = adapter.pipeline_layers(denoiser)
    batch = 16
    opt = torch.optim.AdamW(denoiser.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=max(0.05, 2 / steps))
    gen = torch.Generator().manual_seed(seed)
    start, smoothed = time.time(), None
    for step in range(steps):
        idx = torch.randint(len(latents), (batch,), generator=gen)
        x0 = latents[idx]
        noised = noise_latents(adapter, x0, torch.randn(x0.shape, generator=gen), None, sampling, 1.0, gen)
        x = tuple(t.to(device) for t in adapter.conditioned_inputs(
            noised.noisy, noised.timesteps, {k: v[idx] for k, v in text.items()}, 1.0, ()))
        for layer in layers:
            x = layer(x)
        target = noised.target.to(device)
        loss = mse_loss(adapter.prediction_to_latents(x, target), target)
        smoothed = optimise(loss, opt, sched, denoiser, smoothed, f"denoiser step {step}", step, steps, start)
    denoiser.cpu().save_pretrained(adapter.denoiser_dir())


def check_samples(out: Path, adapter: Adapter, seed: int) -> dict[str, float]:
    """Render one prompt per (colour, shape, background) with the family's pipeline as the sample stage does
    (no classifier-free guidance: the base never trained on empty captions) and measure the named colour: the
    fraction of pixels near it, per colour (mean over prompts), and the same for the other base colours."""
    from diffusion_pipe.params import SamplePrompt
    from diffusion_pipe.sample.render import prompt_texts, render_prompts

    prompts = [(c, s, b) for c in BASE_COLOURS for s in SHAPES for b in BACKGROUNDS]
    resolved = tuple(SamplePrompt(prompt=caption(*p), seed=seed + i, width=32, height=32, frames=1, steps=8,
                                  guidance=1.0) for i, p in enumerate(prompts))
    device = torch.device("cpu")
    pipe = adapter.sample_pipeline(adapter.load_denoiser(device), adapter.load_vae(device))
    pipe.set_progress_bar_config(disable=True)
    wanted = prompt_texts(adapter, resolved)
    encoded = encode_texts(adapter, [t.text for t in wanted])
    texts = {t: encoded[t.text] for t in wanted}
    pixels = np.stack([frames[0] for frames in render_prompts(pipe, adapter, resolved, texts, device)])
    named = {c: [] for c in BASE_COLOURS}
    others = {c: [] for c in BASE_COLOURS}
    for (colour, _, _), px in zip(prompts, pixels):
        named[colour].append(colour_fraction(px, colour))
        others[colour].append(max(colour_fraction(px, o) for o in BASE_COLOURS if o != colour))
    from PIL import Image

    rows = [np.concatenate(list(pixels[i * 9:(i + 1) * 9]), axis=1) for i in range(len(BASE_COLOURS))]
    Image.fromarray(np.concatenate(rows, axis=0)).save(out.parent / "base-samples.png")
    return {c: (float(np.mean(named[c])), float(np.mean(others[c]))) for c in BASE_COLOURS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "examples" / "concept-tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vae-steps", type=int, default=800)
    parser.add_argument("--steps", type=int, default=2500, help="transformer pretraining steps")
    parser.add_argument("--data-only", action="store_true", help="rewrite the datasets only, not the model")
    parser.add_argument("--family", default="flux", help="the base model's family (flux: the original build)")
    parser.add_argument("--device", default="cpu", help="where the denoiser pretrains (other families)")
    parser.add_argument("--denoiser-config", type=json.loads, default={},
                        help="JSON overrides of the tiny denoiser's config (other families), e.g. a wider model")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core: the machines this runs on are shared
    torch.use_deterministic_algorithms(True, warn_only=args.device != "cpu")  # CUDA lacks some deterministic kernels
    if args.family != "flux":
        build_family_base(args)
        return

    model_dir = args.out / "model"
    shutil.rmtree(args.out / "pretrain", ignore_errors=True)
    shutil.rmtree(args.out / "data", ignore_errors=True)
    base = base_items(variants=4, seed=args.seed)
    write_dataset(base, args.out / "pretrain")
    write_dataset(lora_items(variants=4, seed=args.seed + 1), args.out / "data")
    if args.data_only:
        return
    images, captions = [i for i, _ in base], [c for _, c in base]
    shutil.rmtree(model_dir, ignore_errors=True)
    model_dir.mkdir(parents=True)

    build_text_encoders(model_dir, args.seed)
    from diffusers import FlowMatchEulerDiscreteScheduler

    FlowMatchEulerDiscreteScheduler(shift=1.0).save_pretrained(model_dir / "scheduler")
    (model_dir / "model_index.json").write_text(MODEL_INDEX)
    train_vae(model_dir, to_tensor(images), args.seed, args.vae_steps)
    adapter = FluxAdapter(model_dir, torch.float32)
    pretrain_transformer(model_dir, adapter, images, captions, args.seed, args.steps)
    report_base(args.out, check_samples(model_dir, adapter, args.seed))


def build_family_base(args: argparse.Namespace) -> None:
    """The base of `args.family` in `args.out/model`, pretrained on examples/concept-tiny/pretrain's images (the
    same bytes `base_items` draws)."""
    model_dir = args.out / "model"
    shutil.rmtree(model_dir, ignore_errors=True)
    cls = adapter_class(args.family)
    cls.build_tiny(model_dir, seed=args.seed)
    if args.denoiser_config:
        denoiser_cls, denoiser_dir = (lambda a: (a.denoiser_class(), a.denoiser_dir()))(cls(model_dir, torch.float32))
        config = {**denoiser_cls.load_config(denoiser_dir), **args.denoiser_config}
        torch.manual_seed(args.seed)
        shutil.rmtree(denoiser_dir)
        denoiser_cls.from_config(config).save_pretrained(denoiser_dir)
    base = base_items(variants=4, seed=args.seed)
    images, captions = [i for i, _ in base], [c for _, c in base]
    train_vae(model_dir, to_tensor(images), args.seed, args.vae_steps,
              like=cls(model_dir, torch.float32).component_config("vae"))
    adapter = cls(model_dir, torch.float32)
    pretrain_denoiser(adapter, images, captions, args.seed, args.steps, torch.device(args.device), "uniform")
    report_base(args.out, check_samples(model_dir, adapter, args.seed))


def report_base(out: Path, measured: dict[str, tuple[float, float]]) -> None:
    """Print and write (base-samples.json) how well the base paints each named colour; fail when it does not."""
    for colour, (named, other) in measured.items():
        print(f"samples of '{colour}' prompts: {named:.1%} of pixels near {colour}, at most {other:.1%} near "
              "another base colour")
    (out / "base-samples.json").write_text(json.dumps(
        {c: {"named": round(n, 4), "other": round(o, 4)} for c, (n, o) in measured.items()}, indent=2) + "\n")
    weak = [c for c, (named, other) in measured.items() if named < 0.1 or named < 2 * other]
    if weak:
        sys.exit(f"the base model's samples do not show the named colour for {weak}: pretrain longer (--steps)")


if __name__ == "__main__":
    main()
