"""Rendering sample prompts with a family's own diffusers pipeline: during training (the LoRA as it learns) and
in the `sample` stage (the exported LoRA, with and without it)."""
