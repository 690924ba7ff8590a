"""Merged export: the base denoiser with the LoRA folded in equals the base with the LoRA applied by peft."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from diffusion_pipe.config import ConfigError, from_dict
from diffusion_pipe.lineage.record import METADATA_KEY, read_lineage
from diffusion_pipe.lora_keys import fold_scale
from diffusion_pipe.export.merge import merge_lora_into, write_merged
from diffusion_pipe.models.flux import FluxAdapter
from diffusion_pipe.params import ExportParams

RANK, ALPHA = 4, 12.0  # alpha != rank: the folded scale must be right


@pytest.fixture(scope="module")
def tiny(tiny_flux_dir) -> FluxAdapter:
    return FluxAdapter(tiny_flux_dir, torch.float32)


@pytest.fixture(scope="module")
def peft_lora(tiny):
    """(the denoiser with a peft LoRA whose B is random, its PEFT state dict as the train stage saves it)."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

    model = tiny.load_denoiser(torch.device("cpu"))
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=list(tiny.default_lora_targets),
                        exclude_modules=tiny.lora_exclude())
    inject_adapter_in_model(config, model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    lora = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    assert lora and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in lora)
    return model, lora


def forward(model: torch.nn.Module) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    img_ids = torch.zeros(16, 3)
    img_ids[:, 1], img_ids[:, 2] = torch.arange(16) // 4, torch.arange(16) % 4
    with torch.no_grad():
        return model(hidden_states=torch.randn(1, 16, 16, generator=gen),
                     encoder_hidden_states=torch.randn(1, 8, 32, generator=gen),
                     pooled_projections=torch.randn(1, 32, generator=gen), timestep=torch.tensor([0.5]),
                     img_ids=img_ids, txt_ids=torch.zeros(8, 3), guidance=torch.tensor([1.0])).sample


def test_merged_weights_give_the_peft_output(tiny, peft_lora):
    model, lora = peft_lora
    expected = forward(model)
    base = tiny.load_denoiser(torch.device("cpu"))
    assert (forward(base) - expected).abs().max() > 1e-3  # the LoRA does something
    merge_lora_into(base, fold_scale(lora, RANK, ALPHA))
    torch.testing.assert_close(forward(base), expected, rtol=1e-5, atol=1e-5)


def test_write_merged_is_a_loadable_diffusers_component_with_lineage(tiny, peft_lora, tmp_path):
    from diffusers import FluxTransformer2DModel

    model, lora = peft_lora
    record = {"lineage_version": 2, "kind": "export", "params": {"export": {"name": "x"}}}
    out = write_merged(tiny, fold_scale(lora, RANK, ALPHA), tmp_path / "x.merged", record)
    merged = FluxTransformer2DModel.from_pretrained(out / "transformer")
    torch.testing.assert_close(forward(merged), forward(model), rtol=1e-5, atol=1e-5)
    lineage = read_lineage(out)
    assert lineage["kind"] == "merged" and "transformer/diffusion_pytorch_model.safetensors" in lineage["files"]
    with safe_open(str(out / "transformer/diffusion_pytorch_model.safetensors"), "pt") as f:
        assert json.loads(f.metadata()[METADATA_KEY])["kind"] == "merged"
    assert [p.name for p in tmp_path.iterdir()] == ["x.merged"]  # no temp directory left behind


def test_lora_for_another_model_is_an_error(tiny):
    base = tiny.load_denoiser(torch.device("cpu"))
    with pytest.raises(ValueError, match="'blocks.0.attn1.to_q' is not a module of the base"):
        merge_lora_into(base, {"blocks.0.attn1.to_q.lora_A.weight": torch.ones(2, 32),
                               "blocks.0.attn1.to_q.lora_B.weight": torch.ones(32, 2)})
    with pytest.raises(ValueError, match="'transformer_blocks.0.attn.to_q' is 32x64, the base weight is"):
        merge_lora_into(base, {"transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 64),
                               "transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(32, 2)})


@pytest.mark.parametrize(("data", "message"), [
    ({"formats": []}, "formats is empty and merged is false"),
    ({"formats": ["comfyui", "comfyui"]}, "formats lists a format twice"),
    ({"name": "out/lora"}, "name 'out/lora' must be a plain file name"),
    ({"merged": "yes"}, "export.merged"),
])
def test_export_params_are_validated(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(ExportParams, data, "export")
    assert from_dict(ExportParams, {"formats": [], "merged": True}, "export").merged
