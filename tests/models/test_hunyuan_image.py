"""The HunyuanImage 2.1 adapter: the shared contract on a tiny HunyuanImage-shaped model, the text entries as
HunyuanImagePipeline.encode_prompt makes them (a quoted caption through ByT5), latents as the pipeline un-scales
them, and the ComfyUI export in the modules ComfyUI runs HunyuanImage 2.1 on."""

import pytest
import torch

from diffusion_pipe.models.hunyuan_image import HunyuanImageAdapter
from tests.models.comfyui_merge import merge_as_comfyui
from tests.models.contract import AdapterContract, expected_deltas, lora_deltas
from tests.models.test_hunyuan_video15 import binary_masks  # 0/1 masks: the refiner pools by them


class TestHunyuanImageContract(AdapterContract):
    adapter_cls = HunyuanImageAdapter
    pipeline_cls = "HunyuanImagePipeline"
    denoiser_attr = "transformer"
    media_sizes = ((64, 64, 1), (96, 64, 1))
    roundtrip_formats = ("diffusers",)  # comfyui: test_comfyui_merge_is_the_lora_in_comfyuis_modules

    def _inputs(self, adapter, batch: int = 2, seed: int = 0, conditioning_seed: int = 100):
        latents, noised, inputs = super()._inputs(adapter, batch, seed, conditioning_seed)
        return latents, noised, binary_masks(inputs, seed)

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        """HunyuanImageTransformer2DModel.forward called as HunyuanImagePipeline calls the base model: the timestep
        is the scheduler's (sigma x num_train_timesteps, 1000), no guidance, no MeanFlow timestep."""
        latents, t, qwen, qwen_mask, glyph, glyph_mask = inputs
        return denoiser(hidden_states=latents, timestep=t * 1000, encoder_hidden_states=qwen,
                        encoder_attention_mask=qwen_mask, encoder_hidden_states_2=glyph,
                        encoder_attention_mask_2=glyph_mask, timestep_r=None, guidance=None, return_dict=False)[0]

    def test_exported_lora_round_trips_into_diffusers_pipeline(self, adapter, lora_model, model_dir, monkeypatch):
        """The contract's round trip, through the family's HunyuanImagePipeline: diffusers 0.42.1 gives the
        pipeline no `load_lora_weights`, which its subclass adds through the transformer's own PEFT loader."""
        import diffusers

        monkeypatch.setattr(diffusers, self.pipeline_cls, adapter.pipeline_class())
        super().test_exported_lora_round_trips_into_diffusers_pipeline(adapter, lora_model, model_dir)

    def test_text_entries_are_the_pipelines_encode_prompt(self, adapter):
        """Each entry is encode_prompt's output at `max_length` Qwen tokens: the template (34 tokens in the tiny
        tokenizer too, which the pipeline drops) gone, and ByT5 states of the quoted text, zeros without any."""
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        pipe = encoders.pipeline
        prefix = pipe.prompt_template_encode.split("{}")[0]
        assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
        captions = ["a red circle", 'a sign that says "hello"']
        plain, quoted = adapter.encode_text(encoders, captions, 16)
        kept = len(pipe.tokenizer("a red circle" + pipe.prompt_template_encode.split("{}")[1]).input_ids)
        assert plain["prompt_mask"].tolist() == [1] * kept + [0] * (16 - kept)
        assert plain["glyph_mask"].sum() == 0 and plain["glyph_embeds"].abs().sum() == 0
        assert quoted["glyph_mask"].sum() == len('Text "hello". ') + 1  # the pipeline's glyph wording and </s>
        pipe.tokenizer_max_length = 16
        qwen, qwen_mask, glyph, glyph_mask = pipe.encode_prompt(captions, device=torch.device("cpu"), batch_size=2)
        for i, entry in enumerate((plain, quoted)):
            assert torch.equal(entry["prompt_embeds"], qwen[i]) and torch.equal(entry["prompt_mask"], qwen_mask[i])
            assert torch.equal(entry["glyph_embeds"], glyph[i].float())
            assert torch.equal(entry["glyph_mask"], glyph_mask[i])

    def test_template_keys_the_text(self, adapter):
        assert "Describe the image" in adapter.text_template() and '"drop_tokens": 34' in adapter.text_template()

    def test_padding_changes_no_prediction(self, adapter, lora_model):
        """The transformer masks the padding (Qwen's and ByT5's) and gives text tokens no positions: a caption
        padded to 16 or 24 tokens predicts the same latents."""
        denoiser, _ = lora_model
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        shape = adapter.latent_spec(64, 64, 1)["latents"][0]
        latents = torch.randn(1, *shape, generator=torch.Generator().manual_seed(0))
        outs = []
        for length in (16, 24):
            (entry,) = adapter.encode_text(encoders, ['a sign that says "hi"'], length)
            inputs = adapter.model_inputs(latents, torch.tensor([0.4]), {k: v[None] for k, v in entry.items()}, 1.0)
            with torch.no_grad():
                outs.append(self.unsplit_forward(adapter, denoiser, inputs, latents))
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)

    def test_stored_latents_are_what_the_pipeline_unscales_before_decoding(self, adapter):
        """HunyuanImagePipeline decodes `latents / scaling_factor`: of a stored entry normalised for training,
        that is the VAE's own latent of the image (scaling_factor is not 1 in the tiny VAE)."""
        vae = adapter.load_vae(torch.device("cpu"))
        assert vae.config.scaling_factor != 1.0 and adapter.vae_scale == 32
        pixels = torch.rand(1, 3, 1, 64, 96, generator=torch.Generator().manual_seed(0)) * 2 - 1
        (entry,) = adapter.encode_media(vae, pixels)
        trained_on = adapter.normalise_latents(entry["latents"][None])
        torch.testing.assert_close(trained_on / vae.config.scaling_factor,
                                   vae.encode(pixels[:, :, 0]).latent_dist.mode(), rtol=0, atol=1e-6)

    def test_distilled_and_refiner_transformers_are_refused(self, adapter):
        for key, value in (("guidance_embeds", True), ("use_meanflow", True), ("patch_size", (1, 1, 1))):
            denoiser = adapter.load_denoiser(torch.device("cpu"))
            denoiser.register_to_config(**{key: value})
            with pytest.raises(ValueError, match="distilled .* or refiner .* base text-to-image model"):
                adapter.pipeline_layers(denoiser)

    def test_default_lora_leaves_the_text_refiner_and_final_projection(self, adapter, lora_model):
        names = {k.rsplit(".lora_", 1)[0] for k in lora_model[1]}
        assert not any(n.startswith("context_embedder.") or n == "proj_out" for n in names)
        assert "single_transformer_blocks.1.proj_out" in names and "transformer_blocks.1.ff_context.net.2" in names

    def test_sample_guidance_sets_both_guiders(self, adapter, model_dir):
        """Stored text entries render through the sampling pipeline, the guidance scale per call reaching the
        guider and the one for quoted text."""
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        text, negative = adapter.encode_text(encoders, ['a sign that says "hi"', ""], 16)
        pipe = adapter.pipeline_class().from_pretrained(model_dir, text_encoder=None, tokenizer=None,
                                                        text_encoder_2=None, tokenizer_2=None)
        out = pipe(**adapter.sample_inputs(text, negative, 2.5, 1.0), height=64, width=64, num_inference_steps=2,
                   output_type="np", generator=torch.Generator().manual_seed(0))
        assert out.images.shape == (1, 64, 64, 3)
        assert pipe.guider.guidance_scale == pipe.ocr_guider.guidance_scale == 2.5

    def test_comfyui_merge_is_the_lora_in_comfyuis_modules(self, adapter, lora_model):
        """Merged as ComfyUI merges (W += alpha / rank * up @ down) into the modules of ComfyUI's HunyuanVideo model
        (Flux's blocks, which ComfyUI runs HunyuanImage 2.1 on), the export changes each weight by the LoRA of the
        diffusers modules it holds: q, k, v stacked in img_attn.qkv / txt_attn.qkv, and q, k, v, proj_mlp in a
        single block's linear1."""
        _, lora = lora_model
        exported = adapter.export_lora(lora, "comfyui")
        want = expected_deltas(lora)
        names = [k.removeprefix("diffusion_model.").removesuffix(".lora_down.weight") for k in exported
                 if k.endswith(".lora_down.weight")]
        zero = {f"{name}.weight": torch.zeros(exported[f"diffusion_model.{name}.lora_up.weight"].shape[0],
                                              exported[f"diffusion_model.{name}.lora_down.weight"].shape[1])
                for name in names}
        got = merge_as_comfyui(zero, exported)
        layout = {"img_attn.qkv": ["attn.to_q", "attn.to_k", "attn.to_v"],
                  "txt_attn.qkv": ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
                  "img_attn.proj": ["attn.to_out.0"], "txt_attn.proj": ["attn.to_add_out"],
                  "img_mlp.0": ["ff.net.0.proj"], "img_mlp.2": ["ff.net.2"],
                  "txt_mlp.0": ["ff_context.net.0.proj"], "txt_mlp.2": ["ff_context.net.2"],
                  "linear1": ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"], "linear2": ["proj_out"]}
        covered = set()
        for key, delta in got.items():
            kind, index, comfy = key.removesuffix(".weight").split(".", 2)
            ours = {"double_blocks": "transformer_blocks", "single_blocks": "single_transformer_blocks"}[kind]
            parts = [f"{ours}.{index}.{m}" for m in layout[comfy]]
            torch.testing.assert_close(delta, torch.cat([want[p] for p in parts]), rtol=1e-5, atol=1e-6)
            covered.update(parts)
        assert covered == set(want)

