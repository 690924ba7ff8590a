"""What the train benchmarks build: a model directory of any registered family at its real (published) shape or
its tiny test shape, a store filled with random entries of the shapes the family's adapter asks for, and the
plain diffusers + peft training loop the train stage is measured against. Shared by bench_train.py (Flux-dev)
and bench_family.py (every family).

A real-shape directory is the family's tiny model (`build_tiny`: tokenizers, scheduler, small encoders) with
the denoiser replaced by a random-init one built from the published `transformer/config.json`, and the VAE and
text-encoder configs patched with the published values training reads (latent channels, compression, scaling,
hidden widths: what `latent_spec`, `text_spec` and `normalise_latents` read). Training never loads a text
encoder or (without samples) the VAE, so their tiny weights only give the text keys something to hash.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

# Published diffusers configs of each family's denoiser (the `transformer/config.json` of the named hub repo,
# keys that are __init__ arguments only), the component-config values training reads, the training shape
# (width, height, frames) and encode.text_max_length as the family's examples/<family>/params-80gb.yaml sets it.
# Videos are 480x832 x 33 frames (832 wide: a multiple of every family's pixel multiple).
_FLUX_VAE = {"block_out_channels": [128, 256, 512, 512], "latent_channels": 16}
_WAN_14B = {
    "transformer": dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                        out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40,
                        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
    "configs": {"vae": {"z_dim": 16, "scale_factor_spatial": 8, "scale_factor_temporal": 4,
                        "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16},
                "text_encoder": {"d_model": 4096}},
    "media": (832, 480, 17), "text_len": 512,
}
REAL: dict[str, dict] = {
    "flux": {  # black-forest-labs/FLUX.1-dev (bench_train.py's dev shape)
        "transformer": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                            guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
        "configs": {"vae": {**_FLUX_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159},
                    "text_encoder": {"hidden_size": 768}, "text_encoder_2": {"d_model": 4096}},
        "media": (1024, 1024, 1), "text_len": 512,
    },
    "qwenimage": {  # Qwen/Qwen-Image, 20.4B
        "transformer": dict(patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                            num_attention_heads=24, joint_attention_dim=3584, guidance_embeds=False,
                            axes_dims_rope=(16, 56, 56)),
        "configs": {"vae": {"z_dim": 16, "temperal_downsample": [False, True, True],
                            "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16}},
        "media": (1024, 1024, 1), "text_len": 512,
    },
    "qwenimage21": {  # Qwen/Qwen-Image-2.1, about 7.2B: no published config found, so QwenImage21Transformer2DModel's
        # defaults (diffusers 0.42.1), which its docs load from that repo; text: the Qwen3-VL-8B hidden width (4096)
        "transformer": dict(patch_size=1, in_channels=64, out_channels=64, num_layers=32, attention_head_dim=128,
                            num_attention_heads=32, context_in_dim=4096, mlp_ratio=3, axes_dims_rope=(16, 56, 56),
                            causal_condition=True),
        "configs": {"vae": {"z_dim": 64, "latents_mean": [0.0] * 64, "latents_std": [1.0] * 64}},
        "media": (1024, 1024, 1), "text_len": 512,
    },
    "ernie_image": {  # baidu/ERNIE-Image: ErnieImageTransformer2DModel's defaults are its shape
        "transformer": dict(hidden_size=3072, num_attention_heads=24, num_layers=24, ffn_hidden_size=8192,
                            in_channels=128, out_channels=128, patch_size=1, text_in_dim=2560,
                            rope_axes_dim=(32, 48, 48)),
        "configs": {"vae": {"block_out_channels": [128, 256, 512, 512], "latent_channels": 32}},
        "media": (1024, 1024, 1), "text_len": 512,
    },
    "ideogram4": {  # ideogram-ai/ideogram-4-fp8, 9.3B: Ideogram4Transformer2DModel's defaults are its shape
        "transformer": dict(in_channels=128, num_layers=34, attention_head_dim=256, num_attention_heads=18,
                            intermediate_size=12288, adaln_dim=512, llm_features_dim=53248, rope_theta=5_000_000,
                            mrope_section=(24, 20, 20), norm_eps=1e-5),
        "configs": {"vae": {"block_out_channels": [128, 256, 512, 512], "latent_channels": 32}},
        "media": (1024, 1024, 1), "text_len": 256,
    },
    "kandinsky5": {  # kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers, about 2B (regular attention)
        "transformer": dict(in_visual_dim=16, out_visual_dim=16, in_text_dim=3584, in_text_dim2=768, time_dim=512,
                            patch_size=(1, 2, 2), model_dim=1792, ff_dim=7168, num_text_blocks=2, num_visual_blocks=32,
                            axes_dims=(16, 24, 24), visual_cond=True, attention_type="regular"),
        "configs": {"vae": {"latent_channels": 16, "spatial_compression_ratio": 8, "temporal_compression_ratio": 4,
                            "scaling_factor": 0.476986}},
        "media": (832, 480, 33), "text_len": 256,
    },
    "kandinsky5_image": {  # kandinskylab/Kandinsky-5.0-T2I-Lite-sft-Diffusers, about 6B
        "transformer": dict(in_visual_dim=16, out_visual_dim=16, in_text_dim=3584, in_text_dim2=768, time_dim=512,
                            patch_size=(1, 2, 2), model_dim=2560, ff_dim=10240, num_text_blocks=2, num_visual_blocks=50,
                            axes_dims=(32, 48, 48), visual_cond=False, attention_type="regular"),
        "configs": {"vae": {**_FLUX_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}},
        "media": (1024, 1024, 1), "text_len": 512,
    },
    "krea2": {  # krea/Krea-2-Raw, about 12.6B: Krea2Transformer2DModel's defaults are its shape
        "transformer": dict(in_channels=64, num_layers=28, attention_head_dim=128, num_attention_heads=48,
                            num_key_value_heads=12, intermediate_size=16384, timestep_embed_dim=256,
                            text_hidden_dim=2560, num_text_layers=12, text_num_attention_heads=20,
                            text_num_key_value_heads=20, text_intermediate_size=6912, num_layerwise_text_blocks=2,
                            num_refiner_text_blocks=2, axes_dims_rope=(32, 48, 48)),
        "configs": {"vae": {"z_dim": 16, "temperal_downsample": [False, True, True],
                            "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16}},
        "media": (1024, 1024, 1), "text_len": 512,
    },
    "flux2_klein": {  # black-forest-labs/FLUX.2-klein-base-9B
        "transformer": dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=24, attention_head_dim=128,
                            num_attention_heads=32, joint_attention_dim=12288, timestep_guidance_channels=256,
                            mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6,
                            guidance_embeds=False),
        "configs": {"vae": {"block_out_channels": [128, 256, 512, 512], "latent_channels": 32}},
        "media": (1024, 1024, 1), "text_len": 512,
    },
    # black-forest-labs/FLUX.2-dev, 32.2B (Flux2Transformer2DModel's defaults): 64 GB of bf16 weights, so only the
    # memory-saving runs (`--runs cap24:float8`, the swapping of examples/flux2/) can fit one GPU
    "flux2": {
        "transformer": dict(patch_size=1, in_channels=128, num_layers=8, num_single_layers=48, attention_head_dim=128,
                            num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256,
                            mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6,
                            guidance_embeds=True),
        "configs": {"vae": {"block_out_channels": [128, 256, 512, 512], "latent_channels": 32}},
        "media": (1024, 1024, 1), "text_len": 512,
    },
    "hunyuan_video15": {  # hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v, 8.3B
        "transformer": dict(in_channels=65, out_channels=32, num_attention_heads=16, attention_head_dim=128,
                            num_layers=54, num_refiner_layers=2, mlp_ratio=4.0, patch_size=1, patch_size_t=1,
                            qk_norm="rms_norm", text_embed_dim=3584, text_embed_2_dim=1472, image_embed_dim=1152,
                            rope_theta=256.0, rope_axes_dim=(16, 56, 56), target_size=640, task_type="t2v"),
        "configs": {"vae": {"latent_channels": 32, "spatial_compression_ratio": 16, "temporal_compression_ratio": 4,
                            "scaling_factor": 1.03682},
                    "text_encoder": {"hidden_size": 3584}, "text_encoder_2": {"d_model": 1472}},
        "media": (832, 480, 33), "text_len": 256,
    },
    "hidream": {  # HiDream-ai/HiDream-I1-Full, 17B (Dev and Fast share the shape): 16 double-stream and 32
        # single-stream blocks, each with a mixture of 4 routed experts (2 per token) and a shared one
        "transformer": dict(patch_size=2, in_channels=16, out_channels=16, num_layers=16, num_single_layers=32,
                            attention_head_dim=128, num_attention_heads=20, caption_channels=[4096, 4096],
                            text_emb_dim=2048, num_routed_experts=4, num_activated_experts=2,
                            axes_dims_rope=(64, 32, 32), max_resolution=(128, 128),
                            llama_layers=[*range(32), *[31] * 16]),
        "configs": {"vae": {**_FLUX_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159},
                    "text_encoder_4": {"hidden_size": 4096, "num_hidden_layers": 32}},  # Llama 3.1 8B Instruct
        "media": (1024, 1024, 1), "text_len": 128,
    },
    "hunyuan_image": {  # hunyuanvideo-community/HunyuanImage-2.1-Diffusers (the base model), about 17B
        "transformer": dict(in_channels=64, out_channels=64, num_attention_heads=28, attention_head_dim=128,
                            num_layers=20, num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0,
                            patch_size=(1, 1), qk_norm="rms_norm", guidance_embeds=False, text_embed_dim=3584,
                            text_embed_2_dim=1472, rope_theta=256.0, rope_axes_dim=(64, 64), use_meanflow=False),
        "configs": {"vae": {"latent_channels": 64, "spatial_compression_ratio": 32, "scaling_factor": 0.75289}},
        "media": (2048, 2048, 1), "text_len": 256,
    },
    "ltx": {  # Lightricks/LTX-Video (0.9.x, 2B)
        "transformer": dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                            attention_head_dim=64, cross_attention_dim=2048, num_layers=28,
                            activation_fn="gelu-approximate", qk_norm="rms_norm_across_heads",
                            norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=4096, attention_bias=True,
                            attention_out_bias=True),
        "configs": {"vae": {"latent_channels": 128, "spatial_compression_ratio": 32, "temporal_compression_ratio": 8,
                            "scaling_factor": 1.0},
                    "text_encoder": {"d_model": 4096}},
        "vae_stats": 128,  # LTX keeps latents_mean/std among the VAE's weights, not in its config
        "media": (832, 480, 33), "text_len": 128,
    },
    "ltx2": {  # Lightricks/LTX-2 (LTX-2.0), 18.9B: 48 blocks of a 4096-wide video and a 2048-wide audio stream;
        # trained on video (the audio stream runs on an empty sequence); 121 frames at 768x512 is LTX2Pipeline's default
        "transformer": dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                            attention_head_dim=128, cross_attention_dim=4096, vae_scale_factors=(8, 32, 32),
                            audio_in_channels=128, audio_out_channels=128, audio_num_attention_heads=32,
                            audio_attention_head_dim=64, audio_cross_attention_dim=2048, num_layers=48,
                            caption_channels=3840, rope_type="split", rope_double_precision=True),
        "configs": {"vae": {"latent_channels": 128, "spatial_compression_ratio": 32, "temporal_compression_ratio": 8,
                            "scaling_factor": 1.0},
                    "connectors": {"video_connector_num_attention_heads": 30, "video_connector_attention_head_dim": 128,
                                   "video_connector_num_learnable_registers": 128}},
        "vae_stats": 128,
        "media": (768, 512, 121), "text_len": 1024,
    },
    "sd3": {  # stabilityai/stable-diffusion-3.5-large, 8.1B
        "transformer": dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                            num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                            pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm",
                            dual_attention_layers=()),
        "configs": {"vae": {**_FLUX_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609}},
        "media": (1024, 1024, 1), "text_len": 256,
    },
    "chroma": {  # lodestones/Chroma1-HD, 8.9B
        "transformer": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                            num_attention_heads=24, joint_attention_dim=4096, axes_dims_rope=(16, 56, 56),
                            approximator_num_channels=64, approximator_hidden_dim=5120, approximator_layers=5),
        "configs": {"vae": {**_FLUX_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159},
                    "text_encoder": {"d_model": 4096}},
        "media": (1024, 1024, 1), "text_len": 512,
    },
    "zimage": {  # Tongyi-MAI/Z-Image-Turbo, 6.2B
        "transformer": dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840, n_layers=30,
                            n_refiner_layers=2, n_heads=30, n_kv_heads=30, norm_eps=1e-5, qk_norm=True,
                            cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0, axes_dims=[32, 48, 48],
                            axes_lens=[1536, 512, 512]),
        "configs": {"vae": {**_FLUX_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}},
        "media": (1024, 1024, 1), "text_len": 512,
    },
    # Wan-AI/Wan2.1-T2V-14B-Diffusers; 17 frames: 33 would not leave room for activations on 141 GB
    "wan": _WAN_14B,
    # Wan-AI/Wan2.2-I2V-A14B-Diffusers, one expert (14B): Wan 2.1's shape over 36 input channels
    "wan_i2v": {**_WAN_14B, "transformer": {**_WAN_14B["transformer"], "in_channels": 36}},
    # Wan-AI/Wan2.1-I2V-14B-480P-Diffusers (16.4B): wan_i2v's shape and the CLIP image path (image_dim, each block's
    # image key and value); the text entries hold its CLIP ViT-H/14 states (257 x 1280) as well
    "wan21_i2v": {**_WAN_14B, "transformer": {**_WAN_14B["transformer"], "in_channels": 36, "image_dim": 1280,
                                              "added_kv_proj_dim": 5120},
                  "configs": {**_WAN_14B["configs"],
                              "image_encoder": {"hidden_size": 1280, "image_size": 224, "patch_size": 14}}},
    "wan_ti2v": {  # Wan-AI/Wan2.2-TI2V-5B-Diffusers, 5B: 48-channel latents of the Wan 2.2 VAE (16x spatial)
        "transformer": {**_WAN_14B["transformer"], "num_attention_heads": 24, "in_channels": 48, "out_channels": 48,
                        "ffn_dim": 14336, "num_layers": 30},
        "configs": {"vae": {"z_dim": 48, "scale_factor_spatial": 16, "scale_factor_temporal": 4,
                            "latents_mean": [0.0] * 48, "latents_std": [1.0] * 48},
                    "text_encoder": {"d_model": 4096}},
        "media": (832, 480, 33), "text_len": 512,
    },
    "skyreels_v2": _WAN_14B,  # Skywork/SkyReels-V2-T2V-14B-540P-Diffusers: Wan 2.1 14B's shape
    "cosmos2": {  # nvidia/Cosmos-Predict2-2B-Video2World, 2B: Wan 2.1's VAE, T5-XXL's 1024-wide states
        "transformer": dict(in_channels=16 + 1, out_channels=16, num_attention_heads=16, attention_head_dim=128,
                            num_layers=28, mlp_ratio=4.0, text_embed_dim=1024, adaln_lora_dim=256,
                            max_size=(128, 240, 240), patch_size=(1, 2, 2), rope_scale=(1.0, 3.0, 3.0),
                            concat_padding_mask=True, extra_pos_embed_type=None),
        "configs": {"vae": _WAN_14B["configs"]["vae"], "text_encoder": {"d_model": 1024}},
        "media": (832, 480, 33), "text_len": 512,
    },
    "cosmos2_image": {  # nvidia/Cosmos-Predict2-2B-Text2Image, 2B
        "transformer": dict(in_channels=16, out_channels=16, num_attention_heads=16, attention_head_dim=128,
                            num_layers=28, mlp_ratio=4.0, text_embed_dim=1024, adaln_lora_dim=256,
                            max_size=(128, 240, 240), patch_size=(1, 2, 2), rope_scale=(1.0, 4.0, 4.0),
                            concat_padding_mask=True, extra_pos_embed_type=None),
        "configs": {"vae": _WAN_14B["configs"]["vae"], "text_encoder": {"d_model": 1024}},
        "media": (1024, 1024, 1), "text_len": 512,
    },
    "minimax_h3": {  # MiniMaxAI/MiniMax-H3 (t2va partition), 33.1B: MiniMaxH3Transformer3DModel's defaults (diffusers
        # 0.42.1 documents them as the released checkpoint's); 124 frames (17n + 5): the shortest the pipeline generates
        "transformer": dict(num_attention_heads=56, attention_head_dim=128, hidden_size=5376, num_layers=50,
                            num_refiner_layers=2, ffn_dim=14336, in_channels=24, audio_in_channels=32,
                            patch_size=(1, 2, 2), text_dim=5120, freq_dim=256, time_embed_hidden_dim=5376,
                            time_embed_dim=2688, rope_freq_dim=16),
        "configs": {"vae": {"latent_channels": 24, "spatial_downsample_factors": [2, 2, 2, 2, 1, 1],
                            "temporal_downsample_factors": [1, 2, 2, 1, 1, 1], "clip_length": 17, "token_drop": 3,
                            "latents_mean": [0.0] * 24, "latents_std": [1.0] * 24}},
        "media": (832, 480, 124), "text_len": 256,
    },
    "hunyuan_video": {  # hunyuanvideo-community/HunyuanVideo, 13B; 17 frames, as Wan
        "transformer": dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128,
                            num_layers=20, num_single_layers=40, num_refiner_layers=2, mlp_ratio=4.0, patch_size=2,
                            patch_size_t=1, qk_norm="rms_norm", guidance_embeds=True, text_embed_dim=4096,
                            pooled_projection_dim=768, rope_theta=256.0, rope_axes_dim=(16, 56, 56)),
        "configs": {"vae": {"latent_channels": 16, "spatial_compression_ratio": 8, "temporal_compression_ratio": 4,
                            "scaling_factor": 0.476986},
                    "text_encoder": {"hidden_size": 4096}, "text_encoder_2": {"hidden_size": 768}},
        "media": (832, 480, 17), "text_len": 256,
    },
    "lumina2": {  # Alpha-VLLM/Lumina-Image-2.0, 2.6B
        "transformer": dict(sample_size=128, patch_size=2, in_channels=16, hidden_size=2304, num_layers=26,
                            num_refiner_layers=2, num_attention_heads=24, num_kv_heads=8, multiple_of=256,
                            ffn_dim_multiplier=None, norm_eps=1e-5, scaling_factor=1.0, axes_dim_rope=(32, 32, 32),
                            axes_lens=(300, 512, 512), cap_feat_dim=2304),
        "configs": {"vae": {**_FLUX_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}},
        "media": (1024, 1024, 1), "text_len": 256,
    },
    "auraflow": {  # fal/AuraFlow-v0.3, 6.8B (SDXL's VAE)
        "transformer": dict(sample_size=64, patch_size=2, in_channels=4, num_mmdit_layers=4, num_single_dit_layers=32,
                            attention_head_dim=256, num_attention_heads=12, joint_attention_dim=2048,
                            caption_projection_dim=3072, out_channels=4, pos_embed_max_size=9216),
        "configs": {"vae": {"block_out_channels": [128, 256, 512, 512], "latent_channels": 4,
                            "scaling_factor": 0.13025}},
        "media": (1024, 1024, 1), "text_len": 256,
    },
}

# Edit families train the base model's shape on a target and its control image's tokens side by side
# (Qwen/Qwen-Image-Edit-2509 and black-forest-labs/FLUX.1-Kontext-dev share their base's transformer config).
REAL["qwenimage_edit"] = REAL["qwenimage"]
REAL["flux_kontext"] = REAL["flux"]

# Tiny shapes: small buckets the tiny models accept (9 frames: 8k+1 for LTX, 4k+1 for the others).
TINY_MEDIA = {"image": (64, 64, 1), "video": (64, 64, 9)}
TINY_TEXT_LEN = 16
TINY_TEXT_LEN_OF = {"wan21_i2v": 512}  # the only length the family takes
TINY_MEDIA_OF = {"minimax_h3": (64, 64, 5)}  # 17n + 5 frames for MiniMax H3's VAE


def media_shape(family: str, shape: str) -> tuple[tuple[int, int, int], int]:
    """((width, height, frames), text_max_length) the benchmark trains `family` at, at `shape` real or tiny."""
    if shape == "real":
        return REAL[family]["media"], REAL[family]["text_len"]
    from diffusion_pipe.models import adapter_class

    media = adapter_class(family).capabilities.media
    return (TINY_MEDIA_OF.get(family, TINY_MEDIA["video" if "video" in media else "image"]),
            TINY_TEXT_LEN_OF.get(family, TINY_TEXT_LEN))


def _patch_json(path: Path, values: dict) -> None:
    path.write_text(json.dumps(json.loads(path.read_text()) | values, indent=2))


def write_model_dir(family: str, root: Path, shape: str, device: str, vae: dict | None = None) -> None:
    """A diffusers-format model directory of `family` at `root`: its tiny model, and at shape "real" a random-init
    bf16 denoiser of the published config (built on `device`, saved in shards) and the published values of the
    other components' configs. `vae`: AutoencoderKL arguments of a full random-init VAE to write instead of the
    tiny one (sampling at a real shape decodes with it)."""
    from diffusion_pipe.models import adapter_class

    cls = adapter_class(family)
    root.mkdir(parents=True, exist_ok=True)
    cls.build_tiny(root, seed=0)
    if vae is not None:
        from diffusers import AutoencoderKL

        shutil.rmtree(root / "vae")
        with torch.device(device):
            AutoencoderKL(**vae).to(torch.bfloat16).save_pretrained(root / "vae")
    if shape != "real":
        return
    spec = REAL[family]
    for component, values in spec.get("configs", {}).items():
        if not (component == "vae" and vae is not None):
            _patch_json(root / component / "config.json", values)
    if spec.get("vae_stats"):
        from safetensors.torch import save_file

        for old in (root / "vae").glob("*.safetensors"):
            old.unlink()
        channels = spec["vae_stats"]
        save_file({"latents_mean": torch.zeros(channels), "latents_std": torch.ones(channels)},
                  str(root / "vae" / "diffusion_pytorch_model.safetensors"))
    adapter = cls(root, torch.bfloat16)
    denoiser_dir = adapter.denoiser_dir()
    shutil.rmtree(denoiser_dir)
    with torch.device(device):
        model = adapter.denoiser_class()(**spec["transformer"]).to(torch.bfloat16)
    model.save_pretrained(denoiser_dir, max_shard_size="10GB")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def random_entry(spec: dict, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Random tensors of a latent or text spec; masks (names ending in 'mask') are all ones and a length
    (`<name>_len`) is that of its `<name>`: every token real, the most work a caption of that length can cost."""
    def value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name.endswith("mask"):
            return torch.ones(shape)
        if name.endswith("_len") and name.removesuffix("_len") in spec:
            return torch.full(shape, spec[name.removesuffix("_len")][0][0])
        return torch.randn(shape, generator=generator)

    return {name: value(name, shape).to(getattr(torch, dtype)) for name, (shape, dtype) in spec.items()}


def fill_store(store_root: Path, encoded: Path, adapter, media: tuple[int, int, int], text_len: int, n: int,
               model, texts: tuple[str, ...] = ()) -> None:
    """`n` latent and text entries of `adapter`'s specs in a store and the encoded table listing them (with the
    conditioning latents a family takes per sample, also random, in the target's spec), plus one text entry per
    string in `texts` under the key encode gives that caption (sample prompts: the train stage looks them up by
    that key). `model` is the run's ModelParams (its dtype keys the text entries)."""
    from diffusion_pipe.bucket_labels import bucket_label
    from diffusion_pipe.encode.encode import Sample, caption_text_keys, write_encoded_table
    from diffusion_pipe.hashing import hash_json
    from diffusion_pipe.store import Store

    width, height, frames = media
    latent_spec, text_spec = adapter.latent_spec(width, height, frames), adapter.text_spec(text_len)
    g = torch.Generator().manual_seed(0)
    bucket = bucket_label(width, height, frames)
    samples = []
    with Store(store_root).writer("latent") as lw, Store(store_root).writer("text") as tw:
        for i in range(n):
            lkey, tkey = hash_json(["bench-latent", i]), hash_json(["bench-text", i])
            lw.add(lkey, random_entry(latent_spec, g))
            tw.add(tkey, random_entry(text_spec, g))
            ckeys = tuple(hash_json(["bench-conditioning", i, c])
                          for c in range(adapter.capabilities.conditioning_latents))
            for ckey in ckeys:
                lw.add(ckey, random_entry(latent_spec, g))
            samples.append(Sample("bench", f"{i}.png", bucket, "train", 1, "", "", lkey, tkey,
                                  media="video" if frames > 1 else "image", conditioning_keys=ckeys))
        for key in caption_text_keys(adapter, model, text_len, texts).values() if texts else ():
            tw.add(key, random_entry(text_spec, g))
    write_encoded_table(samples, encoded)


def peak_gb(dev: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.type == "cuda" else None


def add_plain_lora(model: torch.nn.Module, adapter, rank: int = 32) -> list[torch.nn.Parameter]:
    """peft LoRA of `rank` (alpha = rank) on the family's default targets, as the train stage places it; returns
    the trainable parameters."""
    from peft import LoraConfig

    from diffusion_pipe.train.lora import target_module_names

    model.requires_grad_(False)
    targets = target_module_names(model, adapter.default_lora_targets, adapter.lora_exclude())
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights=True))
    return [p for p in model.parameters() if p.requires_grad]


def train_plain(loss_fn: Callable[[], torch.Tensor], params: list[torch.nn.Parameter], steps: int,
                dev: torch.device, count_flops: bool = False, profile: Path | None = None,
                log: Callable[[str], None] | None = None, fused: bool = False) -> dict:
    """The plain loop: `loss_fn()` forward, backward, grad clipping at 1.0, AdamW (lr 1e-4; torch's fused kernel
    when `fused`) stepping the LoRA weights directly. s/step is the median of steps 3..N; peak memory over the
    timed steps; FLOPs of one step counted by FlopCounterMode when asked, with compiled code run eagerly;
    `profile`: a torch.profiler trace of step 3 there."""
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True if fused else None)

    def step() -> None:
        loss_fn().backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    flops = None
    if count_flops:
        from torch.utils.flop_counter import FlopCounterMode

        # Eagerly: the counter is a dispatch mode, and compiled blocks first called under it need not compile as
        # the timed steps will call them; force_eager leaves dynamo's caches untouched (issue 35's baseline that
        # stopped gaining from compilation was counted this way when its compiled variant ran first).
        counter = FlopCounterMode(display=False)
        with counter, torch.compiler.set_stance("force_eager"):
            step()
        flops = counter.get_total_flops()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps):
        started = time.perf_counter()
        if profile and i == 3:
            from torch.profiler import ProfilerActivity, profile as torch_profile

            from diffusion_pipe.train.loop import write_profile

            cuda = dev.type == "cuda"
            with torch_profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
                with torch.profiler.record_function(f"train.step{i}"):
                    step()
                    if cuda:
                        torch.cuda.synchronize()
            write_profile(prof, profile)
        else:
            step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        if log:
            log(f"plain step {i + 1}/{steps}: {times[-1]:.3f} s")
    out = {"step_seconds": statistics.median(times[2:] or times), "flops_per_step": flops, "max_memory_gb": peak_gb(dev)}
    del opt
    return out
