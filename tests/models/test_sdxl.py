"""The SDXL adapter: the shared contract on a tiny SDXL-shaped model, plus the SGM (kohya) names and
v-prediction."""

import json
import shutil

import pytest
import torch

from diffusion_pipe.models.sdxl import SDXLAdapter, sgm_module_name
from tests.models.contract import AdapterContract


class TestSDXLContract(AdapterContract):
    adapter_cls = SDXLAdapter
    pipeline_cls = "StableDiffusionXLPipeline"
    denoiser_attr = "unet"
    media_sizes = ((64, 64, 1), (96, 64, 1))
    roundtrip_formats = ("diffusers", "kohya")

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        latents, timesteps, context, pooled, time_ids = inputs
        return denoiser(latents, timesteps, encoder_hidden_states=context,
                        added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}, return_dict=False)[0]

    def test_size_conditioning_is_the_bucket_size(self, adapter):
        inputs = adapter.model_inputs(torch.zeros(2, 4, 16, 24), torch.tensor([1.0, 2.0]),
                                      {"prompt_embeds": torch.zeros(2, 77, 64), "pooled": torch.zeros(2, 32)}, 1.0)
        assert inputs[4].tolist() == [[64, 96, 0, 0, 64, 96]] * 2

    def test_v_prediction_from_scheduler_config(self, model_dir, tmp_path):
        v_dir = tmp_path / "v"
        shutil.copytree(model_dir, v_dir)
        config_path = v_dir / "scheduler" / "scheduler_config.json"
        config = json.loads(config_path.read_text())
        assert SDXLAdapter(v_dir, torch.float32).objective() == "epsilon"
        config_path.write_text(json.dumps({**config, "prediction_type": "v_prediction"}))
        assert SDXLAdapter(v_dir, torch.float32).objective() == "v"
        config_path.write_text(json.dumps({**config, "prediction_type": "sample"}))
        with pytest.raises(ValueError, match="prediction_type 'sample' is not trainable"):
            SDXLAdapter(v_dir, torch.float32).objective()


@pytest.mark.parametrize("diffusers_name, sgm", [
    # real SDXL (layers_per_block 2): the names kohya's sd-scripts and ComfyUI use
    ("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q", "input_blocks.4.1.transformer_blocks.0.attn1.to_q"),
    ("down_blocks.2.attentions.1.transformer_blocks.9.ff.net.2", "input_blocks.8.1.transformer_blocks.9.ff.net.2"),
    ("down_blocks.0.resnets.1.time_emb_proj", "input_blocks.2.0.emb_layers.1"),
    ("mid_block.attentions.0.transformer_blocks.3.attn2.to_k", "middle_block.1.transformer_blocks.3.attn2.to_k"),
    ("mid_block.resnets.1.time_emb_proj", "middle_block.2.emb_layers.1"),
    ("up_blocks.0.attentions.2.proj_out", "output_blocks.2.1.proj_out"),
    ("up_blocks.1.attentions.0.transformer_blocks.0.attn1.to_out.0",
     "output_blocks.3.1.transformer_blocks.0.attn1.to_out.0"),
    ("up_blocks.2.resnets.2.time_emb_proj", "output_blocks.8.0.emb_layers.1"),
    ("add_embedding.linear_2", "label_emb.0.2"),
])
def test_sgm_names_of_real_sdxl(diffusers_name, sgm):
    assert sgm_module_name(diffusers_name, layers_per_block=2) == sgm


def test_kohya_keys_and_alpha(tmp_path):
    adapter = SDXLAdapter(tmp_path, torch.float32)
    lora = {"down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_A.weight": torch.ones(4, 32),
            "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.weight": torch.ones(32, 4)}
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "config.json").write_text(json.dumps({"layers_per_block": 2}))
    out = adapter.export_lora(lora, "kohya")
    base = "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q"
    assert set(out) == {f"{base}.lora_down.weight", f"{base}.lora_up.weight", f"{base}.alpha"}
    assert out[f"{base}.alpha"].item() == 4.0
    with pytest.raises(ValueError, match="no SGM"):
        sgm_module_name("conv_in", 2)
