"""The SkyReels V2 adapter (text-to-video): the shared contract on a tiny SkyReels-V2-shaped model (videos and
images; exports round-trip into SkyReelsV2Pipeline in diffusers' and ComfyUI's Wan names), and a
diffusion-forcing checkpoint refused."""

import json

import pytest
import torch

from diffusion_pipe.config import ConfigError
from diffusion_pipe.models.skyreels_v2 import SkyReelsV2Adapter
from tests.models.contract import AdapterContract


class TestSkyReelsV2Contract(AdapterContract):
    adapter_cls = SkyReelsV2Adapter
    pipeline_cls = "SkyReelsV2Pipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 5))  # an image and a 5-frame video (Wan's VAE needs 4k+1 frames)
    roundtrip_formats = ("diffusers", "comfyui")

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        latents, t, text = inputs
        return denoiser(latents, t * 1000, text, return_dict=False)[0]


@pytest.mark.parametrize("change", [{"num_frame_per_block": 5}, {"inject_sample_info": True}])
def test_a_diffusion_forcing_checkpoint_is_refused(tmp_path, change):
    SkyReelsV2Adapter.build_tiny(tmp_path, seed=0)
    config = tmp_path / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **change}))
    with pytest.raises(ConfigError, match="diffusion-forcing checkpoint"):
        SkyReelsV2Adapter(tmp_path, torch.float32)
