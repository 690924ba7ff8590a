"""The FLUX.2 [dev] adapter: the shared contract on a tiny dev-shaped model (Klein's tiny transformer with a guidance
embedding, a 31-layer Mistral 3), and what differs from Klein: the tokenizer standing in for the pipeline's
PixtralProcessor, the system message in the text key, guidance reaching the prediction and the samples, and each
FLUX.2 family refusing the other's checkpoints."""

import json
import shutil

import numpy as np
import pytest
import torch

from diffusion_pipe.config import ConfigError
from diffusion_pipe.models.flux2 import Flux2Adapter
from diffusion_pipe.models.flux2_klein import Flux2KleinAdapter
from tests.models.comfyui_merge import assert_comfyui_merge_matches
from tests.models.contract import AdapterContract
from tests.models.test_flux2_klein import original_flux2_state_dict, to_diffusers

CPU = torch.device("cpu")


class TestFlux2Contract(AdapterContract):
    adapter_cls = Flux2Adapter
    pipeline_cls = "Flux2Pipeline"
    denoiser_attr = "transformer"
    media_sizes = ((32, 32, 1), (48, 32, 1))
    # Flux2Pipeline's loader reads diffusers keys; test_comfyui_delta_equals_diffusers_delta checks comfyui.
    roundtrip_formats = ("diffusers",)
    text_max_length = 64  # the pipeline's system message takes 31 of the tiny tokenizer's tokens
    pipeline_load_kwargs = {"tokenizer": None}  # transformers builds PixtralProcessor only with torchvision

    def unsplit_forward(self, adapter, denoiser, inputs, like):
        full = denoiser(hidden_states=inputs[0], timestep=inputs[1], encoder_hidden_states=inputs[2],
                        img_ids=inputs[3], txt_ids=inputs[4], guidance=inputs[5], return_dict=False)[0]
        return adapter.prediction_to_latents(full, like)

    def test_tokenizer_gives_the_processors_ids(self, adapter, model_dir):
        """Flux2Pipeline's prompt encoding feeds Mistral the same ids and mask with the tokenizer the adapter loads
        as with the model's processor, and so makes the same embeddings: PixtralProcessor's text path is
        ProcessorMixin's (apply_chat_template, then its tokenizer, adding BOS unless the template wrote it), run
        here by a processor over the same tokenizer files (PixtralProcessor itself needs torchvision). A long
        caption is cut at the same token."""
        from transformers import ProcessorMixin

        from diffusion_pipe.models.common import bare_pipeline

        class TextProcessor(ProcessorMixin):
            def __init__(self, tokenizer=None, chat_template=None):
                super().__init__(tokenizer, chat_template=chat_template)

        pipe = adapter.load_text_encoders(CPU).pipeline
        processor = TextProcessor.from_pretrained(model_dir / "tokenizer")
        fed = []
        hook = pipe.text_encoder.register_forward_pre_hook(
            lambda module, args, kwargs: fed.append((kwargs["input_ids"], kwargs["attention_mask"])),
            with_kwargs=True)
        captions = ["a red circle", "the quick brown fox jumps over the lazy dog " * 8]
        ours = pipe.encode_prompt(captions, device=CPU, max_sequence_length=self.text_max_length)[0]
        stock = bare_pipeline(adapter.pipeline_class(), text_encoder=pipe.text_encoder, tokenizer=processor)
        theirs = stock.encode_prompt(captions, device=CPU, max_sequence_length=self.text_max_length)[0]
        hook.remove()
        (ids, mask), (stock_ids, stock_mask) = fed
        assert torch.equal(ids, stock_ids) and torch.equal(mask, stock_mask)
        assert torch.equal(ours, theirs)
        assert ids.shape == (2, self.text_max_length) and mask[1].all() and not mask[0].all()
        assert (ids[:, 0] == pipe.tokenizer.bos_token_id).all()

    def test_text_key_holds_the_system_message_and_layers(self, adapter):
        """The text key names the system message and the hidden layers Flux2Pipeline encodes with; the system
        message changes the embedding (the tiny chat template renders it, as Mistral's does)."""
        encoders = adapter.load_text_encoders(CPU)
        pipe = encoders.pipeline
        assert json.loads(adapter.text_template()) == {"system_message": pipe.system_message, "layers": [10, 20, 30]}
        before = adapter.encode_text(encoders, ["a red circle"], self.text_max_length)[0]["prompt_embeds"]
        pipe.system_message = "You draw."
        after = adapter.encode_text(encoders, ["a red circle"], self.text_max_length)[0]["prompt_embeds"]
        assert (before - after).abs().max() > 1e-4

    def test_guidance_reaches_the_prediction(self, adapter, lora_model):
        """The guidance training feeds enters the transformer's guidance embedding: two values, two predictions."""
        denoiser, _ = lora_model
        latents, noised, _ = self._inputs(adapter)
        text = {"prompt_embeds": torch.randn(2, self.text_max_length, 48, generator=torch.Generator().manual_seed(1))}
        predictions = []
        for guidance in (1.0, 4.0):
            x = adapter.model_inputs(noised.noisy, noised.timesteps, text, guidance)
            with torch.no_grad():
                for layer in adapter.pipeline_layers(denoiser):
                    x = layer(x)
            predictions.append(adapter.prediction_to_latents(x, latents))
        assert (predictions[0] - predictions[1]).abs().max() > 1e-4

    def test_samples_render_at_their_guidance_without_a_negative_prompt(self, adapter, lora_model):
        """A sample prompt renders from its own text entry alone (the distilled guidance takes no negative prompt),
        and its guidance reaches the render."""
        from diffusion_pipe.params import SamplePrompt
        from diffusion_pipe.sample.render import SampleText, render_prompts

        prompts = tuple(SamplePrompt("a red circle", seed=1, width=32, height=32, frames=1, steps=2, guidance=g,
                                     negative_prompt="blurry", cfg_scale=2.0) for g in (1.0, 6.0))
        assert adapter.sample_texts(prompts[0]) == ("a red circle",)
        (entry,) = adapter.encode_text(adapter.load_text_encoders(CPU), ["a red circle"], self.text_max_length)
        pipe = adapter.sample_pipeline(lora_model[0], adapter.load_vae(CPU))
        low, high = render_prompts(pipe, adapter, prompts, {SampleText("a red circle"): entry}, CPU)
        assert np.abs(low.astype(int) - high.astype(int)).max() > 0

    @pytest.mark.parametrize("cls, guidance_embeds, family", [(Flux2Adapter, False, "flux2_klein"),
                                                              (Flux2KleinAdapter, True, "flux2")])
    def test_the_other_flux2_familys_checkpoint_is_refused(self, model_dir, tmp_path, cls, guidance_embeds, family):
        """FLUX.2 [klein] has no guidance embedding and FLUX.2 [dev] has one: a checkpoint given to the other
        family is refused, naming model.family and the family to set."""
        (tmp_path / "transformer").mkdir()
        config = json.loads((model_dir / "transformer" / "config.json").read_text())
        (tmp_path / "transformer" / "config.json").write_text(json.dumps(config | {"guidance_embeds": guidance_embeds}))
        with pytest.raises(ConfigError, match=f"model.family: .* set model.family to '{family}'"):
            cls(tmp_path, torch.float32)
        shutil.rmtree(tmp_path / "transformer")
        cls(tmp_path, torch.float32)  # a folder without a transformer config (a hub skeleton being fetched)


def test_comfyui_delta_equals_diffusers_delta(tmp_path):
    """Every Linear with a LoRA: merged in BFL's layout as ComfyUI merges and converted back by diffusers == merged
    in diffusers' layout, on the dev-shaped transformer (guidance embedding included)."""
    Flux2Adapter.build_tiny(tmp_path, seed=0)
    assert_comfyui_merge_matches(Flux2Adapter(tmp_path, torch.float32), original_flux2_state_dict, to_diffusers)
