"""The Kandinsky 5 Image adapter: the Kandinsky 5 Video suite (the shared contract and what the family tests beyond
it) on a tiny Kandinsky 5.0 T2I-shaped model (Flux's VAE, no visual condition, Kandinsky5T2IPipeline's template
and rotary scale), images only."""

import torch

import tests.models.test_kandinsky5 as video
from diffusion_pipe.models.kandinsky5_image import Kandinsky5ImageAdapter


class TestKandinsky5ImageContract(video.TestKandinsky5Contract):
    adapter_cls = Kandinsky5ImageAdapter
    pipeline_cls = "Kandinsky5T2IPipeline"
    media_sizes = ((32, 32, 1), (48, 32, 1))
    bad_frames = (5, "images only")
    template_words = "Describe the image"
    pipeline_size = (1280, 768, 1)  # one of the sizes Kandinsky5T2IPipeline renders (it replaces others)

    def test_rope_scale_and_layout_are_the_image_pipelines(self, adapter):
        """Kandinsky5T2IPipeline's rotary scale is (1, 1, 1) at every size (the video pipeline's depends on it);
        its transformer takes no visual condition; its VAE's shift is not applied."""
        assert adapter.rope_scale(512, 768) == adapter.rope_scale(1024, 1024) == (1.0, 1.0, 1.0)
        latents = torch.randn(1, 4, 1, 4, 6)
        text = video.random_like_spec(adapter.text_spec(8), 1, 0)
        assert adapter.model_inputs(latents, torch.zeros(1), text, 1.0)[0].shape == (1, 1, 4, 6, 4)
        assert adapter.component_config("vae")["shift_factor"] != 0
