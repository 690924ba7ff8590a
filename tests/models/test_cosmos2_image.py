"""The Cosmos-Predict2 Text2Image adapter: the shared contract on a tiny Predict2 Text2Image-shaped model (the
layers' per-token timestep embeddings against the transformer's own forward with one timestep per image, as the
pipeline calls it), the first layer's inputs and the prediction against what Cosmos2TextToImagePipeline feeds and
gets from its transformer, and a Video2World checkpoint refused, naming its family."""

import json

import pytest
import torch
from diffusers.models.transformers import transformer_cosmos

from diffusion_pipe.config import ConfigError
from diffusion_pipe.models.cosmos2 import Cosmos2Adapter
from diffusion_pipe.models.cosmos2_image import Cosmos2ImageAdapter
from tests.models.contract import AdapterContract, module_calls, random_like_spec
from tests.models.test_cosmos2 import NoGuardrailNeeded, nearest_resize, torch_resize  # noqa: F401 (autouse)


class TestCosmos2ImageContract(AdapterContract):
    adapter_cls = Cosmos2ImageAdapter
    pipeline_cls = "Cosmos2TextToImagePipeline"
    denoiser_attr = "transformer"
    media_sizes = ((48, 32, 1), (32, 32, 1))
    roundtrip_formats = ()  # no LoRA loader on the Predict2 pipelines: cosmos2's tests load into the transformer

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        x, t, text = inputs
        if not hasattr(transformer_cosmos, "transforms"):  # as cosmos2's whole_forward: the bench calls this too
            transformer_cosmos.transforms = torch_resize()
        return denoiser(hidden_states=x, timestep=t[:, 0], encoder_hidden_states=text,
                        padding_mask=x.new_zeros(1, 1, x.shape[-2] * 8, x.shape[-1] * 8), return_dict=False)[0]


def test_first_layer_inputs_are_what_the_pipeline_feeds_its_transformer(tmp_path, monkeypatch):
    """Cosmos2TextToImagePipeline calls its transformer with the noise scaled to the flow interpolation at
    t = sigma / (sigma + 1), that t once per image and no condition mask: model_inputs give those inputs, and
    the composed layers its prediction."""
    from diffusers import Cosmos2TextToImagePipeline
    from diffusers.pipelines.cosmos import pipeline_cosmos2_text2image as module

    Cosmos2ImageAdapter.build_tiny(tmp_path, seed=0)
    adapter = Cosmos2ImageAdapter(tmp_path, torch.float32)
    monkeypatch.setattr(module, "CosmosSafetyChecker", NoGuardrailNeeded)  # nothing reaches it: see cosmos2's test
    pipe = Cosmos2TextToImagePipeline.from_pretrained(tmp_path, torch_dtype=torch.float32, text_encoder=None,
                                                      tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    spec = adapter.latent_spec(48, 32, 1)
    noise = random_like_spec(spec, 1, seed=2)["latents"]
    text = random_like_spec(adapter.text_spec(16), 1, seed=3)
    with module_calls(pipe.transformer) as calls:
        pipe(prompt_embeds=text["t5"], height=32, width=48, num_inference_steps=2, guidance_scale=1.0, latents=noise,
             output_type="latent")
    call = calls[0].kwargs
    sigma = pipe.scheduler.sigmas[0]
    t = (sigma / (sigma + 1)).float().reshape(1)
    image = torch.randn(1, *spec["latents"][0])
    noisy, target = adapter.keep_clean(t * noise, noise - image, image)
    assert torch.equal(target, noise - image)  # nothing kept clean: the whole image is generated
    ours = adapter.model_inputs(noisy, t, text, 1.0)
    torch.testing.assert_close(ours[0], call["hidden_states"], rtol=0, atol=1e-5)  # noise x 80 x 1 / 81, rounded
    assert "condition_mask" not in call and ours[0].shape[1] == 16
    torch.testing.assert_close(ours[1][:, 0], call["timestep"], rtol=0, atol=1e-6)
    x = ours
    with torch.no_grad():
        for layer in adapter.pipeline_layers(adapter.load_denoiser(torch.device("cpu"))):
            x = layer(x)
    torch.testing.assert_close(adapter.prediction_to_latents(x, image), calls[0].out[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("adapter_cls, other", [(Cosmos2ImageAdapter, "cosmos2"), (Cosmos2Adapter, "cosmos2_image")])
def test_the_other_predict2_checkpoint_is_refused_naming_its_family(tmp_path, adapter_cls, other):
    """Text2Image and Video2World share the transformer class; their inputs differ by the condition mask."""
    adapter_cls.build_tiny(tmp_path, seed=0)
    config = tmp_path / "transformer" / "config.json"
    conf = json.loads(config.read_text())
    config.write_text(json.dumps({**conf, "in_channels": conf["in_channels"] + (1 if other == "cosmos2" else -1)}))
    with pytest.raises(ConfigError, match=f"set model.family to '{other}'; family '{adapter_cls.name}' trains"):
        adapter_cls(tmp_path, torch.float32)


def test_an_images_blocks_modulate_from_one_timestep_embedding_per_sample(tmp_path):
    """One latent frame shares one timestep: the blocks' norms project one embedding per sample and broadcast it
    over the tokens, as the transformer's Text2Image path does, instead of a copy per token (which cost a quarter
    of the step at 1024x1024)."""
    Cosmos2ImageAdapter.build_tiny(tmp_path, seed=0)
    adapter = Cosmos2ImageAdapter(tmp_path, torch.float32)
    layers = adapter.pipeline_layers(adapter.load_denoiser(torch.device("cpu")))
    spec = adapter.latent_spec(48, 32, 1)
    noisy = random_like_spec(spec, 2, seed=1)["latents"]
    inputs = adapter.model_inputs(noisy, torch.tensor([0.3, 0.7]), random_like_spec(adapter.text_spec(16), 2, 2), 1.0)
    rows = []
    norm = layers[1].block.norm1.linear_1
    handle = norm.register_forward_hook(lambda _m, args, _out: rows.append(args[0].shape[:-1].numel()))
    with torch.no_grad():
        x = inputs
        for layer in layers:
            x = layer(x)
    handle.remove()
    assert rows == [2]
