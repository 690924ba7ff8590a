"""The MiniMax H3 adapter: the shared contract on a tiny MiniMax-H3-shaped model (the unsplit forward is the diffusers
transformer called per sample as the modular pipeline's denoiser calls it), the layout against the pipeline's own
layout and timestep steps for a t2v request, the audio rows as pure noise at H3's noise timestep, the velocity's sign
against MiniMaxH3Scheduler, text entries as the pipeline's text step makes them, the diffusers export loading into
the transformer and through the pipeline's LoRA loader, the ComfyUI export (original names, fused q/k/v and feed-forward
input) converted back by diffusers' own converter, and images and bad frame counts refused."""

import pytest
import torch

from diffusion_pipe.models.minimax_h3 import NOISE_T, MiniMaxH3Adapter, minimax_original_name, pipeline_fact
from tests.models.contract import AdapterContract, expected_deltas, lora_deltas, random_like_spec


def whole_forward(denoiser, inputs):
    """MiniMaxH3Transformer3DModel's own forward on the adapter's first-layer inputs, one sample at a time, called
    as MiniMaxH3LoopDenoiser calls it (the sample's caption rows only, its layout, its distinct timesteps); the video
    velocity rows, stacked."""
    (video, audio, text, text_lengths, timesteps, timestep_indices, token_tags, position_ids, video_indices,
     audio_indices, seq_lengths) = inputs
    out = []
    for b in range(len(video)):
        n, length = int(text_lengths[b]), int(seq_lengths[b])
        out.append(denoiser(hidden_states=video[b:b + 1], audio_hidden_states=audio[b:b + 1],
                            encoder_hidden_states=text[b:b + 1, :n], timestep=timesteps[b],
                            timestep_indices=timestep_indices[b, :length], token_tags=token_tags[b, :length],
                            position_ids=position_ids[b, :length], video_indices=video_indices[b],
                            audio_indices=audio_indices[b], text_indices=torch.arange(n), return_dict=False)[0])
    return torch.cat(out)


class TestMiniMaxH3Contract(AdapterContract):
    adapter_cls = MiniMaxH3Adapter
    pipeline_cls = "MiniMaxH3ModularPipeline"
    denoiser_attr = "transformer"
    # 17n + 5 frames: 2 and 37 latent frames; 124 is the pipeline's default length (its samples need 120 to 360)
    media_sizes = ((32, 32, 5), (64, 32, 124))
    roundtrip_formats = ()  # a modular pipeline has no from_pretrained of a diffusers folder: the loaders below

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        return adapter.prediction_to_latents(whole_forward(denoiser, inputs), like)

    def test_exported_lora_loads_into_the_transformer(self, adapter, lora_model, model_dir):
        """The diffusers file gives every module its delta through the transformer's `load_lora_adapter`, and the
        modular pipeline's loader (MiniMaxH3LoraLoaderMixin) reads it as a transformer LoRA."""
        from diffusers import MiniMaxH3Transformer3DModel
        from diffusers.loaders import MiniMaxH3LoraLoaderMixin

        _, lora = lora_model
        exported = adapter.export_lora(lora, "diffusers")
        transformer = MiniMaxH3Transformer3DModel.from_pretrained(model_dir / "transformer")
        transformer.load_lora_adapter({k: v.clone() for k, v in exported.items()}, prefix="transformer")
        got, want = lora_deltas(transformer), expected_deltas(lora)
        assert set(got) == set(want)
        assert all(torch.allclose(got[name], want[name], atol=1e-6) for name in want)
        state = MiniMaxH3LoraLoaderMixin.lora_state_dict({k: v.clone() for k, v in exported.items()})
        state = state[0] if isinstance(state, tuple) else state
        assert set(state) == set(exported)

    def test_comfyui_file_converts_back_to_the_same_deltas(self, adapter, lora_model, model_dir):
        """The comfyui file, read by diffusers' converter of original-name (ComfyUI, ai-toolkit) MiniMax H3 LoRAs and
        loaded into the transformer, gives every module the delta it was trained with: the fused q/k/v, the swapped
        feed-forward halves and every name map back."""
        from diffusers import MiniMaxH3Transformer3DModel
        from diffusers.loaders import MiniMaxH3LoraLoaderMixin

        _, lora = lora_model
        out = adapter.export_lora(lora, "comfyui")
        assert all(k.startswith("diffusion_model.") for k in out)
        qkv = "diffusion_model.blocks.1.attn.qkv_proj"
        assert out[f"{qkv}.alpha"].item() == 12.0 and out[f"{qkv}.lora_up.weight"].shape == (3 * 32, 12)
        assert "diffusion_model.token_refiner.blocks.0.mlp.fc1.lora_down.weight" in out
        state = MiniMaxH3LoraLoaderMixin.lora_state_dict({k: v.clone() for k, v in out.items()})
        transformer = MiniMaxH3Transformer3DModel.from_pretrained(model_dir / "transformer")
        transformer.load_lora_adapter(state, prefix="transformer")
        got, want = lora_deltas(transformer), expected_deltas(lora)
        assert set(got) == set(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)

    def test_comfyui_names(self):
        assert minimax_original_name("transformer_blocks.3.attn.to_k") == "blocks.3.attn.qkv_proj"
        assert minimax_original_name("token_refiner.refiner_blocks.0.ff.net.2") == "token_refiner.blocks.0.mlp.fc2"
        assert minimax_original_name("proj_out") == "final_layer.video_out"
        with pytest.raises(ValueError, match="no original MiniMax H3"):
            minimax_original_name("transformer_blocks.0.attn.norm_q")

    def test_variable_caption_lengths_train_as_each_alone(self, adapter, lora_model):
        """A micro-batch of two captions of different lengths, at two timesteps, predicts for each what the
        transformer predicts for it alone (each sample's rows only, no padding row attended to)."""
        denoiser, _ = lora_model
        latents = random_like_spec(adapter.latent_spec(64, 32, 22), 2, 0)["latents"]
        text = random_like_spec(adapter.text_spec(16), 2, 1)
        text["prompt_mask"] = torch.zeros(2, 16, dtype=torch.long)
        text["prompt_mask"][0, :3], text["prompt_mask"][1, :9] = 1, 1
        t = torch.tensor([0.3, 0.8])
        inputs = adapter.model_inputs(latents, t, text, 1.0)
        with torch.no_grad():
            x = inputs
            for layer in adapter.pipeline_layers(denoiser):
                x = layer(x)
            both = adapter.prediction_to_latents(x, latents)
            for b in range(2):
                alone = adapter.model_inputs(latents[b:b + 1], t[b:b + 1], {k: v[b:b + 1] for k, v in text.items()},
                                             1.0)
                assert torch.equal(alone[0], inputs[0][b:b + 1])
                alone = (alone[0], inputs[1][b:b + 1], *alone[2:])  # the batch's audio noise (seeded per batch)
                one = adapter.prediction_to_latents(whole_forward(denoiser, alone), latents[b:b + 1])
                torch.testing.assert_close(both[b:b + 1], one, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("minimax_h3")
    MiniMaxH3Adapter.build_tiny(out, seed=0)
    return MiniMaxH3Adapter(out, torch.float32)


def test_layout_is_the_pipelines_for_a_t2v_step(tiny):
    """The pipeline's layout step for a t2va request of 22 frames at 64x32 (no keyframes) and its timestep step at
    one video timestep give exactly the first layer's rows: position ids, tags, indices and row timesteps; the video
    rows are the pipeline's patchified latents and the audio rows pure noise at t = 0 (what its first step holds)."""
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (MiniMaxH3PrepareLayoutStep,
                                                                      MiniMaxH3SetTimestepsStep,
                                                                      patchify_video_latents)
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import audio_latent_num_frames

    latents = random_like_spec(tiny.latent_spec(64, 32, 22), 1, 0)["latents"]
    text = random_like_spec(tiny.text_spec(16), 1, 1)
    text["prompt_mask"] = torch.zeros(1, 16, dtype=torch.long)
    text["prompt_mask"][0, :5] = 1
    sigma = torch.tensor([0.25])
    (video, audio, text_in, lengths, timesteps, timestep_indices, tags, position_ids, video_indices, audio_indices,
     seq_lengths) = tiny.model_inputs(latents, sigma, text, 1.0)
    num_audio = audio_latent_num_frames(22)
    want = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.full((5,), 1), 7, 2, 4, num_audio, (1, 2, 2), 2, pipeline_fact("audio_tag"), pipeline_fact("video_tag"))
    position, want_tags, want_video, want_audio, want_text = want[:5]
    assert int(lengths[0]) == 5 and int(seq_lengths[0]) == len(want_tags) == 5 + 2 * num_audio + 7 * 2
    torch.testing.assert_close(position_ids[0], position.float(), rtol=0, atol=0)
    assert torch.equal(tags[0], want_tags) and torch.equal(video_indices[0], want_video)
    assert torch.equal(audio_indices[0], want_audio) and torch.equal(want_text, torch.arange(5))
    unique, inverse = MiniMaxH3SetTimestepsStep.build_row_timesteps(want_video, want_audio, 0, 0, 5, 0.75, 0.0,
                                                                    0.999, 1.0)
    assert torch.equal(timesteps[0][timestep_indices[0]], unique[inverse])
    assert set(timesteps[0][timestep_indices[0][want_audio]].tolist()) == {NOISE_T}
    scheduler = MiniMaxH3Scheduler()
    scheduler.set_timesteps(4)
    assert scheduler.timesteps[0] == NOISE_T == 0.0  # the pipeline's first step: pure noise
    assert set(timesteps[0][timestep_indices[0][want_video]].tolist()) == {0.75}
    assert torch.equal(video[0], patchify_video_latents(latents, (1, 2, 2)))
    assert audio.shape == (1, 2 * num_audio, 32) and abs(audio.std().item() - 1) < 0.3
    assert torch.equal(text_in, text["prompt_embeds"])


def test_prediction_is_the_schedulers_velocity_negated(tiny):
    """MiniMaxH3Scheduler takes x0 = x_t + sigma * v at t = 1 - sigma: for the model output v that recovers x0 from
    x_t = (1 - sigma) x0 + sigma noise, `prediction_to_latents` gives noise - x0, the objective's target."""
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

    scheduler = MiniMaxH3Scheduler(shift=1.0)
    scheduler.set_timesteps(sigmas=[0.6, 0.0])
    x0, noise = torch.randn(1, 8, 2, 2, 4), torch.randn(1, 8, 2, 2, 4)
    x_t = 0.4 * x0 + 0.6 * noise
    v = patchify_video_latents(x0 - noise, (1, 2, 2))[None]
    stepped = scheduler.step(v[0], scheduler.timesteps[0], patchify_video_latents(x_t, (1, 2, 2)),
                             return_dict=False)[0]
    torch.testing.assert_close(stepped, patchify_video_latents(x0, (1, 2, 2)), rtol=0, atol=1e-5)
    torch.testing.assert_close(tiny.prediction_to_latents(v, x0), noise - x0, rtol=0, atol=0)


def test_audio_noise_is_reproducible_per_micro_batch(tiny):
    latents = random_like_spec(tiny.latent_spec(32, 32, 5), 1, 0)["latents"]
    text = random_like_spec(tiny.text_spec(16), 1, 1)
    text["prompt_mask"] = torch.ones(1, 16, dtype=torch.long)
    first, again, other = (tiny.model_inputs(latents, torch.tensor([t]), text, 1.0)[1] for t in (0.5, 0.5, 0.6))
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_text_entries_are_the_pipelines_text_step(tiny):
    """MiniMaxH3TextEncoderStep: the caption's tokens without special tokens through `get_qwen3vl_prompt_embeds` at
    the pipeline's layer 50; the entry is that, zero-padded, with the mask of its tokens. Empty and too-long
    captions are refused."""
    from types import SimpleNamespace

    from diffusers.modular_pipelines.minimax_h3.encoders import MiniMaxH3TextEncoderStep
    from diffusers.modular_pipelines.modular_pipeline import PipelineState

    from diffusion_pipe.config import ConfigError

    encoders = tiny.load_text_encoders(torch.device("cpu"))
    components = SimpleNamespace(text_encoder=encoders["text_encoder"], tokenizer=encoders["tokenizer"],
                                 processor=encoders["processor"], text_encoder_layer=50,
                                 _execution_device=torch.device("cpu"), text_tag=1)
    step = MiniMaxH3TextEncoderStep()
    for caption in ("a red circle", "a blue square on a white background"):
        state = PipelineState()
        state.set("prompt", caption)
        step(components, state)
        want = state.get("prompt_embeds")[0]
        entry = tiny.encode_text(encoders, [caption], 16)[0]
        n = want.shape[0]
        assert torch.equal(entry["prompt_embeds"][:n], want) and entry["prompt_embeds"][n:].abs().sum() == 0
        assert entry["prompt_mask"].tolist() == [1] * n + [0] * (16 - n)
    with pytest.raises(ConfigError, match="empty caption"):
        tiny.encode_text(encoders, [""], 16)
    with pytest.raises(ConfigError, match="encode.text_max_length: 2 tokens"):
        tiny.encode_text(encoders, ["a blue square on a white background"], 2)


def test_images_and_other_frame_counts_are_refused(tiny):
    vae = tiny.load_vae(torch.device("cpu"))
    with pytest.raises(ValueError, match="family 'minimax_h3' trains on clips only"):
        tiny.encode_media(vae, torch.zeros(1, 3, 1, 32, 32))
    with pytest.raises(ValueError, match="family 'minimax_h3' trains on clips only"):
        tiny.latent_spec(32, 32, 1)
    with pytest.raises(ValueError, match=r"frames: 9 frames; family 'minimax_h3' needs 17n \+ 5"):
        tiny.latent_spec(32, 32, 9)
    assert tiny.latent_spec(32, 32, 124)["latents"][0][1] == 37  # the pipeline's default length: 5 * 7 + 2


def test_latents_are_what_the_pipeline_encodes(tiny, monkeypatch):
    """The pipeline's `encode_vae_condition` (ImageNet-normalised [0, 1] pixels, normalised with the VAE's latent
    statistics) of a clip, at the posterior's mode (the pipeline draws a sample and rounds it to float16), is the
    normalised store entry."""
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
    from diffusers.modular_pipelines.minimax_h3.encoders import encode_vae_condition

    monkeypatch.setattr(DiagonalGaussianDistribution, "sample", lambda self, generator=None: self.mode())
    vae = tiny.load_vae(torch.device("cpu"))
    pixels = torch.randint(0, 256, (1, 3, 22, 32, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    want = encode_vae_condition(vae, pixels, pipeline_fact("pixel_mean"), pipeline_fact("pixel_std"))[0]
    entry = tiny.encode_media(vae, pixels.float() / 127.5 - 1)[0]["latents"]
    torch.testing.assert_close(tiny.normalise_latents(entry), want, rtol=0, atol=3e-3)


def test_samples_render_from_the_denoiser_training_builds(tiny):
    """Training's denoiser (meta-initialised, only its pipeline layers' modules loaded) renders samples through the
    pipeline, whose whole-transformer forward runs the audio head too."""
    from diffusion_pipe.train.build import build_local_model

    local = build_local_model(tiny, 1, 0, targets=tiny.default_lora_targets, rank=4, alpha=4.0, dropout=0.0, seed=0)
    pipe = tiny.sample_pipeline(local.denoiser, tiny.load_vae(torch.device("cpu")))
    out = pipe(prompt_embeds=[torch.randn(1, 3, 16)], height=32, width=32, num_frames=124, num_inference_steps=2,
               generator=[torch.Generator().manual_seed(0)])
    assert out.frames.shape == (1, 124, 32, 32, 3)


@pytest.mark.slow  # a 1-stage and a 2-stage train stage over the tiny example: about 40 s
def test_two_pipeline_stages_match_one_with_samples(tmp_path):
    """The tiny example trained over 2 stages (two CPU processes) gives the 1-stage losses and gradient norms, and
    its samples (rank 0 renders through the pipeline's whole forward, borrowing the output heads' weights from the
    last stage and calling its other modules there) equal the 1-stage ones."""
    import sys

    import numpy as np
    import yaml
    from PIL import Image

    from tests.conftest import REPO, make_pipeline_repo, run_checked, run_env
    from tests.test_pipeline import loss_plot, train_losses

    store = tmp_path / "store"
    repo = make_pipeline_repo(tmp_path / "repo", store)
    params = yaml.safe_load((REPO / "examples/minimax_h3-tiny/params.yaml").read_text())
    params["train"].update(steps=3, warmup_steps=0, eval_every_steps=0, max_grad_norm=0.01)
    params["train"]["samples"].update(every_steps=0, steps=2, prompts=params["train"]["samples"]["prompts"][:1])
    for stages in (1, 2):
        (repo / f"p{stages}.yaml").write_text(yaml.safe_dump(
            {**params, "train": {**params["train"], "pipeline_stages": stages}}, sort_keys=False))
    (repo / "params.yaml").write_text((repo / "p1.yaml").read_text())
    for stage in ("scan", "encode"):
        run_checked([sys.executable, "-m", f"stages.{stage}"], cwd=repo, env=run_env(store))
    one = train_losses(repo, store, "p1.yaml", 1, tmp_path / "p1")
    two = train_losses(repo, store, "p2.yaml", 2, tmp_path / "p2")
    assert len(one) == 3 and one == pytest.approx(two, abs=1e-5)
    assert loss_plot(tmp_path / "p1", "grad_norm") == pytest.approx(loss_plot(tmp_path / "p2", "grad_norm"), rel=1e-4)
    for step in ("step000000", "step000003"):
        (a,), (b,) = (list((tmp_path / p / "runs/samples").glob(f"*/{step}.png")) for p in ("p1", "p2"))
        assert np.abs(np.asarray(Image.open(a), dtype=int) - np.asarray(Image.open(b), dtype=int)).max() <= 1


def test_encode_refuses_an_image_item_naming_it(tiny, store_env):
    """Encode's plan refuses an image in a minimax_h3 dataset, naming the item and saying why (text-to-video, clips
    only), and plans a clip of 17n + 5 frames."""
    import pyarrow as pa

    from diffusion_pipe.config import ConfigError, from_dict
    from diffusion_pipe.encode.encode import plan_samples
    from diffusion_pipe.models import load_adapter
    from diffusion_pipe.params import EncodeParams, ModelParams

    clip = {"dataset": "clips", "path": "a.mp4", "status": "ok", "media": "video", "content_hash": "1" * 32,
            "caption": "a square moving right", "buckets": ["32x32x5"], "split": "train", "repeats": 1,
            "frame_starts": [0], "frame_stride": 1}
    image = {**clip, "path": "b.png", "media": "image", "buckets": ["32x32x1"]}
    model = from_dict(ModelParams, {"family": "minimax_h3", "path": str(tiny.model_dir), "dtype": "float32"}, "model")

    def plan(rows):
        return plan_samples(pa.Table.from_pylist(rows), load_adapter(model), model,
                            from_dict(EncodeParams, {"text_max_length": 16}, "encode"))

    with pytest.raises(ConfigError, match=r"clips/b\.png is an image, but model family 'minimax_h3' generates video "
                                          r"only and trains on clips"):
        plan([clip, image])
    assert len(plan([clip])) == 1


def test_fp8_base_weights_are_refused_naming_the_param(tiny):
    """diffusers' AdaLN modulation casts its input to its Linear's weight dtype, which fp8 storage makes float8: a
    block layer over fp8 base weights is a ConfigError naming model.base_dtype, not a dtype error in a matmul."""
    from diffusion_pipe.config import ConfigError
    from diffusion_pipe.train.fp8 import quantise_frozen_linears

    layers = tiny.pipeline_layers(tiny.load_denoiser(torch.device("cpu")))
    assert quantise_frozen_linears(layers[1:-1])
    latents = random_like_spec(tiny.latent_spec(32, 32, 5), 1, 0)["latents"]
    x = layers[0](tiny.model_inputs(latents, torch.tensor([0.5]), random_like_spec(tiny.text_spec(16), 1, 1), 1.0))
    with pytest.raises(ConfigError, match="model.base_dtype: family 'minimax_h3' cannot keep its block weights in "
                                          "float8"):
        layers[1](x)
