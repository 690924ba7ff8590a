"""The Qwen-Image-Edit adapter: the shared contract on tiny Edit and Edit-2511 models (control tokens after the
target's through every layer; 2511's zero_cond_t modulation), the first layer's inputs against what the edit
pipelines feed their transformers, and the text entry read with its control image as the pipeline reads it."""

import pytest
import torch

from diffusion_pipe.config import ConfigError
from diffusion_pipe.models.flux import unpack_latents
from diffusion_pipe.models.qwenimage_edit import QwenImageEditAdapter
from tests.models.contract import AdapterContract, module_calls, random_like_spec


class TestQwenImageEditContract(AdapterContract):
    adapter_cls = QwenImageEditAdapter
    pipeline_cls = "QwenImageEditPipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 1))
    roundtrip_formats = ("diffusers", "comfyui")
    text_max_length = 32  # the caption's tokens and the control image's 4 vision tokens
    pipeline_load_kwargs = {"processor": None}  # transformers builds the stock processor only with torchvision

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        grid = [[tuple(g) for g in inputs[4][0].tolist()]] * inputs[0].shape[0]
        full = denoiser(hidden_states=inputs[0], timestep=inputs[1], encoder_hidden_states=inputs[2],
                        encoder_hidden_states_mask=inputs[3], img_shapes=grid, return_dict=False)[0]
        height, width = like.shape[-2:]
        return unpack_latents(full[:, :(height // 2) * (width // 2)], height, width)


class TestQwenImageEdit2511Contract(TestQwenImageEditContract):
    """Edit-2511's layout: QwenImageEditPlusPipeline, a transformer with zero_cond_t."""

    pipeline_cls = "QwenImageEditPlusPipeline"

    @pytest.fixture(scope="class")
    def model_dir(self, tmp_path_factory):
        out = tmp_path_factory.mktemp("qwenimage_edit_2511")
        QwenImageEditAdapter.build_tiny(out, seed=0, plus=True)
        return out

    def test_registry_entry(self):
        pass  # the same family as the class above

    def test_build_tiny_is_deterministic_under_seed(self, adapter, tmp_path):
        pass  # build_tiny's default (plus=False) is the class above's


@pytest.fixture(scope="module", params=[False, True], ids=["edit", "edit-2511"])
def tiny(request, tmp_path_factory) -> QwenImageEditAdapter:
    out = tmp_path_factory.mktemp("qwenimage_edit")
    QwenImageEditAdapter.build_tiny(out, seed=0, plus=request.param)
    return QwenImageEditAdapter(out, torch.float32)


def test_first_layer_inputs_are_what_the_pipeline_feeds_its_transformer(tiny):
    """The edit pipeline, given the control image as latents and the prompt as embeddings, calls its transformer
    with the noisy target's tokens then the control's and both images' shapes: the adapter's inputs are those, and
    the composed layers predict what the transformer does (2511: its control tokens under timestep 0)."""
    import diffusers
    from PIL import Image

    pipe = getattr(diffusers, tiny.pipeline_name()).from_pretrained(tiny.model_dir, processor=None,
                                                                   dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    spec = tiny.latent_spec(48, 32, 1)
    control = random_like_spec(spec, 1, seed=1)["latents"]  # normalised, as training feeds it
    noisy = random_like_spec(spec, 1, seed=2)["latents"]
    text = random_like_spec(tiny.text_spec(8), 1, seed=3)
    text["prompt_mask"] = torch.ones(1, 8, dtype=torch.long)
    with module_calls(pipe.transformer) as calls:
        pipe(image=Image.new("RGB", (48, 32)), prompt_embeds=text["prompt_embeds"],
             prompt_embeds_mask=text["prompt_mask"], height=32, width=48, num_inference_steps=1,
             latents=tiny.model_inputs(noisy, torch.zeros(1), text, 1.0)[0], output_type="latent")
    call = calls[0].kwargs
    # the pipeline encodes the control image at about 1 MP (its aspect ratio kept): give ours that latent
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    width, height = calculate_dimensions(1024 * 1024, 48 / 32)[:2]
    control = pipe._encode_vae_image(pipe.image_processor.preprocess(Image.new("RGB", (48, 32)), height, width)
                                     .unsqueeze(2), None)[:, :, 0]
    ours = tiny.conditioned_inputs(noisy, call["timestep"], text, 1.0, (control,))
    torch.testing.assert_close(ours[0], call["hidden_states"])  # target tokens, then the control's
    assert [[tuple(g) for g in ours[4][0].tolist()]] == [[tuple(s) for s in call["img_shapes"][0]]]
    assert ours[0].shape[1] == (32 // 16) * (48 // 16) + (height // 16) * (width // 16)


def test_the_text_entry_reads_the_control_image(tiny):
    """The same caption read with two control images gives two entries (the VL encoder sees the image), the same
    image twice the same entry; the entry is the pipeline's own encode_prompt of the caption with the image resized
    as the pipeline resizes its prompt image, padded; too short a max length names encode.text_max_length."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    from diffusion_pipe.models.qwenimage_edit import _pixels_to_pil

    encoders = tiny.load_text_encoders(torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    images = torch.rand(2, 3, 1, 32, 48, generator=g) * 2 - 1
    a, b = tiny.encode_conditioned_text(encoders, ["make it blue"] * 2, images, 32)
    again, = tiny.encode_conditioned_text(encoders, ["make it blue"], images[:1], 32)
    assert not torch.equal(a["prompt_embeds"], b["prompt_embeds"])
    assert torch.equal(a["prompt_embeds"], again["prompt_embeds"])
    pipe = encoders.pipeline
    image = _pixels_to_pil(images[0])
    width, height = calculate_dimensions(tiny._prompt_area(), 48 / 32)[:2]
    states, _ = pipe.encode_prompt(["make it blue"], image=[pipe.image_processor.resize(image, height, width)])
    n = states.shape[1]
    torch.testing.assert_close(a["prompt_embeds"][:n], states[0])
    assert a["prompt_mask"].tolist() == [1] * n + [0] * (32 - n)
    assert not a["prompt_embeds"][n:].any()
    with pytest.raises(ConfigError, match="encode.text_max_length: 8 .* set it to at least"):
        tiny.encode_conditioned_text(encoders, ["make it blue"], images[:1], 8)
    with pytest.raises(ValueError, match="reads every caption with its control image"):
        tiny.encode_text(encoders, ["make it blue"], 32)


def test_the_pipeline_and_its_image_area_key_the_text(tiny):
    template = tiny.text_template()
    plus = tiny.pipeline_name() == "QwenImageEditPlusPipeline"
    assert ('"image_area": 147456' in template) == plus and ('"image_area": 1048576' in template) != plus
    assert "Picture" not in template or plus


def test_a_text_to_image_model_is_refused(tmp_path):
    from diffusion_pipe.models.qwenimage import QwenImageAdapter

    QwenImageAdapter.build_tiny(tmp_path, seed=0)
    with pytest.raises(ConfigError, match="model.path: .* is a QwenImagePipeline model; family 'qwenimage_edit'"):
        QwenImageEditAdapter(tmp_path, torch.float32).text_template()


def test_a_sample_prompts_text_is_keyed_by_its_control_image_as_a_captions(tiny, tmp_path):
    """A sample prompt's text read with its control image is keyed as a training caption read with the same image
    at the same size (so one store entry serves both), another control image or size gives another key, and a
    family that reads no image keys the text alone."""
    from PIL import Image

    from diffusion_pipe.encode.encode import caption_text_keys, sample_text_keys, text_image, text_keyer
    from diffusion_pipe.hashing import hash_file
    from diffusion_pipe.params import ModelParams, SamplePrompt
    from diffusion_pipe.sample.render import prompt_texts

    paths = []
    for i, colour in enumerate(((200, 30, 30), (30, 30, 200))):
        paths.append(tmp_path / f"c{i}.png")
        Image.new("RGB", (48, 32), colour).save(paths[-1])
    model = ModelParams(family="qwenimage_edit", path=str(tiny.model_dir), dtype="float32")
    prompts = (SamplePrompt("make it blue", control=str(paths[0]), width=48, height=32),
               SamplePrompt("make it blue", control=str(paths[1]), width=48, height=32),
               SamplePrompt("make it blue", control=str(paths[0]), width=32, height=32))
    keys = sample_text_keys(tiny, model, 32, prompt_texts(tiny, prompts))
    texts = [t for t in keys if t.text == "make it blue"]
    assert len(texts) == 3 and len({keys[t] for t in texts}) == 3
    caption_key = text_keyer(tiny, model, 32)("make it blue", text_image(hash_file(paths[0]), "48x32x1", "image"))
    assert keys[texts[0]._replace(control=str(paths[0]), width=48, height=32)] == caption_key
    assert caption_key != caption_text_keys(tiny, model, 32, ("make it blue",))["make it blue"]
