"""The Wan 2.2 TI2V adapter (image-to-video): the shared contract on a tiny TI2V-shaped model, the first layer's
inputs against what WanImageToVideoPipeline (expand_timesteps) feeds its transformer for an image, and the loss
covering only the frames after the clip's own first frame."""

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_pipe.models.wan_ti2v import WanTI2VAdapter
from tests.models.contract import AdapterContract, module_calls, random_like_spec


class TestWanTI2VContract(AdapterContract):
    adapter_cls = WanTI2VAdapter
    pipeline_cls = "WanPipeline"
    denoiser_attr = "transformer"
    media_sizes = ((64, 32, 1), (64, 32, 5))  # an image and a 5-frame clip (x16 VAE, 2x2 patches: 32 px)
    roundtrip_formats = ("diffusers", "comfyui")

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        latents, t, text = inputs
        return denoiser(latents, t * 1000, text, return_dict=False)[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("wan_ti2v")
    WanTI2VAdapter.build_tiny(out, seed=0)
    return out


def test_a_clips_first_latent_frame_is_its_first_frames_own_latent(model_dir):
    """Why no second store key: the 2.2 VAE is causal, so the condition WanImageToVideoPipeline encodes from an
    image equals the first latent frame of a clip starting with that image."""
    adapter = WanTI2VAdapter(model_dir, torch.float32)
    vae = adapter.load_vae(torch.device("cpu"))
    clip = torch.rand(1, 3, 5, 32, 64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    (whole,) = adapter.encode_media(vae, clip)
    (first,) = adapter.encode_media(vae, clip[:, :, :1])
    # equal up to float rounding: the convolutions run over inputs of other lengths (1 ulp apart on some CPUs)
    torch.testing.assert_close(whole["latents"][:, :1], first["latents"], rtol=0, atol=1e-6)
    assert not torch.allclose(whole["latents"][:, 1:2], first["latents"], atol=1e-2)  # a later frame is not it


def test_first_layer_inputs_are_what_the_i2v_pipeline_feeds_its_transformer(model_dir):
    """WanImageToVideoPipeline with expand_timesteps, given an image and initial latents, calls its transformer
    with the image's clean latent in frame 0 and timestep 0 on frame 0's tokens: keep_clean + model_inputs on
    the clip whose first frame is that image give exactly those inputs."""
    from diffusers import WanImageToVideoPipeline

    adapter = WanTI2VAdapter(model_dir, torch.float32)
    pipe = WanImageToVideoPipeline.from_pretrained(model_dir, torch_dtype=torch.float32, image_encoder=None,
                                                   image_processor=None, transformer_2=None, expand_timesteps=True)
    pipe.set_progress_bar_config(disable=True)
    rgb = (np.random.default_rng(0).random((32, 64, 3)) * 255).astype(np.uint8)
    pixels = torch.from_numpy(rgb).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1
    image_latent = adapter.normalise_latents(adapter.encode_media(adapter.load_vae(torch.device("cpu")),
                                                                  pixels)[0]["latents"])
    spec = adapter.latent_spec(64, 32, 5)
    noise = random_like_spec(spec, 1, seed=2)["latents"]
    text = random_like_spec(adapter.text_spec(16), 1, seed=3)
    with module_calls(pipe.transformer) as calls:
        pipe(image=Image.fromarray(rgb), prompt_embeds=text["t5"], height=32, width=64, num_frames=5,
             num_inference_steps=2, guidance_scale=1.0, latents=noise, output_type="latent")
    call = calls[0].kwargs
    clip = torch.cat((image_latent[None], torch.randn(1, *spec["latents"][0])[:, :, 1:]), dim=2)
    noisy, _ = adapter.keep_clean(noise, noise, clip)
    t = call["timestep"].max() / 1000
    ours = adapter.model_inputs(noisy, t.reshape(1), text, 1.0)
    assert torch.allclose(ours[0], call["hidden_states"], atol=1e-6)
    assert torch.allclose(ours[1] * 1000, call["timestep"], atol=1e-3)
    assert (ours[1][0, :2] == 0).all() and (ours[1][0, -2:] > 0).all()  # frame 0's tokens clean, the last not


def test_the_loss_covers_the_frames_after_the_first(model_dir):
    """A clip's target is its frames after the first, and the prediction is cut to them; an image trains whole."""
    adapter = WanTI2VAdapter(model_dir, torch.float32)
    latents, noise = torch.randn(2, 8, 2, 2, 4), torch.randn(2, 8, 2, 2, 4)
    noisy, target = adapter.keep_clean(noise, noise - latents, latents)
    assert target.shape == (2, 8, 1, 2, 4) and torch.equal(noisy[:, :, 0], latents[:, :, 0])
    tokens = torch.randn(2, 2 * 1 * 2, 8 * 4)  # a prediction for both latent frames
    whole = adapter.prediction_to_latents(tokens, latents)
    assert whole.shape == latents.shape
    assert torch.equal(adapter.prediction_to_latents(tokens, target), whole[:, :, 1:])  # the generated frames'
    image = torch.randn(2, 8, 1, 2, 4)
    assert torch.equal(adapter.keep_clean(image, image, image)[1], image)
