"""The Wan 2.2 I2V-A14B adapter (image-to-video): the shared contract on a tiny I2V-shaped model, the condition
latent its rule encodes against the one WanImageToVideoPipeline encodes from the same image, the first layer's
inputs against what the pipeline feeds its transformer, and a Wan 2.1 I2V checkpoint (CLIP) refused."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_pipe.config import ConfigError
from diffusion_pipe.models.wan_i2v import WanI2VAdapter
from tests.models.contract import AdapterContract, module_calls, random_like_spec


class TestWanI2VContract(AdapterContract):
    adapter_cls = WanI2VAdapter
    pipeline_cls = "WanImageToVideoPipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 5), (48, 32, 9))  # clips only: the family generates a clip from its first frame
    roundtrip_formats = ("diffusers", "comfyui")

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        latents, t, text = inputs
        return denoiser(latents, t * 1000, text, return_dict=False)[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("wan_i2v")
    WanI2VAdapter.build_tiny(out, seed=0)
    return out


@pytest.fixture(scope="module")
def pipe(model_dir):
    from diffusers import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline.from_pretrained(model_dir, torch_dtype=torch.float32, image_encoder=None,
                                                   image_processor=None, transformer_2=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).random((32, 48, 3)) * 255).astype(np.uint8)


def _condition_by_rule(adapter, rgb: np.ndarray, frames: int) -> torch.Tensor:
    """The condition latent as training gets it: the first frame in [-1, 1], the rule, the VAE, normalised."""
    first = torch.from_numpy(rgb).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1
    pixels = adapter.conditioning_pixels(first, frames)
    (entry,) = adapter.encode_media(adapter.load_vae(torch.device("cpu")), pixels)
    return adapter.normalise_latents(entry["latents"])


def test_the_rules_condition_latent_is_the_pipelines(model_dir, pipe):
    """The stored condition (first frame + black frames, through the VAE, normalised) is the latent the pipeline
    builds from the same image, and its mask channels are the pipeline's."""
    adapter = WanI2VAdapter(model_dir, torch.float32)
    rgb = _image()
    image = pipe.video_processor.preprocess(Image.fromarray(rgb), height=32, width=48)
    _, condition = pipe.prepare_latents(image, 1, 16, 32, 48, 9, torch.float32, torch.device("cpu"),
                                        torch.Generator().manual_seed(0))
    ours = _condition_by_rule(adapter, rgb, 9)
    assert condition.shape == (1, 4 + 16, 3, 4, 6)
    torch.testing.assert_close(ours, condition[0, 4:], rtol=0, atol=1e-5)
    noisy = torch.zeros(1, 16, 3, 4, 6)
    first_layer = adapter.conditioned_inputs(noisy, torch.tensor([0.5]), {"t5": torch.zeros(1, 16, 32)}, 1.0,
                                             (ours[None],))[0]
    assert torch.equal(first_layer[:, 16:20], condition[:, :4])  # the mask: 1 on the first latent frame only
    # a later latent frame of the condition is not the first frame's own latent (the black frames count)
    (alone,) = adapter.encode_media(adapter.load_vae(torch.device("cpu")),
                                    torch.from_numpy(rgb).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1)
    torch.testing.assert_close(ours[:, :1], adapter.normalise_latents(alone["latents"]), rtol=0, atol=1e-5)


def test_first_layer_inputs_are_what_the_pipeline_feeds_its_transformer(model_dir, pipe):
    """Given an image and initial latents, the pipeline calls its transformer on [latents, mask, condition] with
    the step's timestep: conditioned_inputs on the same latents and the rule's condition give exactly those."""
    adapter = WanI2VAdapter(model_dir, torch.float32)
    rgb = _image(1)
    spec = adapter.latent_spec(48, 32, 9)
    noise = random_like_spec(spec, 1, seed=2)["latents"]
    text = random_like_spec(adapter.text_spec(16), 1, seed=3)
    with module_calls(pipe.transformer) as calls:
        pipe(image=Image.fromarray(rgb), prompt_embeds=text["t5"], height=32, width=48, num_frames=9,
             num_inference_steps=2, guidance_scale=1.0, latents=noise, output_type="latent")
    call = calls[0].kwargs
    t = call["timestep"] / 1000
    ours = adapter.conditioned_inputs(noise, t, text, 1.0, (_condition_by_rule(adapter, rgb, 9)[None],))
    assert ours[0].shape == call["hidden_states"].shape == (1, 36, 3, 4, 6)
    torch.testing.assert_close(ours[0], call["hidden_states"], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours[1] * 1000, call["timestep"].float(), rtol=0, atol=1e-3)
    assert call.get("encoder_hidden_states_image") is None  # A14B: no CLIP image embedding


def test_a_wan21_i2v_checkpoint_with_clip_is_refused(tmp_path):
    """Wan 2.1 I2V's transformer takes a CLIP image embedding this family does not encode: a clear error naming
    the family that does, not a model trained without it."""
    WanI2VAdapter.build_tiny(tmp_path, seed=0)
    config = tmp_path / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "image_dim": 1280}))
    with pytest.raises(ConfigError, match="Wan 2.1 I2V checkpoint .*image_dim.*set model.family to 'wan21_i2v'"):
        WanI2VAdapter(tmp_path, torch.float32)
