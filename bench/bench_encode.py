"""Encode benchmark: the encode stage end to end against the raw forward throughput of the same encoders.

    python bench/bench_encode.py                 # H200: Flux-shaped VAE + CLIP-L + T5-XXL (random init, bf16),
                                                 # n=2000 1024x1024 JPEGs, T5 at 512 tokens
    python bench/bench_encode.py --tiny          # CPU smoke test: the tiny example model, n=32 64x64 images

What it measures, in one process and one run:
  (a) raw forward: `adapter.encode_media` on pixels already on the device (images/s), and `adapter.encode_text`
      on the captions (prompts/s; this includes tokenising, as the stage's call does), both at the stage's
      batch size, after a warm-up;
  (b) the encode stage (`encode_manifest`, empty store, no remote) on the same data: decoding and resizing in
      CPU workers, both encoders, the store's pack writes; images/s over the stage's wall time, and over its
      encoding loops alone (without loading the models and hashing their weights);
  (c) an incremental run after 1% of the captions changed (rescan, then encode) against the full run.
The ceiling for (b) is one latent and one text embedding per image: 1 / (1/latent_ips + 1/text_pps).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Flux.1's VAE and text encoders, as their published configs give them (random init here).
FLUX_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2,
    norm_num_groups=32, sample_size=1024, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
    use_post_quant_conv=False,
)
T5_XXL = dict(d_model=4096, d_ff=10240, num_layers=24, num_heads=64, d_kv=64, feed_forward_proj="gated-gelu",
              relative_attention_num_buckets=32, relative_attention_max_distance=128, vocab_size=32128)
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, projection_dim=768, vocab_size=49408, hidden_act="quick_gelu")


def build_flux_encoders(out: Path, device: str) -> None:
    """A Flux-layout model directory with real-size VAE, CLIP-L and T5-XXL (random init, bf16) and tiny tokenizers
    (vocabularies padded to the real sizes in the models). The denoiser is not needed by encode: a tiny one fills
    the slot so the directory is a complete diffusers layout."""
    import torch
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from diffusion_pipe.models.flux import MODEL_INDEX, FluxAdapter

    FluxAdapter.build_tiny(out)  # tokenizers, scheduler, model_index, tiny transformer; encoders replaced below
    # the tiny tokenizers' special ids, which the real-size encoders must share (CLIP pools at its EOS id)
    clip_ids = json.loads((out / "text_encoder/config.json").read_text())
    t5_ids = json.loads((out / "text_encoder_2/config.json").read_text())
    assert clip_ids["vocab_size"] <= CLIP_L["vocab_size"] and t5_ids["vocab_size"] <= T5_XXL["vocab_size"]
    torch.manual_seed(0)
    with torch.device(device):  # initialising 4.7B parameters on the GPU takes seconds, on the CPU minutes
        clip = CLIPTextModel(CLIPTextConfig(**CLIP_L, **{k: clip_ids[k] for k in ("bos_token_id", "eos_token_id",
                                                                                   "pad_token_id")}))
        clip.to(torch.bfloat16).save_pretrained(out / "text_encoder")
        del clip
        t5 = T5EncoderModel(T5Config(**T5_XXL, **{k: t5_ids[k] for k in ("pad_token_id", "eos_token_id",
                                                                              "decoder_start_token_id")}))
        t5.to(torch.bfloat16).save_pretrained(out / "text_encoder_2")
        del t5
        AutoencoderKL(**FLUX_VAE).to(torch.bfloat16).save_pretrained(out / "vae")
    (out / "model_index.json").write_text(MODEL_INDEX)
    if device == "cuda":
        torch.cuda.empty_cache()


def _make_image(args: tuple[Path, int, int]) -> None:
    import numpy as np
    from PIL import Image

    path, i, size = args
    rng = np.random.default_rng(i)
    base = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).resize((size, size), Image.BILINEAR)
    grain = rng.integers(-10, 11, (size, size, 3), dtype=np.int16)
    Image.fromarray(np.clip(np.asarray(base, dtype=np.int16) + grain, 0, 255).astype(np.uint8)).save(
        path / f"{i:06d}.jpg", quality=90)
    write_caption(path, i, "")


def write_caption(path: Path, i: int, variant: str) -> None:
    """A distinct caption per image (about 40 words, like a detailed training caption)."""
    words = " ".join(f"detail{(i * 7 + k) % 997}" for k in range(36))
    (path / f"{i:06d}.txt").write_text(f"a photo number {i} {variant}showing {words}")


def make_dataset(root: Path, n: int, size: int, workers: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_make_image, [(root, i, size) for i in range(n)], chunksize=16))


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def raw_throughput(adapter, device, batch: int, size: int, captions: list[str], max_length: int,
                   iters: int) -> tuple[float, float]:
    """(images/s of encode_media on device-resident pixels, prompts/s of encode_text), best effort steady state."""
    import torch

    vae = adapter.load_vae(device)
    pixels = torch.rand(batch, 3, 1, size, size, device=device) * 2 - 1
    adapter.encode_media(vae, pixels)  # warm-up (cuDNN algorithm choice, allocator)
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        adapter.encode_media(vae, pixels)
    _sync(device)
    ips = iters * batch / (time.perf_counter() - start)
    del vae
    encoders = adapter.load_text_encoders(device)
    chunk = captions[:batch]
    adapter.encode_text(encoders, chunk, max_length)
    _sync(device)
    start = time.perf_counter()
    for i in range(iters):
        adapter.encode_text(encoders, captions[i * batch % len(captions):][:batch] or chunk, max_length)
    _sync(device)
    pps = iters * batch / (time.perf_counter() - start)
    del encoders
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ips, pps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test with the tiny example model")
    ap.add_argument("--n", type=int, help="images (default 2000; 32 with --tiny)")
    ap.add_argument("--size", type=int, help="image side (default 1024; 64 with --tiny)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--workers", type=int, default=8, help="encode.workers: CPU decoding processes")
    ap.add_argument("--max-length", type=int, help="T5 tokens (default 512; 32 with --tiny)")
    ap.add_argument("--iters", type=int, help="batches timed for the raw throughput (default 20; 4 with --tiny)")
    ap.add_argument("--tmp", default=tempfile.gettempdir(), help="where the model, images and store go")
    args = ap.parse_args()
    n = args.n or (32 if args.tiny else 2000)
    size = args.size or (64 if args.tiny else 1024)
    max_length = args.max_length or (32 if args.tiny else 512)
    iters = args.iters or (4 if args.tiny else 20)
    workers = 0 if args.tiny and args.workers == 8 else args.workers

    import os

    import torch

    from diffusion_pipe.encode.encode import encode_manifest
    from diffusion_pipe.models import load_adapter
    from diffusion_pipe.models.common import resolve_device
    from diffusion_pipe.params import DatasetParams, EncodeParams, ModelParams, ScanParams
    from diffusion_pipe.scan import scan_to_files
    from diffusion_pipe.store import Store

    device = resolve_device("cpu" if args.tiny else "auto", "--tiny")
    dtype = "float32" if args.tiny else "bfloat16"
    tmp = Path(tempfile.mkdtemp(prefix="bench-encode-", dir=args.tmp))
    os.environ["DIFFUSION_PIPE_STORE"] = str(tmp / "store")  # the weights hash cache goes there too
    t = time.perf_counter()
    model_dir = tmp / "model"
    if args.tiny:
        from diffusion_pipe.models.flux import FluxAdapter

        FluxAdapter.build_tiny(model_dir)
    else:
        build_flux_encoders(model_dir, device.type)
    data = tmp / "data"
    make_dataset(data, n, size, max(1, os.cpu_count() or 1))
    print(f"built the model and {n} {size}x{size} images in {time.perf_counter() - t:.1f} s", file=sys.stderr)

    model = ModelParams(family="flux", path=str(model_dir), dtype=dtype)
    scan = ScanParams(datasets=(DatasetParams(path=str(data), name="bench", resolutions=(size,)),),
                      bucket_step=16 if args.tiny else 64)
    encode = EncodeParams(batch_size=args.batch_size, device=device.type, text_max_length=max_length,
                          workers=workers, remote="")
    out = tmp / "out"
    scan_to_files(scan, out / "manifest.parquet", out / "scan.json", out / "scan-cache.parquet")
    captions = [(data / f"{i:06d}.txt").read_text() for i in range(n)]

    adapter = load_adapter(model)
    latent_ips, text_pps = raw_throughput(adapter, device, args.batch_size, size, captions, max_length, iters)
    ceiling = 1 / (1 / latent_ips + 1 / text_pps)

    store = Store(tmp / "store")
    t = time.perf_counter()
    full = encode_manifest(model, scan, encode, out / "manifest.parquet", out / "encoded.parquet",
                           out / "encode.json", store)
    full_s = time.perf_counter() - t
    assert full["latent"]["computed"] == n and full["text"]["computed"] == n, full
    latent_loop = full["latent"]["per_second"]
    text_loop = full["text"]["per_second"]
    steady = 1 / (1 / latent_loop + 1 / text_loop)

    changed = max(1, n // 100)
    for i in range(changed):
        write_caption(data, i, "edited ")
    scan_to_files(scan, out / "manifest.parquet", out / "scan.json", out / "scan-cache.parquet")
    t = time.perf_counter()
    inc = encode_manifest(model, scan, encode, out / "manifest.parquet", out / "encoded.parquet",
                          out / "encode.json", Store(tmp / "store"))
    inc_s = time.perf_counter() - t
    assert inc["text"]["computed"] == changed and inc["latent"]["computed"] == 0, inc

    inc_load = inc["text"]["seconds"] - inc["text"]["encode_seconds"]

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{os.cpu_count()}"
    lines = [
        f"encode benchmark: {'tiny' if args.tiny else 'Flux-shaped VAE + CLIP-L + T5-XXL'} ({dtype}) on {gpu}; "
        f"n={n} {size}x{size} jpg, batch {args.batch_size}, T5 {max_length} tokens, {workers} decode workers",
        f"  raw VAE encode (pixels on device)     {latent_ips:9.2f} images/s",
        f"  raw text encode (CLIP + T5)           {text_pps:9.2f} prompts/s",
        f"  ceiling, one latent + one text each   {ceiling:9.2f} images/s",
        f"  encode stage, wall ({full_s:7.1f} s)     {n / full_s:9.2f} images/s   {n / full_s / ceiling:6.1%} of ceiling",
        f"  encode stage, encoding loops          {steady:9.2f} images/s   {steady / ceiling:6.1%} of ceiling "
        f"(latents {latent_loop:.2f}/s = {latent_loop / latent_ips:.1%} of raw, "
        f"text {text_loop:.2f}/s = {text_loop / text_pps:.1%} of raw)",
        f"  incremental, {changed} captions changed    {inc_s:9.2f} s       {inc_s / full_s:6.1%} of the full run "
        f"({full_s / inc_s:.1f}x faster)",
        f"    of which loading the text encoders {inc_load:6.2f} s, encoding {inc['text']['encode_seconds']:.2f} s, "
        f"the rest (planning, store lookups, tables) {inc_s - inc['text']['seconds']:.2f} s",
    ]
    print("\n".join(lines))
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
