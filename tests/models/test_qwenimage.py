"""The Qwen-Image adapter: the shared contract on a tiny Qwen-Image-shaped model (both export formats load into
QwenImagePipeline), the system-prompt template in the text key, and text padding that changes nothing."""

import pytest
import torch

from diffusion_pipe.models.flux import unpack_latents
from diffusion_pipe.models.qwenimage import QwenImageAdapter
from tests.models.contract import AdapterContract


class TestQwenImageContract(AdapterContract):
    adapter_cls = QwenImageAdapter
    pipeline_cls = "QwenImagePipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 1))
    roundtrip_formats = ("diffusers", "comfyui")

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        grid = [[tuple(g) for g in inputs[4][0].tolist()]] * inputs[0].shape[0]
        full = denoiser(hidden_states=inputs[0], timestep=inputs[1], encoder_hidden_states=inputs[2],
                        encoder_hidden_states_mask=inputs[3], img_shapes=grid, return_dict=False)[0]
        return unpack_latents(full, like.shape[-2], like.shape[-1])

    def test_template_is_dropped_exactly_and_keys_the_text(self, adapter):
        """The tiny tokenizer spends 34 tokens on the pipeline's template, as Qwen's does, so the pipeline's
        drop of 34 tokens keeps exactly the caption's; and the template is part of what keys a text entry."""
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        pipe = encoders.pipeline
        prefix = pipe.prompt_template_encode.split("{}")[0]
        assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
        (entry,) = adapter.encode_text(encoders, ["a red circle"], 16)
        suffix = pipe.prompt_template_encode.split("{}")[1]
        kept = len(pipe.tokenizer("a red circle" + suffix).input_ids)
        assert entry["prompt_mask"].tolist() == [1] * kept + [0] * (16 - kept)
        assert "Describe the image" in adapter.text_template()

    def test_padding_to_max_length_changes_no_prediction(self, adapter, lora_model):
        """A caption padded to 16 or 24 tokens predicts the same latents (padding is masked and keeps the
        caption tokens' rotary positions)."""
        denoiser, _ = lora_model
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        latents = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(0))
        outs = []
        for length in (16, 24):
            (text,) = adapter.encode_text(encoders, ["a red circle"], length)
            inputs = adapter.model_inputs(latents, torch.tensor([0.5]), {k: v[None] for k, v in text.items()}, 1.0)
            with torch.no_grad():
                outs.append(self.unsplit_forward(adapter, denoiser, inputs, latents))
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> QwenImageAdapter:
    out = tmp_path_factory.mktemp("qwenimage")
    QwenImageAdapter.build_tiny(out, seed=0)
    return QwenImageAdapter(out, torch.float32)


def test_comfyui_names_are_comfyuis_own(tiny):
    """ComfyUI's Qwen-Image model keeps diffusers' module names: the file is `diffusion_model.<name>` with
    lora_down/lora_up and `.alpha` (comfy/lora.py model_lora_keys_unet maps every `diffusion_model.` weight)."""
    lora = {"transformer_blocks.0.img_mlp.net.0.proj.lora_A.weight": torch.ones(4, 32),
            "transformer_blocks.0.img_mlp.net.0.proj.lora_B.weight": torch.ones(128, 4)}
    out = tiny.export_lora(lora, "comfyui")
    prefix = "diffusion_model.transformer_blocks.0.img_mlp.net.0.proj"
    assert set(out) == {f"{prefix}.lora_down.weight", f"{prefix}.lora_up.weight", f"{prefix}.alpha"}
    assert out[f"{prefix}.alpha"].item() == 4.0


def test_samples_render_from_stored_embeddings(tiny):
    cpu = torch.device("cpu")
    text, negative = tiny.encode_text(tiny.load_text_encoders(cpu), ["a red circle", ""], 16)
    pipe = tiny.sample_pipeline(tiny.load_denoiser(cpu), tiny.load_vae(cpu))
    assert type(pipe).__name__ == "QwenImagePipeline" and pipe.text_encoder is None
    image = pipe(height=32, width=32, num_inference_steps=2, output_type="np",
                 generator=torch.Generator().manual_seed(0), **tiny.sample_inputs(text, negative, 1.0, 4.0)).images
    assert image.shape == (1, 32, 32, 3) and bool(torch.isfinite(torch.from_numpy(image)).all())


def test_edit_transformers_are_refused(tiny):
    denoiser = tiny.load_denoiser(torch.device("cpu"))
    denoiser.register_to_config(zero_cond_t=True)
    with pytest.raises(ValueError, match="edit or layered transformer .* text-to-image model only"):
        tiny.pipeline_layers(denoiser)


def test_the_template_keys_text_entries(tiny):
    """encode keys a caption's text entry by the family's template too: another template, another key."""
    from diffusion_pipe.encode.encode import caption_text_keys
    from diffusion_pipe.params import ModelParams

    class OtherTemplate(QwenImageAdapter):
        def text_template(self) -> str:
            return "another system prompt"

    model = ModelParams(family="qwenimage", path=str(tiny.model_dir), dtype="float32")
    ours = caption_text_keys(tiny, model, 16, ("a cat",))
    other = caption_text_keys(OtherTemplate(tiny.model_dir, torch.float32), model, 16, ("a cat",))
    assert ours["a cat"] != other["a cat"]
