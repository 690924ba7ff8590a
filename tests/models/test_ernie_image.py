"""The ERNIE-Image adapter: the shared contract on a tiny ERNIE-Image-shaped model (exports round-trip into
ErnieImagePipeline in diffusers' names and in the `diffusion_model.` names ComfyUI reads), its text entries as the
pipeline encodes them, and its latents as the pipeline un-normalises them."""

import torch

from diffusion_pipe.models.ernie_image import ErnieImageAdapter
from tests.models.contract import AdapterContract


class TestErnieImageContract(AdapterContract):
    adapter_cls = ErnieImageAdapter
    pipeline_cls = "ErnieImagePipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 1))
    roundtrip_formats = ("diffusers", "comfyui")

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        hidden, t, text, lens = inputs
        return denoiser(hidden_states=hidden, timestep=t, text_bth=text, text_lens=lens, return_dict=False)[0]

    def test_text_entries_are_the_pipelines_states_padded_with_their_length(self, adapter):
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        (short, long) = adapter.encode_text(encoders, ["a cat", "a red circle on a white background"], 16)
        states = encoders.pipeline.encode_prompt(["a cat"], device=torch.device("cpu"))[0]
        assert int(short["text_len"]) == len(states) < int(long["text_len"])
        assert torch.equal(short["text"][:len(states)], states) and short["text"][len(states):].abs().sum() == 0

    def test_padding_changes_no_prediction(self, adapter, lora_model):
        """The transformer masks text past each caption's length and places image tokens after it: the same
        caption padded to 16 or 24 tokens gives the same prediction."""
        denoiser, _ = lora_model
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        latents = torch.randn(1, *adapter.latent_spec(32, 32, 1)["latents"][0])
        outs = []
        for length in (16, 24):
            (entry,) = adapter.encode_text(encoders, ["a red circle"], length)
            inputs = adapter.model_inputs(latents, torch.tensor([0.4]), {k: v[None] for k, v in entry.items()}, 1.0)
            with torch.no_grad():
                outs.append(self.unsplit_forward(adapter, denoiser, inputs, latents))
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-5)

    def test_stored_latents_decode_as_the_pipeline_decodes_them(self, adapter):
        """ErnieImagePipeline un-normalises by the batch-norm statistics and unpatchifies before decoding: that of
        a stored entry is the VAE's own latent of the image."""
        vae = adapter.load_vae(torch.device("cpu"))
        pixels = torch.rand(1, 3, 1, 32, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
        (entry,) = adapter.encode_media(vae, pixels)
        stored = entry["latents"][None]
        mean = vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + 1e-5)
        from diffusers import ErnieImagePipeline

        raw = ErnieImagePipeline._unpatchify_latents(stored * std + mean)
        torch.testing.assert_close(raw, vae.encode(pixels[:, :, 0]).latent_dist.mode(), rtol=0, atol=1e-5)
