"""The Flux.1 Kontext adapter: the shared contract on a tiny Kontext-shaped model (its control image's tokens with
the target's through every layer), the first layer's inputs against what FluxKontextPipeline itself feeds its
transformer, and samples refused with a clear message."""

import pytest
import torch

from diffusion_pipe.config import ConfigError
from diffusion_pipe.models.flux import unpack_latents
from diffusion_pipe.models.flux_kontext import FluxKontextAdapter
from tests.models.contract import AdapterContract, module_calls, random_like_spec


class TestFluxKontextContract(AdapterContract):
    adapter_cls = FluxKontextAdapter
    pipeline_cls = "FluxKontextPipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 1))
    # As for Flux: the pipeline's loader splits fused ComfyUI qkv LoRAs by Flux-dev's real widths, so a tiny
    # model's comfyui file is checked against diffusers' converter in tests/export/test_comfyui_flux.py (the
    # same export code: Kontext inherits Flux's).
    roundtrip_formats = ("diffusers",)

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        full = denoiser(hidden_states=inputs[0], timestep=inputs[1], encoder_hidden_states=inputs[2],
                        pooled_projections=inputs[3], img_ids=inputs[4][0], txt_ids=inputs[5][0],
                        guidance=inputs[6], return_dict=False)[0]
        height, width = like.shape[-2:]
        return unpack_latents(full[:, :(height // 2) * (width // 2)], height, width)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("flux_kontext")
    FluxKontextAdapter.build_tiny(out, seed=0)
    return out


def test_first_layer_inputs_are_what_the_pipeline_feeds_its_transformer(model_dir):
    """FluxKontextPipeline, given the control image as latents, calls its transformer with the noisy target's
    tokens then the control's, and ids to match: the adapter's inputs are exactly those."""
    from diffusers import FluxKontextPipeline

    adapter = FluxKontextAdapter(model_dir, torch.float32)
    pipe = FluxKontextPipeline.from_pretrained(model_dir, torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    spec = adapter.latent_spec(48, 32, 1)
    control = random_like_spec(spec, 1, seed=1)["latents"]  # normalised, as training feeds it
    noisy = random_like_spec(spec, 1, seed=2)["latents"]
    text = random_like_spec(adapter.text_spec(16), 1, seed=3)
    with module_calls(pipe.transformer) as calls:
        pipe(image=control, prompt_embeds=text["t5"], pooled_prompt_embeds=text["clip_pooled"], height=32, width=48,
             num_inference_steps=1, guidance_scale=2.5, max_area=32 * 48,
             latents=FluxKontextPipeline._pack_latents(noisy, 1, 4, 8, 12), output_type="latent")
    call = calls[0].kwargs
    ours = adapter.conditioned_inputs(noisy, call["timestep"], text, 2.5, (control,))
    assert torch.equal(ours[0], call["hidden_states"])  # target tokens, then the control's
    assert torch.equal(ours[4][0], call["img_ids"])  # control ids: axis 0 is 1
    assert torch.equal(ours[5][0], call["txt_ids"])
    assert torch.equal(ours[6], call["guidance"])
    assert ours[0].shape[1] == 2 * 4 * 6


def test_prediction_keeps_only_the_target_tokens(model_dir):
    adapter = FluxKontextAdapter(model_dir, torch.float32)
    target = torch.randn(2, 4, 8, 12)
    tokens = torch.cat((adapter.model_inputs(target, torch.zeros(2), {"t5": torch.zeros(2, 3, 32),
                                                                       "clip_pooled": torch.zeros(2, 32)}, 1.0)[0],
                        torch.full((2, 24, 16), 99.0)), dim=1)
    assert torch.equal(adapter.prediction_to_latents(tokens, target), target)


def test_sample_prompts_of_an_edit_family_need_a_control_image(model_dir, tmp_path):
    """An edit family's sample prompt without a control image, a control path that is not a file, and a control
    image given to a text-to-image family are errors naming the prompt and the fix."""
    from diffusion_pipe.models.flux import FluxAdapter
    from diffusion_pipe.params import SamplePrompt
    from diffusion_pipe.sample.render import check_prompt

    adapter = FluxKontextAdapter(model_dir, torch.float32)
    with pytest.raises(ConfigError, match=r"prompt 'make it green' has no control image; family 'flux_kontext' "
                                          r"renders from one: give the prompt `control: path/to/image.png`"):
        check_prompt(adapter, SamplePrompt("make it green", width=32, height=32, frames=1))
    with pytest.raises(ConfigError, match=r"control image .*nope.png is not a file"):
        check_prompt(adapter, SamplePrompt("make it green", width=32, height=32, frames=1,
                                           control=str(tmp_path / "nope.png")))
    with pytest.raises(ConfigError, match=r"has a control image, but family 'flux' renders from text alone"):
        check_prompt(FluxAdapter(model_dir, torch.float32),
                     SamplePrompt("a cat", width=32, height=32, frames=1, control=str(tmp_path / "nope.png")))
