"""The Cosmos-Predict2 Video2World adapter: the shared contract on a tiny Predict2-shaped model, the first layer's
inputs against what Cosmos2VideoToWorldPipeline feeds its transformer for an image, text entries as the pipeline
encodes prompts, exports that load into the transformer (diffusers) and merge as ComfyUI merges them (the original
names, converted back by diffusers' own converter), and other Cosmos checkpoints refused."""

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from diffusion_pipe.config import ConfigError
from diffusion_pipe.models.cosmos2 import FPS, T_CONDITIONING, Cosmos2Adapter, cosmos_original_name
from tests.models.comfyui_merge import assert_comfyui_merge_matches
from tests.models.contract import AdapterContract, expected_deltas, lora_deltas, module_calls, random_like_spec


def torch_resize() -> SimpleNamespace:
    """What CosmosTransformer3DModel.forward reads of torchvision's `transforms` to resize its padding mask, as
    torch's nearest-neighbour interpolation: torchvision is not installed here (its wheel in the index is built
    for another torch). The mask is all zeros wherever the pipeline passes it."""
    functional = SimpleNamespace(resize=lambda mask, size, interpolation=None: F.interpolate(mask, size=size))
    return SimpleNamespace(functional=functional, InterpolationMode=SimpleNamespace(NEAREST="nearest"))


@pytest.fixture(autouse=True)
def nearest_resize(monkeypatch):
    """torch_resize for the tests that call the whole transformer (or a pipeline that does)."""
    from diffusers.models.transformers import transformer_cosmos

    monkeypatch.setattr(transformer_cosmos, "transforms", torch_resize(), raising=False)


def whole_forward(denoiser, inputs):
    """CosmosTransformer3DModel's own forward on the adapter's first-layer inputs, called as the pipeline calls it
    (bench/bench_family.py's plain loop calls it too, outside pytest: torchvision's resize or torch_resize)."""
    from diffusers.models.transformers import transformer_cosmos

    if not hasattr(transformer_cosmos, "transforms"):
        transformer_cosmos.transforms = torch_resize()
    x, t, text = inputs
    b, _, frames, height, width = x.shape
    return denoiser(hidden_states=x[:, :-1], timestep=t.reshape(b, 1, frames, 1, 1), encoder_hidden_states=text,
                    fps=FPS, condition_mask=x[:, -1:], padding_mask=x.new_zeros(1, 1, height * 8, width * 8),
                    return_dict=False)[0]


class TestCosmos2Contract(AdapterContract):
    adapter_cls = Cosmos2Adapter
    pipeline_cls = "Cosmos2VideoToWorldPipeline"
    denoiser_attr = "transformer"
    media_sizes = ((48, 32, 1), (48, 32, 9))  # a first frame alone and a 9-frame clip (4k+1 for Wan's VAE)
    roundtrip_formats = ()  # Cosmos2VideoToWorldPipeline has no LoRA loader: the transformer's own, below

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        full = whole_forward(denoiser, inputs)
        return full[:, :, full.shape[2] - like.shape[2]:]

    def test_exported_lora_loads_into_the_transformer(self, adapter, lora_model, model_dir):
        """diffusers users load a Predict2 LoRA with the transformer's `load_lora_adapter` (the pipeline has no
        `load_lora_weights`): the diffusers file gives every module its delta there."""
        from diffusers import CosmosTransformer3DModel

        _, lora = lora_model
        transformer = CosmosTransformer3DModel.from_pretrained(model_dir / "transformer")
        transformer.load_lora_adapter(adapter.export_lora(lora, "diffusers"), prefix="transformer")
        got, want = lora_deltas(transformer), expected_deltas(lora)
        assert set(got) == set(want)
        assert all(torch.allclose(got[name], want[name], atol=1e-6) for name in want)

    def test_comfyui_file_merges_as_comfyui_merges_it(self, adapter, lora_model):
        """Every Linear's LoRA, under the original names ComfyUI's Predict2 model keeps, merged as ComfyUI merges
        (W += alpha / rank * up @ down) into the original weights and converted back by diffusers' converter, is
        the LoRA merged in diffusers' layout."""
        from diffusers.loaders.single_file_utils import convert_cosmos_transformer_checkpoint_to_diffusers

        def to_original(state):
            return {f"{cosmos_original_name(k.rsplit('.', 1)[0])}.{k.rsplit('.', 1)[1]}": v for k, v in state.items()}

        exported = assert_comfyui_merge_matches(adapter, to_original,
                                                convert_cosmos_transformer_checkpoint_to_diffusers)
        out = adapter.export_lora(lora_model[1], "comfyui")
        base = "diffusion_model.blocks.1.cross_attn.k_proj"
        assert out[f"{base}.alpha"].item() == 4.0 and out[f"{base}.lora_down.weight"].shape[0] == 4
        assert "diffusion_model.blocks.0.mlp.layer1.lora_up.weight" in out
        assert all(k.startswith("diffusion_model.") for k in exported)
        with pytest.raises(ValueError, match="no original Cosmos-Predict2"):
            cosmos_original_name("transformer_blocks.0.attn1.to_qkv")


def test_text_entries_are_the_pipelines_prompt_embeddings(tmp_path):
    """Cosmos2VideoToWorldPipeline._get_t5_prompt_embeds: T5 states under the attention mask, zeros past the
    caption's tokens; a stored entry is exactly that."""
    from diffusers import Cosmos2VideoToWorldPipeline

    Cosmos2Adapter.build_tiny(tmp_path, seed=0)
    adapter = Cosmos2Adapter(tmp_path, torch.float32)
    encoders = adapter.load_text_encoders(torch.device("cpu"))
    captions = ["a red circle", "a blue square on a white background"]
    pipe = SimpleNamespace(tokenizer=encoders.tokenizer, text_encoder=encoders.t5, _execution_device="cpu")
    want = Cosmos2VideoToWorldPipeline._get_t5_prompt_embeds(pipe, captions, max_sequence_length=16)
    got = adapter.encode_text(encoders, captions, 16)
    assert all(torch.equal(entry["t5"], want[i]) for i, entry in enumerate(got))
    n = int(encoders.tokenizer(captions[0]).attention_mask.count(1))
    assert got[0]["t5"][n:].abs().sum() == 0 and got[0]["t5"][:n].abs().sum() > 0


class NoGuardrailNeeded:
    """Stands where the pipeline keeps its guardrail, for a call that gives it nothing to screen."""

    def to(self, *_args, **_kwargs):
        return self


def test_first_layer_inputs_are_what_the_pipeline_feeds_its_transformer(tmp_path, monkeypatch):
    """Cosmos2VideoToWorldPipeline, given an image and initial noise, calls its transformer with the image's
    normalised latent in frame 0 marked by the condition mask at the conditioning timestep, and the noise scaled
    to the flow interpolation at t = sigma / (sigma + 1) elsewhere: keep_clean + model_inputs on a clip whose
    first frame is that image give exactly those inputs, and the composed layers its prediction."""
    from diffusers import Cosmos2VideoToWorldPipeline, CosmosTransformer3DModel
    from diffusers.pipelines.cosmos import pipeline_cosmos2_video2world as module

    Cosmos2Adapter.build_tiny(tmp_path, seed=0)
    adapter = Cosmos2Adapter(tmp_path, torch.float32)
    # The guardrail's package and models are not in this environment, and no prompt or video reaches it here (the
    # prompt arrives as embeddings, the output as latents); the VAE's latent taken at its mode (the pipeline draws
    # a sample of it).
    monkeypatch.setattr(module, "CosmosSafetyChecker", NoGuardrailNeeded)
    monkeypatch.setattr(module, "retrieve_latents", lambda out, generator=None: out.latent_dist.mode())
    pipe = Cosmos2VideoToWorldPipeline.from_pretrained(tmp_path, torch_dtype=torch.float32, text_encoder=None,
                                                       tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    rgb = (np.random.default_rng(0).random((32, 48, 3)) * 255).astype(np.uint8)
    pixels = torch.from_numpy(rgb).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1
    vae = adapter.load_vae(torch.device("cpu"))
    image_latent = adapter.normalise_latents(adapter.encode_media(vae, pixels)[0]["latents"])
    spec = adapter.latent_spec(48, 32, 9)
    noise = random_like_spec(spec, 1, seed=2)["latents"]
    text = random_like_spec(adapter.text_spec(16), 1, seed=3)
    with module_calls(pipe.transformer) as calls:
        pipe(image=Image.fromarray(rgb), prompt_embeds=text["t5"], height=32, width=48, num_frames=9,
             num_inference_steps=2, guidance_scale=1.0, latents=noise, output_type="latent")
    call = calls[0].kwargs
    sigma = pipe.scheduler.sigmas[0]
    t = (sigma / (sigma + 1)).float().reshape(1)
    clip = torch.cat((image_latent[None], torch.zeros(1, *spec["latents"][0])[:, :, 1:]), dim=2)
    noisy, _ = adapter.keep_clean((1 - t) * clip + t * noise, noise - clip, clip)
    ours = adapter.model_inputs(noisy, t, text, 1.0)
    torch.testing.assert_close(ours[0][:, :-1], call["hidden_states"], rtol=0, atol=1e-5)
    assert torch.equal(ours[0][:, -1:], call["condition_mask"]) and call["condition_mask"][0, 0, :, 0, 0].tolist() \
        == [1, 0, 0]
    torch.testing.assert_close(ours[1].reshape(call["timestep"].shape), call["timestep"], rtol=0, atol=1e-6)
    assert ours[1][0, 0] == pytest.approx(T_CONDITIONING) and ours[1][0, 1] == pytest.approx(t.item())
    assert call["fps"] == FPS and torch.equal(ours[2], call["encoder_hidden_states"])
    denoiser = CosmosTransformer3DModel.from_pretrained(tmp_path / "transformer")
    x = ours
    with torch.no_grad():
        for layer in adapter.pipeline_layers(denoiser):
            x = layer(x)
    torch.testing.assert_close(adapter.prediction_to_latents(x, clip), calls[0].out[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("change, what", [({"in_channels": 16}, "Text2Image"),
                                          ({"use_crossattn_projection": True}, "Cosmos-Predict2.5"),
                                          ({"extra_pos_embed_type": "learnable"}, "Cosmos 1.0")])
def test_other_cosmos_checkpoints_are_refused(tmp_path, change, what):
    Cosmos2Adapter.build_tiny(tmp_path / "model", seed=0)
    config = tmp_path / "model" / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **change}))
    with pytest.raises(ConfigError, match=f"model.path: .* is a {what}.*family 'cosmos2' trains"):
        Cosmos2Adapter(tmp_path / "model", torch.float32)
    shutil.rmtree(tmp_path / "model")


def test_the_loss_covers_the_frames_after_the_first(tmp_path):
    """A clip's first latent frame enters clean and leaves the target; the prediction is cut to the frames after
    it, so the loss covers exactly what the pipeline generates."""
    Cosmos2Adapter.build_tiny(tmp_path, seed=0)
    adapter = Cosmos2Adapter(tmp_path, torch.float32)
    latents, noise = torch.randn(2, 16, 3, 2, 4), torch.randn(2, 16, 3, 2, 4)
    noisy, target = adapter.keep_clean(noise, noise - latents, latents)
    assert target.shape == (2, 16, 2, 2, 4) and torch.equal(target, (noise - latents)[:, :, 1:])
    assert torch.equal(noisy[:, :, 0], latents[:, :, 0]) and torch.equal(noisy[:, :, 1:], noise[:, :, 1:])
    tokens = torch.randn(2, 3 * 1 * 2, 16 * 4)  # a prediction for all three latent frames
    whole = adapter.prediction_to_latents(tokens, latents)
    assert whole.shape == latents.shape
    assert torch.equal(adapter.prediction_to_latents(tokens, target), whole[:, :, 1:])
