"""The Kandinsky 5 Video adapter: the shared contract on a tiny Kandinsky 5.0 T2V-shaped model (videos and images)
with captions of different lengths in a micro-batch (each runs on its own tokens, as the pipeline feeds its
transformer one prompt), the first layer's inputs against what Kandinsky5T2VPipeline feeds its transformer, text
entries as the pipeline encodes a prompt, samples of several prompts, bf16 as training holds it, the ComfyUI file,
and what is refused. `test_kandinsky5_image.py` runs the same class on the image family."""

import json
import shutil

import pytest
import torch

from diffusion_pipe.config import ConfigError
from diffusion_pipe.models.kandinsky5 import Kandinsky5Adapter, by_caption_length, caption_groups
from tests.models.comfyui_merge import assert_comfyui_merge_matches
from tests.models.contract import AdapterContract, expected_deltas, module_calls, random_like_spec


def pipeline_rope_scale(adapter, height: int, width: int) -> tuple:
    """The rotary scale the family's pipeline passes its transformer at height x width pixels (the T2V pipeline's
    rule; the T2I pipeline passes (1, 1, 1))."""
    from diffusers import Kandinsky5T2VPipeline

    if adapter.pipeline_name == "Kandinsky5T2IPipeline":
        return (1.0, 1.0, 1.0)
    return Kandinsky5T2VPipeline._get_scale_factor(None, height, width)


def prefix_masks(inputs: tuple, lengths: list[int]) -> tuple:
    """The model inputs with text masks of the given caption lengths (the stored entries' layout)."""
    latents, t, qwen, mask, pooled = inputs
    mask = (torch.arange(mask.shape[1]) < torch.tensor(lengths)[:, None]).long()
    return latents, t, qwen, mask, pooled


class TestKandinsky5Contract(AdapterContract):
    adapter_cls = Kandinsky5Adapter
    pipeline_cls = "Kandinsky5T2VPipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 5))  # an image and a 5-frame video (its VAE needs 4k+1 frames)
    roundtrip_formats = ("diffusers",)  # the comfyui file's keys are ComfyUI's (test below), not the loader's
    pipeline_load_kwargs = {"tokenizer": None}  # transformers builds the stock processor only with torchvision
    bad_frames = (3, "4k\\+1 frames")
    template_words = "Describe the video"
    pipeline_size = (480, 480, 5)  # a size the pipeline gives the rotary scale (1, 2, 2); the others' is 3.16

    def _inputs(self, adapter, batch: int = 2, seed: int = 0, conditioning_seed: int = 100):
        """Captions of different lengths (the full length and shorter ones) in one micro-batch."""
        latents, noised, inputs = super()._inputs(adapter, batch, seed, conditioning_seed)
        lengths = [max(1, self.text_max_length - 5 * i) for i in range(batch)]
        return latents, noised, prefix_masks(inputs, lengths)

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        """Kandinsky5Transformer3DModel.forward on each item alone with its caption's tokens, as the pipeline calls
        it for one prompt (rotary positions of the patch grid and of the caption, the pipeline's rotary scale)."""
        latents, t, qwen, mask, pooled = inputs
        _, f, h, w, _ = latents.shape
        pt, ph, pw = denoiser.config.patch_size
        grid = [torch.arange(f // pt), torch.arange(h // ph), torch.arange(w // pw)]
        scale = pipeline_rope_scale(adapter, h * adapter.vae_scale, w * adapter.vae_scale)
        outs = []
        for i in range(len(latents)):
            n = int(mask[i].sum())
            outs.append(denoiser(hidden_states=latents[i:i + 1], encoder_hidden_states=qwen[i:i + 1, :n],
                                 timestep=t[i:i + 1], pooled_projections=pooled[i:i + 1], visual_rope_pos=grid,
                                 text_rope_pos=torch.arange(n), scale_factor=scale, return_dict=False))
        return adapter.prediction_to_latents(torch.cat(outs), like)

    def test_frames_are_checked(self, adapter):
        vae = adapter.load_vae(torch.device("cpu"))
        frames, message = self.bad_frames
        with pytest.raises(ValueError, match=message):
            adapter.encode_media(vae, torch.zeros(1, 3, frames, 32, 32))

    def test_text_entries_are_the_pipelines_prompt_alone(self, adapter):
        """Each entry is the pipeline's encode_prompt of that caption alone (the template dropped exactly: the
        caption's tokens come first), zero-padded with its mask; a batch of captions encodes each as alone; a long
        caption is cut to the length, as the pipeline cuts it; the template keys the entries."""
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        pipe = encoders.pipeline
        captions = ["a red circle", "a blue square on a white background", "a cat " * 30]
        entries = adapter.encode_text(encoders, captions, 16)
        for caption, entry in zip(captions, entries):
            qwen, pooled, cu = pipe.encode_prompt([caption], max_sequence_length=16, device=torch.device("cpu"))
            n = qwen.shape[1]
            assert int(cu[-1]) == n and entry["qwen_mask"].tolist() == [1] * n + [0] * (16 - n)
            assert torch.equal(entry["qwen"][:n], qwen[0]) and entry["qwen"][n:].abs().sum() == 0
            assert torch.equal(entry["clip_pooled"], pooled[0])
            alone = adapter.encode_text(encoders, [caption], 16)[0]
            assert all(torch.equal(alone[k], entry[k]) for k in entry)
        ids = pipe.tokenizer(text=[pipe.prompt_template.format("a red circle")], images=None, videos=None,
                             return_tensors="pt")["input_ids"][0]
        assert pipe.tokenizer.decode(ids[pipe.prompt_template_encode_start_idx:][:3]) == "a red circle"
        assert int(entries[2]["qwen_mask"].sum()) == 16
        template = json.loads(adapter.text_template())
        assert self.template_words in template["template"]
        assert template["drop_tokens"] == pipe.prompt_template_encode_start_idx

    def test_padding_and_batchmates_change_no_prediction(self, adapter, lora_model):
        """A caption padded to 16 or 24 tokens, alone or beside a longer one, predicts the same latents."""
        denoiser, _ = lora_model
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        width, height, frames = self.media_sizes[-1]
        latents = random_like_spec(adapter.latent_spec(width, height, frames), 2, 3)["latents"]
        outs = []
        for length, captions in ((16, ["a red circle"]), (24, ["a red circle"]),
                                 (24, ["a red circle", "a blue square on a white background"])):
            entries = adapter.encode_text(encoders, captions, length)
            text = {k: torch.stack([e[k] for e in entries]) for k in entries[0]}
            x = adapter.model_inputs(latents[:len(captions)], torch.tensor([0.4, 0.7])[:len(captions)], text, 1.0)
            with torch.no_grad():
                for layer in adapter.pipeline_layers(denoiser):
                    x = layer(x)
            outs.append(adapter.prediction_to_latents(x, latents)[:1])
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)
        # Beside a batchmate the matmuls run at batch 2, whose float32 kernels may sum in another order than at
        # batch 1 (5e-5 apart on one CI machine, 5e-7 on another); padding leaking into the attention moves the
        # prediction by about 0.3.
        torch.testing.assert_close(outs[0], outs[2], rtol=0, atol=1e-3)

    def test_first_layer_inputs_are_what_the_pipeline_feeds_its_transformer(self, adapter, model_dir):
        """The family's diffusers pipeline, given latents and a stored entry, calls its transformer with the
        adapter's first-layer inputs (channels-last latents with any visual condition, t x 1000, the caption's
        tokens, CLIP's pooled embedding), and the composed layers predict what its transformer does."""
        import diffusers

        pipe = getattr(diffusers, adapter.pipeline_name).from_pretrained(
            model_dir, text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None, dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        (entry,) = adapter.encode_text(encoders, ["a red circle"], 16)
        n = int(entry["qwen_mask"].sum())
        width, height, frames = self.pipeline_size
        noisy = random_like_spec(adapter.latent_spec(width, height, frames), 1, 5)["latents"]
        text = {k: v[None] for k, v in entry.items()}
        with module_calls(pipe.transformer, copy=True) as calls:  # copies: the pipeline steps its latents in place
            pipe(prompt_embeds_qwen=entry["qwen"][None, :n], prompt_embeds_clip=entry["clip_pooled"][None],
                 prompt_cu_seqlens=torch.tensor([0, n], dtype=torch.int32), guidance_scale=1.0, height=height,
                 width=width, num_inference_steps=1, output_type="latent",
                 latents=adapter.model_inputs(noisy, torch.zeros(1), text, 1.0)[0],
                 **({"num_frames": frames} if "video" in adapter.capabilities.media else {}))
        call = calls[0].kwargs
        inputs = adapter.model_inputs(noisy, call["timestep"] / 1000, text, 1.0)
        assert torch.equal(call["hidden_states"], inputs[0])
        torch.testing.assert_close(call["timestep"], inputs[1])
        assert torch.equal(call["encoder_hidden_states"], inputs[2][:, :n])
        assert torch.equal(call["pooled_projections"], inputs[4])
        x = inputs
        with torch.no_grad():
            for layer in adapter.pipeline_layers(pipe.transformer):
                x = layer(x)
            want = pipe.transformer(**call).sample
        torch.testing.assert_close(x, want, rtol=0, atol=1e-5)

    def test_stored_latents_are_what_the_pipeline_decodes(self, adapter):
        """The pipeline divides its latents by the VAE's scaling_factor before decoding, and shifts nothing: that
        of a normalised stored entry is the VAE's own latent."""
        vae = adapter.load_vae(torch.device("cpu"))
        width, height, frames = self.media_sizes[-1]
        pixels = torch.rand(1, 3, frames, height, width, generator=torch.Generator().manual_seed(0)) * 2 - 1
        (entry,) = adapter.encode_media(vae, pixels)
        stored = entry["latents"][None]
        torch.testing.assert_close(adapter.normalise_latents(stored) / vae.config.scaling_factor, stored)
        assert not torch.equal(adapter.normalise_latents(stored), stored)

    def test_samples_render_each_prompt_on_its_own_tokens(self, adapter, lora_model):
        """Two prompts of different lengths rendered in one call (as prompts of one size are) equal each
        rendered alone from its own seed."""
        import numpy as np

        cpu = torch.device("cpu")
        encoders = adapter.load_text_encoders(cpu)
        entries = adapter.encode_text(encoders, ["a red circle", "a blue square on a white background", ""], 16)
        pipe = adapter.sample_pipeline(lora_model[0], adapter.load_vae(cpu))
        calls = [adapter.sample_inputs(entries[i], entries[2], 3.0, 1.0) for i in (0, 1)]
        frames = {"num_frames": 5} if "video" in adapter.capabilities.media else {}

        def render(members: list[int]) -> np.ndarray:
            kwargs = {k: torch.cat([calls[i][k] for i in members]) if isinstance(calls[0][k], torch.Tensor)
                      else calls[0][k] for k in calls[0]}
            out = pipe(height=32, width=32, num_inference_steps=2, output_type="np", **frames, **kwargs,
                       generator=[torch.Generator().manual_seed(10 + i) for i in members])
            return np.asarray(out.frames if hasattr(out, "frames") else out.images)

        both = render([0, 1])
        assert np.allclose(both[0], render([0])[0], atol=1e-6) and np.allclose(both[1], render([1])[0], atol=1e-6)
        assert not np.allclose(both[0], both[1])

    def test_bfloat16_as_training_holds_it(self, model_dir):
        """Training holds every weight in model.dtype (diffusers keeps the time embedding in float32): the layers
        built as training builds them, and the transformer's own forward that samples run, work in bfloat16."""
        from diffusion_pipe.train.build import build_local_model

        adapter = self.adapter_cls(model_dir, torch.bfloat16)
        local = build_local_model(adapter, 1, 0, targets=adapter.default_lora_targets, rank=4, alpha=4.0,
                                  dropout=0.0, seed=0)
        latents, _, inputs = self._inputs(adapter)
        x = inputs
        with torch.no_grad():
            for layer in local.layers:
                x = layer(x)
            full = self.unsplit_forward(adapter, local.denoiser, inputs, latents)
        out = adapter.prediction_to_latents(x, latents)
        assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out).all())
        torch.testing.assert_close(out, full, rtol=0, atol=0)

    def test_comfyui_file_merges_as_comfyui_merges_it(self, adapter, lora_model):
        """ComfyUI's Kandinsky 5 model (comfy/ldm/kandinsky5/model.py) names its modules as diffusers does: the
        file merged into those weights as ComfyUI merges (W += alpha / rank * up @ down) is the LoRA merged."""
        exported = assert_comfyui_merge_matches(adapter, dict, dict)
        _, lora = lora_model
        out = adapter.export_lora(lora, "comfyui")
        base = "diffusion_model.visual_transformer_blocks.0.cross_attention.to_key"
        assert out[f"{base}.alpha"].item() == 4.0 and out[f"{base}.lora_down.weight"].shape[0] == 4
        assert {k.rsplit(".", 2)[0] for k in out if k.endswith(".lora_down.weight")} == {
            f"diffusion_model.{m}" for m in expected_deltas(lora)}
        assert all(k.startswith("diffusion_model.") for k in exported)

    def test_nabla_attention_is_refused(self, adapter, model_dir, tmp_path):
        d = tmp_path / "nabla"
        shutil.copytree(model_dir, d)
        config = json.loads((d / "transformer" / "config.json").read_text())
        (d / "transformer" / "config.json").write_text(json.dumps({**config, "attention_type": "nabla"}))
        nabla = self.adapter_cls(d, torch.float32)
        with pytest.raises(ConfigError, match="attention_type 'nabla' .*NABLA"):
            nabla.pipeline_layers(nabla.load_denoiser(torch.device("cpu")))

    def test_the_other_kandinsky_pipeline_is_refused(self, adapter, model_dir, tmp_path):
        """A model whose model_index.json names another pipeline (the image model given to the video family, or
        the reverse) is refused naming model.family."""
        d = tmp_path / "other"
        shutil.copytree(model_dir, d)
        index = json.loads((d / "model_index.json").read_text())
        other = {"Kandinsky5T2VPipeline": "Kandinsky5T2IPipeline"}.get(adapter.pipeline_name, "Kandinsky5T2VPipeline")
        (d / "model_index.json").write_text(json.dumps({**index, "_class_name": other}))
        with pytest.raises(ConfigError, match=f"is a {other} model; .*set model.family"):
            self.adapter_cls(d, torch.float32).text_template()

    def test_text_longer_than_the_rotary_table_is_refused(self, adapter):
        with pytest.raises(ConfigError, match="encode.text_max_length: 1025 .* at most 1024"):
            adapter.text_spec(1025)


def test_caption_groups_and_their_order():
    """Items grouped by caption length, shortest first; a (B, 1) mask is one group of all; results come back in
    the micro-batch's order."""
    mask = (torch.arange(6) < torch.tensor([4, 2, 4])[:, None]).long()
    groups = caption_groups(mask, 6)
    assert [(n, items.tolist()) for n, items in groups] == [(2, [1]), (4, [0, 2])]
    assert caption_groups(torch.ones(3, 1, dtype=torch.long), 5) == [(5, slice(None))]
    values = torch.tensor([10.0, 20.0, 30.0])
    out = by_caption_length(lambda items, n: values[items] + n, groups)
    assert out.tolist() == [14.0, 22.0, 34.0]
