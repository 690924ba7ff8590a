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

    python scripts/make_concept_base.py            # rewrites examples/concept-tiny/{model,data,pretrain}
    python scripts/make_concept_base.py --data-only   # the datasets only (the same bytes a full run writes)
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


def train_vae(out: Path, pretrain_pixels: torch.Tensor, seed: int, steps: int) -> None:
    """An AutoencoderKL trained to reconstruct random-colour shapes (MSE + a small KL term that keeps latents
    near unit scale), then its shift/scaling factors set from the pretraining set's latents."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16),
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1, norm_num_groups=4, sample_size=32, scaling_factor=1.0, shift_factor=0.0,
        use_quant_conv=False, use_post_quant_conv=False, mid_block_add_attention=False,
    )
    pixels = torch.cat([to_tensor(autoencoder_images(2048, seed)), pretrain_pixels])
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
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
    vae.register_to_config(shift_factor=round(latents.mean().item(), 4), scaling_factor=round(1 / latents.std().item(), 4))
    vae.save_pretrained(out / "vae")


def encode_texts(adapter: FluxAdapter, captions: list[str]) -> dict[str, dict[str, torch.Tensor]]:
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
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.05)
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
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        smoothed = loss.item() if smoothed is None else 0.98 * smoothed + 0.02 * loss.item()
        if step % 250 == 0 or step == steps - 1:
            print(f"transformer step {step}: loss {smoothed:.4f} ({time.time() - start:.0f} s)")
    model.save_pretrained(out / "transformer")


def check_samples(out: Path, adapter: FluxAdapter, seed: int) -> dict[str, float]:
    """Render one prompt per (colour, shape, background) with FluxPipeline and measure the named colour: the
    fraction of pixels near it, per colour (mean over prompts), and the same for the other base colours."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(out)
    pipe.set_progress_bar_config(disable=True)
    prompts = [(c, s, b) for c in BASE_COLOURS for s in SHAPES for b in BACKGROUNDS]
    texts = encode_texts(adapter, [caption(*p) for p in prompts])
    t5 = torch.stack([texts[caption(*p)]["t5"] for p in prompts])
    pooled = torch.stack([texts[caption(*p)]["clip_pooled"] for p in prompts])
    images = pipe(prompt_embeds=t5, pooled_prompt_embeds=pooled, height=32, width=32, num_inference_steps=8,
                  generator=[torch.Generator().manual_seed(seed + i) for i in range(len(prompts))],
                  output_type="np").images
    pixels = (np.clip(images, 0, 1) * 255).round().astype(np.uint8)
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
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core: the machines this runs on are shared
    torch.use_deterministic_algorithms(True)

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
    measured = check_samples(model_dir, adapter, args.seed)
    for colour, (named, other) in measured.items():
        print(f"samples of '{colour}' prompts: {named:.1%} of pixels near {colour}, at most {other:.1%} near "
              "another base colour")
    (args.out / "base-samples.json").write_text(json.dumps(
        {c: {"named": round(n, 4), "other": round(o, 4)} for c, (n, o) in measured.items()}, indent=2) + "\n")
    weak = [c for c, (named, other) in measured.items() if named < 0.1 or named < 2 * other]
    if weak:
        sys.exit(f"the base model's samples do not show the named colour for {weak}: pretrain longer (--steps)")


if __name__ == "__main__":
    main()
