"""FLUX.2 [dev] (the Flux.2 MMDiT of FLUX.2 [klein] at 32B, with a guidance embedding; Mistral Small 3.x text
encoder, the Flux.2 VAE), through diffusers components: family `flux2_klein`'s adapter over Flux2Pipeline.

Text goes through Flux2Pipeline's own `encode_prompt`: the caption after the pipeline's system message in the
tokenizer's chat template, padded to `encode.text_max_length`, Mistral's hidden layers 10, 20 and 30 stacked. The
pipeline's tokenizer is a PixtralProcessor (model_index.json), which transformers builds only with torchvision.
Its `tokenizer/` files (tokenizer.json, tokenizer_config.json naming LlamaTokenizer with processor_class
PixtralProcessor, chat_template.jinja: the layout of diffusers' FLUX.2-dev derivative
diffusers/flux2-bnb-4bit-modular; not checked against the gated repository itself) are a tokenizer AutoTokenizer
loads, as the processor loads its own, and the pipeline calls nothing of the processor but `apply_chat_template`
on text messages: the adapter passes it that tokenizer, whose ids are the processor's (tested against
ProcessorMixin's text path, which PixtralProcessor keeps). Guidance-distilled: `train.guidance` is the guidance fed
while training, `train.samples.guidance` the one sampled with; no negative prompt.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from diffusion_pipe.models.base import TensorDict
from diffusion_pipe.models.common import bare_pipeline, save_tiny_qwen_tokenizer
from diffusion_pipe.models.ernie_image import tiny_mistral3_config
from diffusion_pipe.models.flux2_klein import Flux2KleinAdapter, save_tiny_flux2_components
from diffusion_pipe.params import SamplePrompt

MISTRAL3_SPECIAL_TOKENS = ("<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]")
# Mistral Small 3.x's chat template for what Flux2Pipeline sends (a system message, then the caption, each a list
# of text blocks), BOS first as there.
MISTRAL3_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}{%- set text = message['content'] | selectattr('type', "
    "'equalto', 'text') | map(attribute='text') | join('') %}{%- if message['role'] == 'system' %}"
    "{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}{%- elif message['role'] == 'user' %}"
    "{{- '[INST]' + text + '[/INST]' }}{%- else %}{{- text + eos_token }}{%- endif %}{%- endfor %}"
)


class Flux2Adapter(Flux2KleinAdapter):
    """FLUX.2 [dev] in diffusers format (transformer, vae, text_encoder, tokenizer, scheduler)."""

    name: ClassVar[str] = "flux2"
    guidance_embeds: ClassVar[bool] = True

    def text_encoder_class(self) -> type[nn.Module]:
        from transformers import Mistral3ForConditionalGeneration

        return Mistral3ForConditionalGeneration

    def text_template(self) -> str:
        """The system message Flux2Pipeline puts before each caption and the hidden layers it stacks, read from
        diffusers (the chat template itself is a tokenizer file, hashed with it)."""
        pipe = bare_pipeline(self.pipeline_class())
        layers = inspect.signature(pipe.encode_prompt).parameters["text_encoder_out_layers"].default
        return json.dumps({"system_message": pipe.system_message, "layers": list(layers)})

    def pipeline_class(self) -> type:
        from diffusers import Flux2Pipeline

        return Flux2Pipeline

    def sample_texts(self, prompt: SamplePrompt) -> tuple[str, ...]:
        """The prompt alone: the distilled guidance takes no negative prompt."""
        return (prompt.prompt,)

    def sample_inputs(self, text: TensorDict, negative: TensorDict | None, guidance: float, cfg_scale: float) -> dict:
        """`guidance` is what Flux2Pipeline feeds the transformer's guidance embedding."""
        return {"prompt_embeds": text["prompt_embeds"][None].to(self.dtype), "guidance_scale": guidance}

    @classmethod
    def build_tiny(cls, out_dir: Path, seed: int = 0) -> None:
        """FLUX.2 [dev]'s layout at toy width: Klein's tiny transformer with a guidance embedding and its VAE, a
        31-layer Mistral 3 (the pipeline stacks hidden layers 10, 20 and 30) with a one-layer vision tower, and a
        tokenizer that adds BOS, as Mistral's does, with a Mistral 3 chat template (its vocabulary learnt on the
        system message too, whose words then take a token each, as in Mistral's)."""
        from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
        from tokenizers import processors
        from transformers import Mistral3ForConditionalGeneration, PreTrainedTokenizerFast

        out_dir = Path(out_dir)
        bpe = save_tiny_qwen_tokenizer(out_dir / "tokenizer", template=SYSTEM_MESSAGE,
                                       special_tokens=MISTRAL3_SPECIAL_TOKENS).backend_tokenizer
        bpe.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B",
                                                           special_tokens=[("<s>", bpe.token_to_id("<s>"))])
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
        tokenizer.chat_template = MISTRAL3_CHAT_TEMPLATE
        tokenizer.save_pretrained(out_dir / "tokenizer")
        torch.manual_seed(seed)
        Mistral3ForConditionalGeneration(tiny_mistral3_config(tokenizer, num_hidden_layers=31)).save_pretrained(
            out_dir / "text_encoder")
        save_tiny_flux2_components(out_dir, guidance_embeds=True, model_index=MODEL_INDEX)


MODEL_INDEX = """{
  "_class_name": "Flux2Pipeline",
  "_diffusers_version": "0.42.1",
  "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
  "text_encoder": ["transformers", "Mistral3ForConditionalGeneration"],
  "tokenizer": ["transformers", "PixtralProcessor"],
  "transformer": ["diffusers", "Flux2Transformer2DModel"],
  "vae": ["diffusers", "AutoencoderKLFlux2"]
}
"""
