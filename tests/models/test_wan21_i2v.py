"""The Wan 2.1 I2V adapter (image-to-video with a CLIP image embedding): the shared contract on a tiny Wan 2.1
I2V-shaped model, the first layer's inputs against what WanImageToVideoPipeline feeds its transformer (the image
states embedded before the text's), the stored image embedding against the pipeline's `encode_image`, what keys
the text entries, and the refusals between this family and wan_i2v."""

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from diffusion_pipe.config import ConfigError
from diffusion_pipe.encode.media import to_unit_range
from diffusion_pipe.models.wan21_i2v import Wan21I2VAdapter
from diffusion_pipe.models.wan_i2v import WanI2VAdapter
from tests.models.contract import AdapterContract, module_calls, random_like_spec


class TestWan21I2VContract(AdapterContract):
    adapter_cls = Wan21I2VAdapter
    pipeline_cls = "WanImageToVideoPipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 5), (48, 32, 9))  # clips only: the family generates a clip from its first frame
    roundtrip_formats = ("diffusers", "comfyui")
    text_max_length = 512  # the transformer splits the image's states from the text's at 512

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        latents, t, text, image = inputs
        return denoiser(latents, t * 1000, text, encoder_hidden_states_image=image, return_dict=False)[0]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("wan21_i2v")
    Wan21I2VAdapter.build_tiny(out, seed=0)
    return out


@pytest.fixture(scope="module")
def adapter(model_dir):
    return Wan21I2VAdapter(model_dir, torch.float32)


@pytest.fixture(scope="module")
def encoders(adapter):
    return adapter.load_text_encoders(torch.device("cpu"))


@pytest.fixture(scope="module")
def pipe(model_dir):
    from diffusers import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline.from_pretrained(model_dir, dtype=torch.float32, transformer_2=None)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).random((32, 48, 3)) * 255).astype(np.uint8)


def _first_frame(rgb: np.ndarray) -> torch.Tensor:
    """The first frame as encode passes it: (1, C, 1, H, W) in [-1, 1], from its uint8 pixels."""
    return to_unit_range(torch.from_numpy(rgb).permute(2, 0, 1)[None, :, None])


def _condition_by_rule(adapter, rgb: np.ndarray, frames: int) -> torch.Tensor:
    pixels = adapter.conditioning_pixels(_first_frame(rgb), frames)
    (entry,) = adapter.encode_media(adapter.load_vae(torch.device("cpu")), pixels)
    return adapter.normalise_latents(entry["latents"])


def test_first_layer_inputs_are_what_the_pipeline_feeds_its_transformer(adapter, encoders, pipe):
    """Given an image, a prompt's embeddings and initial latents, the pipeline calls its transformer on [latents,
    mask, condition] with the CLIP states of the image, and its first block cross-attends to the embedded image
    states followed by the text's: the adapter's inputs from its stored entry are those, and its first layer
    gives the block exactly that context."""
    rgb = _image(1)
    noise = random_like_spec(adapter.latent_spec(48, 32, 9), 1, seed=2)["latents"]
    (text,) = adapter.encode_conditioned_text(encoders, ["a red square moving right"], _first_frame(rgb), 512)
    with module_calls(pipe.transformer) as calls, module_calls(pipe.transformer.blocks[0]) as block_calls:
        pipe(image=Image.fromarray(rgb), prompt_embeds=text["t5"][None], height=32, width=48, num_frames=9,
             num_inference_steps=2, guidance_scale=1.0, latents=noise, output_type="latent")
    call = calls[0].kwargs
    t = call["timestep"] / 1000
    ours = adapter.conditioned_inputs(noise, t, {k: v[None] for k, v in text.items()}, 1.0,
                                      (_condition_by_rule(adapter, rgb, 9)[None],))
    assert len(ours) == 4 and ours[0].shape == call["hidden_states"].shape == (1, 36, 3, 4, 6)
    torch.testing.assert_close(ours[0], call["hidden_states"], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours[1] * 1000, call["timestep"].float(), rtol=0, atol=1e-3)
    torch.testing.assert_close(ours[2], call["encoder_hidden_states"], rtol=0, atol=0)
    assert ours[3].shape == (1, 17, 32)
    torch.testing.assert_close(ours[3], call["encoder_hidden_states_image"], rtol=0, atol=1e-6)
    block_args, block_kwargs = block_calls[0].args, block_calls[0].kwargs
    context = block_args[1] if len(block_args) > 1 else block_kwargs["encoder_hidden_states"]
    with torch.no_grad():
        embedded = adapter.pipeline_layers(pipe.transformer)[0](ours)
    assert embedded[1].shape == context.shape == (1, 17 + 512, 24)
    torch.testing.assert_close(embedded[1], context, rtol=0, atol=1e-5)


def test_the_stored_image_embedding_is_the_pipelines_encode_image(adapter, encoders, pipe):
    """The entry's `image_embeds` is the pipeline's own `encode_image` (the CLIP encoder's penultimate states) of
    the first frame, as a user's pipeline computes it from that image; its t5 is Wan's text entry."""
    from diffusion_pipe.models.wan import WanAdapter, WanTextEncoder

    rgb = _image(3)
    (entry,) = adapter.encode_conditioned_text(encoders, ["a cat"], _first_frame(rgb), 512)
    with torch.no_grad():
        want = pipe.encode_image(Image.fromarray(rgb), torch.device("cpu"))
        hidden = pipe.image_encoder(**pipe.image_processor(images=Image.fromarray(rgb), return_tensors="pt"),
                                    output_hidden_states=True).hidden_states
    assert entry["image_embeds"].shape == want.shape[1:] == (17, 32)
    torch.testing.assert_close(entry["image_embeds"], want[0], rtol=0, atol=1e-6)
    assert not torch.allclose(entry["image_embeds"], hidden[-1][0], atol=1e-3)  # the penultimate, not the last
    (t5,) = WanAdapter.encode_text(adapter, WanTextEncoder(pipe.text_encoder, pipe.tokenizer), ["a cat"], 512)
    torch.testing.assert_close(entry["t5"], t5["t5"], rtol=0, atol=0)


def test_the_first_frame_changes_the_image_embedding_and_only_it(adapter, encoders):
    """Another first frame gives another image embedding and the same UMT5 states; the same frame the same entry;
    the frames of a batch are read each for its own caption."""
    frames = torch.cat([_first_frame(_image(4)), _first_frame(_image(5))])
    a, b = adapter.encode_conditioned_text(encoders, ["a dog", "a dog"], frames, 512)
    again, = adapter.encode_conditioned_text(encoders, ["a dog"], frames[:1], 512)
    other, = adapter.encode_conditioned_text(encoders, ["a dog"], frames[1:], 512)
    assert not torch.allclose(a["image_embeds"], b["image_embeds"], atol=1e-4)
    assert torch.equal(a["t5"], b["t5"])
    # Alone or in a batch of two: equal up to float32 rounding (the CPU's matmul kernels may block a batch of
    # one differently from a batch of two).
    assert all(torch.allclose(a[k], again[k], atol=1e-6) and torch.allclose(b[k], other[k], atol=1e-6) for k in a)
    with pytest.raises(ValueError, match="reads every caption with its first frame"):
        adapter.encode_text(encoders, ["a dog"], 512)


def test_the_image_encoder_and_what_the_pipeline_reads_key_the_text(adapter, model_dir, tmp_path):
    """A text key names the CLIP encoder's weights, its processor's settings and the hidden state read, which is
    the one WanImageToVideoPipeline.encode_image reads."""
    import inspect

    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPVisionModel

    from diffusion_pipe.encode.encode import text_image, text_keyer
    from diffusion_pipe.params import ModelParams

    template = json.loads(adapter.text_template())
    assert f"image_embeds.{template['image_embeds']}" in inspect.getsource(WanImageToVideoPipeline.encode_image)
    image = text_image("abc", "48x32x9", "video")

    def key(directory):
        model = ModelParams(family="wan21_i2v", path=str(directory), dtype="float32")
        return text_keyer(Wan21I2VAdapter(directory, torch.float32), model, 512)("a cat", image)

    other = tmp_path / "other"
    shutil.copytree(model_dir, other)
    assert key(other) == key(model_dir)
    clip = CLIPVisionModel.from_pretrained(other / "image_encoder")
    weight = next(p for n, p in clip.named_parameters() if n.endswith("post_layernorm.weight"))
    torch.nn.init.zeros_(weight)  # not read by the entry, but a weight of the encoder
    clip.save_pretrained(other / "image_encoder")
    assert key(other) != key(model_dir)
    shutil.rmtree(other / "image_encoder")
    shutil.copytree(model_dir / "image_encoder", other / "image_encoder")
    config = other / "image_processor" / "preprocessor_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "resample": 2}))
    assert key(other) != key(model_dir)


def test_a_text_length_other_than_512_is_refused(adapter, encoders):
    with pytest.raises(ConfigError, match="encode.text_max_length: 32; family 'wan21_i2v' needs 512"):
        adapter.text_spec(32)
    with pytest.raises(ConfigError, match="encode.text_max_length: 32; .* set it to 512"):
        adapter.encode_conditioned_text(encoders, ["a cat"], _first_frame(_image()), 32)


def test_wan_i2v_and_wan21_i2v_refuse_each_others_checkpoints(model_dir, tmp_path):
    """Each I2V family names the other for the other's checkpoint (the transformer's image_dim tells them
    apart); a first-last-frame checkpoint and an expert are refused too."""
    with pytest.raises(ConfigError, match=r"Wan 2\.1 I2V checkpoint .*image_dim.*set model.family to 'wan21_i2v'"):
        WanI2VAdapter(model_dir, torch.float32)
    WanI2VAdapter.build_tiny(tmp_path / "wan22", seed=0)
    with pytest.raises(ConfigError, match=r"Wan 2\.2 I2V checkpoint .*no CLIP image embedding, image_dim.*"
                                          r"set model.family to 'wan_i2v'"):
        Wan21I2VAdapter(tmp_path / "wan22", torch.float32)
    flf2v = tmp_path / "flf2v"
    shutil.copytree(model_dir, flf2v)
    config = flf2v / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "pos_embed_seq_len": 34}))
    with pytest.raises(ConfigError, match="FLF2V checkpoint .*pos_embed_seq_len"):
        Wan21I2VAdapter(flf2v, torch.float32)
    with pytest.raises(ConfigError, match="model.expert: 'high' is not an expert of family 'wan21_i2v'"):
        Wan21I2VAdapter(model_dir, torch.float32, expert="high")


def test_samples_render_as_the_pipeline_does_from_the_image_itself(adapter, encoders, pipe, tmp_path):
    """A sample renders from its stored text entry, whose CLIP states were read from the prompt's control image,
    with no image encoder loaded: the pixels WanImageToVideoPipeline gives when it encodes that image itself. Two
    prompts on one image render as one batch, each as it renders alone."""
    from diffusion_pipe.params import SamplePrompt
    from diffusion_pipe.sample.render import (control_image, encode_sample_texts, prompt_texts, render_prompts,
                                              sample_text)

    control = tmp_path / "first.png"
    Image.fromarray(_image(3)).save(control)
    prompts = tuple(SamplePrompt(text, seed=seed, width=48, height=32, frames=5, steps=2, guidance=2.0,
                                 control=str(control))
                    for text, seed in (("a red circle", 1), ("a blue square", 2)))
    cpu = torch.device("cpu")
    texts = encode_sample_texts(adapter, encoders, prompt_texts(adapter, prompts), 512)
    bare = adapter.sample_pipeline(pipe.transformer, pipe.vae)
    bare.set_progress_bar_config(disable=True)
    together = render_prompts(bare, adapter, prompts, texts, cpu)
    for prompt, batched in zip(prompts, together):
        (alone,) = render_prompts(bare, adapter, (prompt,), texts, cpu)
        assert np.abs(alone.astype(int) - batched.astype(int)).max() <= 1
    positive, negative = (texts[sample_text(adapter, prompts[0], t)]["t5"][None] for t in ("a red circle", ""))
    stock = pipe(image=control_image(str(control), 48, 32), prompt_embeds=positive, negative_prompt_embeds=negative,
                 guidance_scale=2.0, height=32, width=48, num_frames=5, num_inference_steps=2, output_type="np",
                 generator=torch.Generator("cpu").manual_seed(1)).frames[0]
    assert np.abs((np.clip(stock, 0, 1) * 255).round().astype(int) - together[0].astype(int)).max() <= 1
