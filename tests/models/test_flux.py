"""The Flux adapter against the real diffusers model: layers, packing, encoders, specs, export keys."""

import pytest
import torch

from diffusion_pipe.models import REGISTRY, adapter_class
from diffusion_pipe.models.flux import FluxAdapter, image_ids, pack_latents, unpack_latents
from diffusion_pipe.train.lora import add_lora, target_module_names


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("flux")
    FluxAdapter.build_tiny(out, seed=0)
    return FluxAdapter(out, torch.float32)


def test_registry_names_match_files():
    for name, target in REGISTRY.items():
        module, _, _ = target.partition(":")
        assert module.rsplit(".", 1)[1] == name
        assert adapter_class(name).name == name


def test_pack_roundtrip():
    x = torch.randn(2, 4, 8, 12)
    tokens = pack_latents(x)
    assert tokens.shape == (2, 4 * 6, 16)
    assert torch.equal(unpack_latents(tokens, 8, 12), x)
    assert image_ids(8, 12).shape == (24, 3)


def test_pipeline_layers_equal_unsplit_forward(tiny):
    torch.manual_seed(0)
    transformer = tiny.load_denoiser(torch.device("cpu"))
    add_lora(transformer, target_module_names(transformer, tiny.default_lora_targets, tiny.lora_exclude()),
             rank=4, alpha=4.0, dropout=0.0)
    for name, p in transformer.named_parameters():  # non-zero LoRA B, so the adapters take part
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    latents = torch.randn(2, 4, 8, 8)
    text = {"t5": torch.randn(2, 7, 32), "clip_pooled": torch.randn(2, 32)}
    t = torch.tensor([0.2, 0.9])
    inputs = tiny.model_inputs(latents, t, text, guidance=3.5)
    x = inputs
    for layer in tiny.pipeline_layers(transformer):
        x = layer(x)
    split = tiny.prediction_to_latents(x, latents)
    with torch.no_grad():
        full = transformer(hidden_states=inputs[0], timestep=inputs[1], encoder_hidden_states=inputs[2],
                           pooled_projections=inputs[3], img_ids=inputs[4][0], txt_ids=inputs[5][0],
                           guidance=inputs[6], return_dict=False)[0]
    assert torch.allclose(split, unpack_latents(full, 8, 8), atol=1e-5)


def test_encoders_match_specs_and_are_deterministic(tiny):
    vae = tiny.load_vae(torch.device("cpu"))
    pixels = torch.rand(2, 3, 32, 48) * 2 - 1
    entries = tiny.encode_media(vae, pixels.unsqueeze(2))
    spec = tiny.latent_spec(48, 32, 1)
    assert tuple(entries[0]["latents"].shape) == spec["latents"][0]
    assert torch.equal(entries[0]["latents"], tiny.encode_media(vae, pixels.unsqueeze(2))[0]["latents"])
    encoders = tiny.load_text_encoders(torch.device("cpu"))
    texts = tiny.encode_text(encoders, ["a red circle", "a blue square on a white background"], 16)
    for name, (shape, dtype) in tiny.text_spec(16).items():
        assert tuple(texts[0][name].shape) == shape and str(texts[0][name].dtype) == f"torch.{dtype}"
    assert not torch.equal(texts[0]["t5"], texts[1]["t5"])


def test_lora_targets_exist_and_exclude_final_projection(tiny):
    transformer = tiny.load_denoiser(torch.device("cpu"))
    names = target_module_names(transformer, tiny.default_lora_targets, tiny.lora_exclude())
    assert "proj_out" not in names
    assert any(n.startswith("single_transformer_blocks.") and n.endswith("proj_out") for n in names)
    assert any(n.endswith("attn.to_q") for n in names)


def test_export_formats(tiny):
    lora = {"transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(4, 32),
            "transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(32, 4)}
    assert set(tiny.export_lora(lora, "diffusers")) == {f"transformer.{k}" for k in lora}
    comfy = tiny.export_lora(lora, "comfyui")  # q alone fills its third of the fused qkv; k, v rows are zero
    assert set(comfy) == {f"diffusion_model.double_blocks.0.img_attn.qkv.{s}"
                          for s in ("lora_down.weight", "lora_up.weight", "alpha")}
    assert comfy["diffusion_model.double_blocks.0.img_attn.qkv.alpha"].item() == 4.0
    assert comfy["diffusion_model.double_blocks.0.img_attn.qkv.lora_up.weight"][32:].abs().sum() == 0
    with pytest.raises(ValueError, match="export.formats: 'kohya' is not supported"):
        tiny.export_lora(lora, "kohya")
