"""The Krea 2 adapter: the shared contract on a tiny Krea-2-shaped model (exports round-trip into Krea2Pipeline in
diffusers' names and in the original names ComfyUI uses), its text entries as Krea2Pipeline encodes them, and the
original names against diffusers' own converter."""

import pytest
import torch

from diffusion_pipe.models.krea2 import Krea2Adapter, krea2_original_name
from tests.models.contract import AdapterContract


class TestKrea2Contract(AdapterContract):
    adapter_cls = Krea2Adapter
    pipeline_cls = "Krea2Pipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 1))
    roundtrip_formats = ("diffusers", "comfyui")

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        hidden, t, text, mask, ids = inputs
        full = denoiser(hidden_states=hidden, encoder_hidden_states=text, timestep=t, position_ids=ids[0],
                        encoder_attention_mask=mask.bool(), return_dict=False)[0]
        return adapter.prediction_to_latents(full, like)

    def test_text_entries_are_the_pipelines_fixed_length_taps(self, adapter):
        """Each caption's entry is encode_prompt's output at max_length: tapped layers stacked per token, the mask
        of its real tokens (the template's padding sits before the suffix, so the last tokens are real)."""
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        pipe, tokenizer = encoders.pipeline, encoders.pipeline.tokenizer
        # the tiny tokenizer splits the template as Qwen's does: the pipeline drops 34 prefix tokens, appends 5
        assert len(tokenizer(pipe.prompt_template_encode_prefix).input_ids) == pipe.prompt_template_encode_start_idx
        assert len(tokenizer(pipe.prompt_template_encode_suffix).input_ids) == 5
        short, long = adapter.encode_text(encoders, ["a cat", "a red circle on a white background"], 16)
        assert short["prompt_embeds"].shape == (16, 2, 16) and short["prompt_mask"].dtype == torch.int64
        assert short["prompt_mask"].sum() < long["prompt_mask"].sum()
        assert short["prompt_mask"][-1] == 1 and short["prompt_mask"][-6] == 0  # [caption | PAD | suffix]
        states, mask = encoders.pipeline.encode_prompt(["a cat"], device=torch.device("cpu"), max_sequence_length=16)
        assert torch.equal(states[0], short["prompt_embeds"]) and torch.equal(mask[0].long(), short["prompt_mask"])


@pytest.mark.parametrize("module", [
    "transformer_blocks.0.attn.to_q", "transformer_blocks.3.attn.to_out.0", "transformer_blocks.1.attn.to_gate",
    "transformer_blocks.2.ff.down", "text_fusion.refiner_blocks.0.attn.to_k", "text_fusion.layerwise_blocks.1.ff.up",
    "img_in", "final_layer.linear", "time_mod_proj", "txt_in.linear_2", "text_fusion.projector",
])
def test_original_names_are_the_inverse_of_diffusers_converter(module):
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_krea2_lora_to_diffusers

    original = krea2_original_name(module)
    converted = _convert_non_diffusers_krea2_lora_to_diffusers(
        {f"diffusion_model.{original}.lora_A.weight": torch.zeros(1)})
    assert list(converted) == [f"transformer.{module}.lora_A.weight"]


def test_a_module_without_an_original_name_is_refused():
    with pytest.raises(ValueError, match="no original Krea 2"):
        krea2_original_name("transformer_blocks.0.norm1")


def test_default_targets_are_the_main_blocks_not_the_text_fusion(tmp_path):
    """The text-fusion blocks carry the same module names as the main blocks: the default LoRA leaves them out."""
    from diffusion_pipe.train.lora import target_module_names

    Krea2Adapter.build_tiny(tmp_path, seed=0)
    adapter = Krea2Adapter(tmp_path, torch.float32)
    names = target_module_names(adapter.load_denoiser(torch.device("cpu")), adapter.default_lora_targets,
                                adapter.lora_exclude())
    assert names and all(n.startswith("transformer_blocks.") for n in names)
    assert len(names) == 2 * len(adapter.default_lora_targets)  # every target in both tiny blocks
