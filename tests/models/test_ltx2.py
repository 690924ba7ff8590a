"""The LTX-2 adapter: the shared contract on tiny LTX-2.0- and LTX-2.3-shaped models (videos and images), the first
layer's inputs and the prediction against what LTX2Pipeline feeds its transformer (its modality-isolated pass: the
video stream without audio), text entries as the pipeline's encode_prompt and connectors make them, the 8k+1 frame
rule, the connectors' register multiple, and ComfyUI's LTXAV names."""

import pytest
import torch

from diffusion_pipe.models.ltx2 import LTX2Adapter, comfyui_module_name, save_tiny_ltx2
from tests.models.contract import AdapterContract, module_calls, random_like_spec

CPU = torch.device("cpu")


def audio_inputs(denoiser, batch: int, text_length: int, seed: int = 7) -> dict:
    """Random audio latents and audio text states of the shapes LTX2VideoTransformer3DModel takes: what the video
    stream must not depend on with modalities isolated."""
    g = torch.Generator().manual_seed(seed)
    text_width = (denoiser.audio_caption_projection.linear_1.in_features if denoiser.config.use_prompt_embeddings
                  else denoiser.config.audio_num_attention_heads * denoiser.config.audio_attention_head_dim)
    return {"audio_hidden_states": torch.randn(batch, 9, denoiser.config.audio_in_channels, generator=g),
            "audio_encoder_hidden_states": torch.randn(batch, text_length, text_width, generator=g),
            "audio_num_frames": 9}


def transformer_video(adapter, denoiser, inputs, audio: dict) -> torch.Tensor:
    """LTX2VideoTransformer3DModel.forward called as LTX2Pipeline calls it for its modality-isolation guidance
    (`isolate_modalities=True`), on the adapter's first-layer inputs; its video output as latents."""
    from diffusers import LTX2Pipeline

    latents, t, text, mask = inputs
    _, _, f, h, w = latents.shape
    video, _ = denoiser(hidden_states=LTX2Pipeline._pack_latents(latents), encoder_hidden_states=text,
                        timestep=t * 1000, sigma=t * 1000, encoder_attention_mask=mask,
                        audio_encoder_attention_mask=mask, num_frames=f, height=h, width=w, fps=24.0,
                        isolate_modalities=True, use_cross_timestep=True, return_dict=False, **audio)
    return LTX2Pipeline._unpack_latents(video, f, h, w)


class TestLTX2Contract(AdapterContract):
    adapter_cls = LTX2Adapter
    pipeline_cls = "LTX2Pipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 9))  # an image and a 9-frame video (the LTX-2 VAE needs 8k+1 frames)
    # the comfyui file is LTX-2's own format, which LTX2Pipeline's loader converts (no `.alpha`: it refuses them)
    roundtrip_formats = ("diffusers", "comfyui")

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        return transformer_video(adapter, denoiser, inputs, audio_inputs(denoiser, len(like), inputs[2].shape[1]))

    def test_sample_steps_follow_the_guided_video_prediction(self, adapter, lora_model):
        """Two steps of LTX2VideoPipeline are two Euler steps along v over its scheduler's sigmas (s0 = 1, s1, 0)
        from the noise the prompt's generator draws: v the trained video-only forward's prediction at t = sigma
        for the prompt's connector outputs, guided over the negative prompt's (scale 3). So samples render what
        training teaches, in the pipeline's units."""
        denoiser, _ = lora_model
        text, negative = adapter.encode_text(adapter.load_text_encoders(CPU), ["a red square", ""],
                                             self.text_max_length)
        pipe = adapter.sample_pipeline(denoiser, adapter.load_vae(CPU))
        with torch.no_grad():
            got = pipe(height=32, width=48, num_frames=9, num_inference_steps=2, output_type="latent",
                       generator=[torch.Generator().manual_seed(5)],
                       **adapter.sample_inputs(text, negative, 3.0, 1.0)).frames
            s0, s1, end = pipe.scheduler.sigmas.tolist()
            x = torch.randn(got.shape, generator=torch.Generator().manual_seed(5))

            def velocity(x, sigma):
                def predict(entry):
                    out = adapter.model_inputs(x, torch.tensor([sigma]), {k: v[None] for k, v in entry.items()}, 1.0)
                    for layer in adapter.pipeline_layers(denoiser):
                        out = layer(out)
                    return adapter.prediction_to_latents(out, x)

                uncond, cond = predict(negative), predict(text)
                assert (cond - uncond).abs().max() > 1e-3  # the guidance term is not vacuous
                return uncond + 3.0 * (cond - uncond)

            assert s0 == 1.0 and 0 < s1 < 1 and end == 0
            x = x + (s1 - s0) * velocity(x, s0)
            want = x + (end - s1) * velocity(x, s1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    def test_samples_decode_as_the_pipeline_decodes(self, adapter, lora_model):
        """The frames are LTX2Pipeline's decode of the denoised latents: un-normalised with the VAE's stored mean
        and std (which training normalised with), decoded, post-processed."""
        denoiser, _ = lora_model
        text, negative = adapter.encode_text(adapter.load_text_encoders(CPU), ["a red square", ""],
                                             self.text_max_length)
        vae = adapter.load_vae(CPU)
        pipe = adapter.sample_pipeline(denoiser, vae)

        def render(output_type):
            return pipe(height=32, width=32, num_frames=9, num_inference_steps=2, output_type=output_type,
                        generator=[torch.Generator().manual_seed(3)],
                        **adapter.sample_inputs(text, negative, 3.0, 1.0)).frames

        with torch.no_grad():
            latents, frames = render("latent"), render("np")
            mean, std, scaling = adapter._latent_stats
            assert not torch.allclose(std, torch.ones_like(std))  # the statistics are not an identity here
            raw = pipe._denormalize_latents(latents, mean, std, scaling)
            want = pipe.video_processor.postprocess_video(vae.decode(raw, None, return_dict=False)[0], output_type="np")
        assert abs(frames - want).max() < 1e-5

    def test_the_sample_stage_loads_the_video_pipeline_and_the_lora(self, adapter, lora_model, model_dir):
        """As the sample stage loads it (from_pretrained without the text components, then load_lora_weights of
        the exported diffusers file), the video-only pipeline renders, and the LoRA changes what it renders."""
        _, lora = lora_model
        text, negative = adapter.encode_text(adapter.load_text_encoders(CPU), ["a red square", ""],
                                             self.text_max_length)
        pipe = adapter.pipeline_class().from_pretrained(model_dir, torch_dtype=torch.float32, text_encoder=None,
                                                        tokenizer=None, connectors=None)

        def render():
            return pipe(height=32, width=32, num_frames=9, num_inference_steps=2, output_type="np",
                        generator=[torch.Generator().manual_seed(1)],
                        **adapter.sample_inputs(text, negative, 3.0, 1.0)).frames

        without = render()
        pipe.load_lora_weights({k: v.clone() for k, v in adapter.export_lora(lora, "diffusers").items()})
        with_lora = render()
        assert without.shape == with_lora.shape == (1, 9, 32, 32, 3)
        assert abs(with_lora - without).max() > 1e-4

    def test_the_video_prediction_ignores_the_audio_stream(self, adapter, lora_model):
        """With modalities isolated, as the layers compute, other audio latents and audio text predict the same
        video; with audio-to-video attention on (the pipeline's main pass) they do not: the layers leave out a path
        the transformer has, and only that one."""
        denoiser, _ = lora_model
        latents, _, inputs = self._inputs(adapter, batch=1)
        with torch.no_grad():
            one, other = (transformer_video(adapter, denoiser, inputs, audio_inputs(denoiser, 1, 16, seed=s))
                          for s in (1, 2))
            assert torch.allclose(one, other, atol=1e-6)
            x = inputs
            for layer in adapter.pipeline_layers(denoiser):
                x = layer(x)
            torch.testing.assert_close(adapter.prediction_to_latents(x, latents), one, rtol=1e-5, atol=1e-5)
            from diffusers import LTX2Pipeline

            l, t, text, mask = inputs
            joint = [denoiser(hidden_states=LTX2Pipeline._pack_latents(l), encoder_hidden_states=text,
                              timestep=t * 1000, sigma=t * 1000, encoder_attention_mask=mask,
                              audio_encoder_attention_mask=mask, num_frames=2, height=4, width=6,
                              isolate_modalities=False, return_dict=False, **audio_inputs(denoiser, 1, 16, seed=s))[0]
                     for s in (1, 2)]
            assert not torch.allclose(joint[0], joint[1], atol=1e-4)

    def test_default_targets_are_the_video_streams(self, adapter, lora_model):
        """LoRA's default targets wrap the video stream's attention and feed-forward in every block, none of the
        audio stream's or the cross-modal attention's (their names end alike: `audio_attn1.to_q`)."""
        names = {k.rsplit(".lora_", 1)[0] for k in lora_model[1]}
        assert len(names) == 2 * len(adapter.default_lora_targets)  # two blocks
        assert not any("audio" in n for n in names)

    def test_frames_must_be_8k_plus_1(self, adapter):
        vae = adapter.load_vae(CPU)
        with pytest.raises(ValueError, match="8k\\+1 frames"):
            adapter.encode_media(vae, torch.zeros(1, 3, 5, 32, 32))

    def test_text_length_must_be_a_multiple_of_the_registers(self, adapter):
        from diffusion_pipe.config import ConfigError

        with pytest.raises(ConfigError, match="encode.text_max_length: 12; .* multiple of 8"):
            adapter.text_spec(12)
        encoders = adapter.load_text_encoders(CPU)
        with pytest.raises(ConfigError, match="encode.text_max_length: 20"):
            adapter.encode_text(encoders, ["a cat"], 20)

    def test_text_entries_are_the_pipelines_connector_output(self, adapter):
        """Each entry is LTX2Pipeline.encode_prompt's Gemma states through the pipeline's connectors, as __call__
        runs them (left padding); captions of different lengths batch as they encode alone. The connectors' weights
        key the entries with Gemma's."""
        assert set(adapter.text_component_dirs()[0]) == {"text_encoder", "connectors"}
        encoders = adapter.load_text_encoders(CPU)
        pipe = encoders.pipeline
        captions = ["a cat", "a red circle on a white background"]
        entries = adapter.encode_text(encoders, captions, 16)
        states, mask, _, _ = pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=16,
                                                device=CPU)
        assert pipe.tokenizer.padding_side == "left" and mask[0, 0] == 0 and mask[0, -1] == 1
        video, _, video_mask = pipe.connectors(states, mask, padding_side="left")
        for i, entry in enumerate(entries):
            assert torch.equal(entry["text"], video[i]) and torch.equal(entry["text_mask"], video_mask[i].float())
        alone = adapter.encode_text(encoders, captions[:1], 16)[0]
        torch.testing.assert_close(alone["text"], entries[0]["text"], rtol=1e-5, atol=1e-5)

    def test_latents_are_normalised_with_the_vae_statistics(self, adapter):
        latents = torch.zeros(1, 8, 2, 4, 4)
        normalised = adapter.normalise_latents(latents)
        mean, std, _ = adapter._latent_stats
        assert torch.allclose(normalised[0, :, 0, 0, 0], -mean / std)
        assert not torch.allclose(mean, torch.zeros_like(mean))

    def test_first_layer_inputs_are_what_the_pipeline_feeds_its_transformer(self, adapter, model_dir, lora_model):
        """LTX2Pipeline given a caption and VAE latents calls its transformer with the caption's connector states
        and mask, the normalised latents' tokens, the timestep (x 1000, also as sigma) and rotary coordinates at its
        default frame rate: the adapter's stored entry and inputs give the same, and the composed layers predict what
        the pipeline's modality-isolated pass predicts from them."""
        from diffusers import LTX2Pipeline

        pipe = LTX2Pipeline.from_pretrained(model_dir, dtype=torch.float32)
        pipe.transformer = lora_model[0]
        pipe.set_progress_bar_config(disable=True)
        raw = random_like_spec(adapter.latent_spec(64, 32, 9), 1, seed=3)["latents"]  # as the VAE makes them
        with module_calls(pipe.transformer) as calls:
            pipe(prompt="a red square moving right", height=32, width=64, num_frames=9, latents=raw,
                 sigmas=[0.7], num_inference_steps=1, guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0,
                 audio_stg_scale=0.0, max_sequence_length=16, output_type="latent")
        main, isolation = calls  # the main pass, then the modality-isolation pass
        call, isolated, predicted = main.kwargs, isolation.kwargs, isolation.out[0]
        assert not call["isolate_modalities"] and isolated["isolate_modalities"]
        text = adapter.encode_text(adapter.load_text_encoders(CPU), ["a red square moving right"], 16)[0]
        t = call["timestep"] / 1000
        assert 0 < t.item() < 1 and torch.equal(call["sigma"], call["timestep"])
        inputs = adapter.model_inputs(adapter.normalise_latents(raw), t, {k: v[None] for k, v in text.items()}, 1.0)
        torch.testing.assert_close(inputs[2], call["encoder_hidden_states"])
        torch.testing.assert_close(inputs[3], call["encoder_attention_mask"].float())
        torch.testing.assert_close(LTX2Pipeline._pack_latents(inputs[0]), call["hidden_states"])
        layers = adapter.pipeline_layers(lora_model[0])
        with torch.no_grad():
            first = layers[0](inputs)
            cos, sin = pipe.transformer.rope(call["video_coords"])
            torch.testing.assert_close(first[-2:], (cos, sin))
            x = first
            for layer in layers[1:]:
                x = layer(x)
        torch.testing.assert_close(x, predicted, rtol=1e-5, atol=1e-5)

    def test_comfyui_export_merges_as_comfyui_merges_it(self, adapter):
        """Every Linear of the transformer (both streams, the cross-modal attention, the embedders) merged in the
        original LTX-2 layout as ComfyUI merges the file (lora_B/lora_A read as up/down; no `.alpha`: scale 1),
        converted back by diffusers' own LTX-2 converter, equals the LoRA merged in diffusers' layout."""
        from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ltx2_lora_to_diffusers

        from tests.models.comfyui_merge import merge_as_comfyui, random_lora

        def to_diffusers(original):
            converted = _convert_non_diffusers_ltx2_lora_to_diffusers({f"diffusion_model.{k}": v
                                                                       for k, v in original.items()})
            return {k.removeprefix("transformer."): v for k, v in converted.items()}

        denoiser = adapter.load_denoiser(CPU)
        base = {k: v.clone() for k, v in denoiser.state_dict().items()}
        original = {comfyui_module_name(k): v for k, v in base.items()}
        assert set(original) != set(base) and to_diffusers(original).keys() == base.keys()
        modules = [n for n, m in denoiser.named_modules() if isinstance(m, torch.nn.Linear)]
        assert any(m.startswith("time_embed") for m in modules) and any("audio_to_video" in m for m in modules)
        lora = random_lora(base, modules)
        exported = adapter.export_lora(lora, "comfyui")
        assert not any(k.endswith(".alpha") for k in exported)
        assert "diffusion_model.adaln_single.linear.lora_A.weight" in exported
        as_read = {}
        for key, value in exported.items():
            module, _, suffix = key.rpartition(".lora_")
            as_read[f"{module}.lora_{'down' if suffix == 'A.weight' else 'up'}.weight"] = value
            if suffix == "A.weight":
                as_read[f"{module}.alpha"] = torch.tensor(float(value.shape[0]))  # no alpha: ComfyUI's scale 1
        got = to_diffusers(merge_as_comfyui(original, as_read))
        for module in modules:
            want = base[f"{module}.weight"] + lora[f"{module}.lora_B.weight"] @ lora[f"{module}.lora_A.weight"]
            torch.testing.assert_close(got[f"{module}.weight"], want, rtol=1e-5, atol=1e-5)


class TestLTX23Contract(TestLTX2Contract):
    """LTX-2.3's layout: per-modality connector projections, gated attention, timestep-modulated text
    cross-attention (the prompt temb travels through the layers), no caption projection."""

    @pytest.fixture(scope="class")
    def model_dir(self, tmp_path_factory):
        out = tmp_path_factory.mktemp("ltx23")
        save_tiny_ltx2(out, seed=0, ltx23=True)
        return out

    def test_registry_entry(self):
        pass  # the same family as the class above

    def test_build_tiny_is_deterministic_under_seed(self, adapter, tmp_path):
        from safetensors.torch import load_file

        save_tiny_ltx2(tmp_path, seed=0, ltx23=True)
        ours, theirs = (load_file(str(d / "transformer" / "diffusion_pytorch_model.safetensors"))
                        for d in (adapter.model_dir, tmp_path))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    def test_layout_is_ltx23(self, adapter, lora_model):
        denoiser, _ = lora_model
        assert not denoiser.config.use_prompt_embeddings and denoiser.prompt_adaln is not None
        assert adapter.component_config("connectors")["per_modality_projections"]
        assert len(adapter.pipeline_layers(denoiser)[0](self._inputs(adapter)[2])) == 8  # the prompt temb travels


@pytest.mark.parametrize("diffusers_name, comfy", [
    ("transformer_blocks.0.attn1.to_q", "transformer_blocks.0.attn1.to_q"),
    ("transformer_blocks.3.ff.net.0.proj", "transformer_blocks.3.ff.net.0.proj"),
    ("transformer_blocks.3.audio_to_video_attn.to_k", "transformer_blocks.3.audio_to_video_attn.to_k"),
    ("transformer_blocks.1.attn2.norm_q.weight", "transformer_blocks.1.attn2.q_norm.weight"),
    ("transformer_blocks.1.video_a2v_cross_attn_scale_shift_table",
     "transformer_blocks.1.scale_shift_table_a2v_ca_video"),
    ("proj_in", "patchify_proj"), ("audio_proj_in", "audio_patchify_proj"),
    ("time_embed.linear", "adaln_single.linear"),
    ("audio_time_embed.emb.timestep_embedder.linear_1", "audio_adaln_single.emb.timestep_embedder.linear_1"),
    ("av_cross_attn_video_a2v_gate.linear", "av_ca_a2v_gate_adaln_single.linear"),
    ("prompt_adaln.linear", "prompt_adaln_single.linear"),
    ("audio_prompt_adaln.linear", "audio_prompt_adaln_single.linear"),
    ("caption_projection.linear_1", "caption_projection.linear_1"), ("proj_out", "proj_out"),
])
def test_comfyui_names(diffusers_name, comfy):
    assert comfyui_module_name(diffusers_name) == comfy


def test_comfyui_keys_without_alpha(tmp_path):
    lora = {"time_embed.linear.lora_A.weight": torch.ones(4, 24), "time_embed.linear.lora_B.weight": torch.ones(24, 4)}
    out = LTX2Adapter(tmp_path, torch.float32).export_lora(lora, "comfyui")
    base = "diffusion_model.adaln_single.linear"
    assert set(out) == {f"{base}.lora_A.weight", f"{base}.lora_B.weight"}
    assert torch.equal(out[f"{base}.lora_A.weight"], lora["time_embed.linear.lora_A.weight"])
