"""The adapter contract: one suite every model family runs against its own tiny config (random init, CPU).

A family's test module subclasses `AdapterContract` as `Test<Family>Contract`, sets the class attributes and
implements `unsplit_forward`. Fixtures are class-scoped: the tiny model is built once per family.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar, NamedTuple

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from diffusion_pipe.adapter_keys import LYCORIS_FORMATS, export_adapter
from diffusion_pipe.lora_keys import fold_scale
from diffusion_pipe.models import REGISTRY, adapter_class
from diffusion_pipe.models.base import Adapter, TensorDict
from diffusion_pipe.models.common import is_image_processor_only
from diffusion_pipe.train.data import noise_latents
from diffusion_pipe.train.lora import AdapterKind, add_lora, lora_state_dict, target_module_names
from diffusion_pipe.train.pipeline import ensure_grad
from tests.adapter_weights import exported_weight_errors

MEDIA = {"image", "video"}
TASKS = {"t2i", "t2v", "i2v", "edit"}
OBJECTIVES = {"flow", "epsilon", "v"}


def random_like_spec(spec: dict, batch: int, seed: int) -> TensorDict:
    """Random tensors (B, *shape) for a latent or text spec."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn((batch, *shape), generator=g).to(getattr(torch, dtype))
            for name, (shape, dtype) in spec.items()}


class Call(NamedTuple):
    """One call of a module: its positional and keyword arguments and what it returned."""

    args: tuple
    kwargs: dict
    out: object


@contextlib.contextmanager
def module_calls(module: nn.Module, *, copy: bool = False) -> Iterator[list[Call]]:
    """Every call of `module` while the block runs, in order: how a pipeline calls its transformer (or a block), to
    compare with what the adapter feeds its pipeline layers. `copy`: the arguments' tensors cloned as the call
    begins (a pipeline may step its latents in place afterwards). The hooks are removed after the block."""
    calls: list[Call] = []
    started: list[tuple[tuple, dict]] = []

    def clone(x: object) -> object:
        return x.clone() if copy and isinstance(x, torch.Tensor) else x

    def before(_module, args, kwargs):
        started.append((tuple(clone(a) for a in args), {k: clone(v) for k, v in kwargs.items()}))

    def after(_module, _args, _kwargs, out):
        calls.append(Call(*started.pop(), out))

    handles = (module.register_forward_pre_hook(before, with_kwargs=True),
               module.register_forward_hook(after, with_kwargs=True))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def lora_deltas(model: nn.Module) -> dict[str, torch.Tensor]:
    """scale * B @ A of every active LoRA module of `model` (peft-injected, whoever injected it)."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    out[name] = module.get_delta_weight(adapter).float()
    return out


def expected_deltas(lora: TensorDict) -> dict[str, torch.Tensor]:
    """B @ A per module of a PEFT-named LoRA whose scale is folded into B."""
    return {key.removesuffix(".lora_A.weight"): lora[key.replace(".lora_A.", ".lora_B.")].float() @ value.float()
            for key, value in lora.items() if key.endswith(".lora_A.weight")}


class AdapterContract:
    """Shared behaviour of every adapter. Subclasses set these and implement `unsplit_forward`."""

    adapter_cls: ClassVar[type[Adapter]]
    pipeline_cls: ClassVar[str]  # the diffusers pipeline class exported LoRAs must load into
    denoiser_attr: ClassVar[str]  # its attribute holding the denoiser ("unet", "transformer")
    media_sizes: ClassVar[tuple[tuple[int, int, int], ...]]  # (width, height, frames) to encode
    roundtrip_formats: ClassVar[tuple[str, ...]]  # export formats the diffusers pipeline loads
    text_max_length: ClassVar[int] = 16
    pipeline_load_kwargs: ClassVar[dict] = {}  # what the round trip passes to the pipeline's from_pretrained

    def unsplit_forward(self, adapter: Adapter, denoiser: nn.Module, inputs: tuple,
                        like: torch.Tensor) -> torch.Tensor:
        """The denoiser's own forward on `model_inputs`' tuple, as latents shaped like `like` (what the
        composed pipeline layers must equal)."""
        raise NotImplementedError

    # ---- fixtures ----------------------------------------------------------------------------------
    @pytest.fixture(scope="class")
    def model_dir(self, tmp_path_factory) -> Path:
        out = tmp_path_factory.mktemp(self.adapter_cls.name)
        self.adapter_cls.build_tiny(out, seed=0)
        return out

    @pytest.fixture(scope="class")
    def adapter(self, model_dir) -> Adapter:
        return self.adapter_cls(model_dir, torch.float32)

    @pytest.fixture(scope="class")
    def lora_model(self, adapter) -> tuple[nn.Module, TensorDict]:
        """The denoiser with LoRA on the default targets and non-zero B (so the adapters take part), and
        its LoRA state dict with the scale folded into B, as the export stage passes it."""
        torch.manual_seed(0)
        denoiser = adapter.load_denoiser(torch.device("cpu"))
        add_lora(denoiser, target_module_names(denoiser, adapter.default_lora_targets, adapter.lora_exclude()),
                 rank=4, alpha=8.0, dropout=0.0)
        for name, p in denoiser.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.1)
        folded = {k: v * 2.0 if ".lora_B." in k else v for k, v in lora_state_dict(denoiser).items()}
        return denoiser, folded

    # ---- identity ----------------------------------------------------------------------------------
    def test_registry_entry(self):
        name = self.adapter_cls.name
        module, _, _ = REGISTRY[name].partition(":")
        assert module.rsplit(".", 1)[1] == name
        assert adapter_class(name) is self.adapter_cls

    def test_capabilities(self, adapter):
        caps = self.adapter_cls.capabilities
        assert set(caps.media) <= MEDIA and caps.media
        assert set(caps.tasks) <= TASKS and caps.tasks
        assert set(caps.all_objectives) <= OBJECTIVES and caps.objective in caps.all_objectives
        assert adapter.objective() in caps.all_objectives
        assert caps.export_formats and set(self.roundtrip_formats) <= set(caps.export_formats)
        assert ("video" in caps.media) == any(f > 1 for _, _, f in self.media_sizes)

    # ---- encode side -------------------------------------------------------------------------------
    def test_encode_media_matches_spec_and_is_deterministic(self, adapter):
        vae = adapter.load_vae(torch.device("cpu"))
        for width, height, frames in self.media_sizes:
            assert width % adapter.pixel_multiple == 0 and height % adapter.pixel_multiple == 0
            g = torch.Generator().manual_seed(width * frames)
            pixels = torch.rand(2, 3, frames, height, width, generator=g) * 2 - 1
            entries = adapter.encode_media(vae, pixels)
            assert len(entries) == 2
            for name, (shape, dtype) in adapter.latent_spec(width, height, frames).items():
                assert tuple(entries[0][name].shape) == shape, (width, height, frames)
                assert entries[0][name].dtype == getattr(torch, dtype)
            again = adapter.encode_media(vae, pixels)
            assert all(torch.equal(entries[i][k], again[i][k]) for i in range(2) for k in entries[i])

    def test_text_components_are_the_models(self, adapter):
        """The directories whose hashes key the text entries are the model's own text encoders and tokenizers."""
        encoders, tokenizers = adapter.text_component_dirs()
        assert encoders and tokenizers
        assert all(d.is_dir() and any(d.iterdir()) for d in (*encoders.values(), *tokenizers.values()))
        # Each loads and tells the words of the probe apart (what encode checks before anything is encoded), and
        # its encoder reads a caption up to a limit encode can count truncated captions against.
        loaded = adapter.load_tokenizers()
        assert loaded and set(loaded) == {name for name, d in tokenizers.items() if not is_image_processor_only(d)}
        limits = adapter.caption_token_limits(loaded, self.text_max_length)
        assert set(limits) <= set(loaded) and all(isinstance(n, int) and n > 0 for n in limits.values())

    def encode_texts(self, adapter, encoders, captions: list[str], image_seed: int = 0) -> list[TensorDict]:
        """Text entries of `captions`; a family whose text encoder reads the sample's conditioning image reads
        each with a random image (seeded by `image_seed`) of the first media size."""
        if not adapter.capabilities.text_reads_conditioning:
            return adapter.encode_text(encoders, captions, self.text_max_length)
        width, height, _ = self.media_sizes[0]
        g = torch.Generator().manual_seed(image_seed)
        images = torch.rand(len(captions), 3, 1, height, width, generator=g) * 2 - 1
        return adapter.encode_conditioned_text(encoders, captions, images, self.text_max_length)

    def test_encode_text_matches_spec_and_is_deterministic(self, adapter):
        encoders = adapter.load_text_encoders(torch.device("cpu"))
        captions = ["a red circle", "a blue square on a white background"]
        texts = self.encode_texts(adapter, encoders, captions)
        spec = adapter.text_spec(self.text_max_length)
        for entry in texts:
            assert set(entry) == set(spec)
            for name, (shape, dtype) in spec.items():
                assert tuple(entry[name].shape) == shape and entry[name].dtype == getattr(torch, dtype)
        again = self.encode_texts(adapter, encoders, captions)
        assert all(torch.equal(texts[i][k], again[i][k]) for i in range(2) for k in spec)
        assert any(not torch.equal(texts[0][k], texts[1][k]) for k in spec)

    def test_build_tiny_is_deterministic_under_seed(self, adapter, tmp_path):
        ours = load_file(str(next(adapter.denoiser_dir().glob("*.safetensors"))))
        self.adapter_cls.build_tiny(tmp_path / "same", seed=0)
        same = self.adapter_cls(tmp_path / "same", torch.float32)
        theirs = load_file(str(next(same.denoiser_dir().glob("*.safetensors"))))
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    # ---- train side --------------------------------------------------------------------------------
    def test_lora_targets_exist(self, adapter, lora_model):
        plain = adapter.load_denoiser(torch.device("cpu"))
        names = target_module_names(plain, adapter.default_lora_targets, adapter.lora_exclude())
        for suffix in adapter.default_lora_targets:
            assert any(n == suffix or n.endswith(f".{suffix}") for n in names), suffix
        assert {k.rsplit(".lora_", 1)[0] for k in lora_model[1]} == set(names)

    def _inputs(self, adapter, batch: int = 2, seed: int = 0, conditioning_seed: int = 100):
        """(clean latents, noised, first-layer inputs) of a random micro-batch, with random conditioning latents
        (edit families' control images, in the target's bucket) as training feeds them."""
        width, height, frames = self.media_sizes[-1]
        spec = adapter.latent_spec(width, height, frames)
        latents = random_like_spec(spec, batch, seed)["latents"]
        text = random_like_spec(adapter.text_spec(self.text_max_length), batch, seed + 1)
        conditioning = tuple(random_like_spec(spec, batch, conditioning_seed + i)["latents"]
                             for i in range(adapter.capabilities.conditioning_latents))
        g = torch.Generator().manual_seed(seed)
        noised = noise_latents(adapter, latents, torch.randn(latents.shape, generator=g), None, "uniform", 1.0, g)
        return latents, noised, adapter.conditioned_inputs(noised.noisy, noised.timesteps, text, 1.0, conditioning)

    def test_conditioning_latents_reach_the_prediction(self, adapter, lora_model):
        """A family's conditioning latents (control images) change the target's prediction, which keeps the
        target's shape; a family without any refuses them."""
        denoiser, _ = lora_model
        if not adapter.capabilities.conditioning_latents:
            latents, noised, _ = self._inputs(adapter)
            with pytest.raises(ValueError, match="conditioning latents per sample, got 1"):
                adapter.conditioned_inputs(noised.noisy, noised.timesteps, {}, 1.0, (latents,))
            return
        predictions = []
        for conditioning_seed in (100, 200):
            latents, _, inputs = self._inputs(adapter, seed=7, conditioning_seed=conditioning_seed)
            x = inputs
            with torch.no_grad():
                for layer in adapter.pipeline_layers(denoiser):
                    x = layer(x)
            predictions.append(adapter.prediction_to_latents(x, latents))
        assert predictions[0].shape == latents.shape
        assert (predictions[0] - predictions[1]).abs().max() > 1e-4
        _, noised, _ = self._inputs(adapter)
        with pytest.raises(ValueError, match="conditioning latents per sample, got 0"):  # a sample without them
            adapter.conditioned_inputs(noised.noisy, noised.timesteps, {}, 1.0, ())

    def test_kept_clean_latents_and_the_target_match_the_prediction(self, adapter, lora_model):
        """What `keep_clean` leaves in the target has the shape `prediction_to_latents` gives the prediction for
        it (the loss compares like with like); latents it keeps clean enter the model unnoised; every family
        keeps an image's (one latent frame, or no frame axis) whole target."""
        denoiser, _ = lora_model
        latents, noised, _ = self._inputs(adapter)
        noisy, target = adapter.keep_clean(noised.noisy, noised.target, latents)
        assert noisy.shape == latents.shape
        kept = target.shape != noised.target.shape
        if kept:  # the clean part is the leading frames, exactly the latents there
            clean = latents.shape[2] - target.shape[2]
            assert torch.equal(noisy[:, :, :clean], latents[:, :, :clean])
            assert torch.equal(noisy[:, :, clean:], noised.noisy[:, :, clean:])
            assert torch.equal(target, noised.target[:, :, clean:])
        text = random_like_spec(adapter.text_spec(self.text_max_length), len(latents), 1)
        conditioning = tuple(random_like_spec(adapter.latent_spec(*self.media_sizes[-1]), len(latents), 100 + i)[
            "latents"] for i in range(adapter.capabilities.conditioning_latents))
        x = adapter.conditioned_inputs(noisy, noised.timesteps, text, 1.0, conditioning)
        with torch.no_grad():
            for layer in adapter.pipeline_layers(denoiser):
                x = layer(x)
        assert adapter.prediction_to_latents(x, target).shape == target.shape
        image = adapter.latent_spec(*self.media_sizes[0])["latents"][0]
        image_latents = random_like_spec({"latents": (image, "float32")}, 1, 3)["latents"]
        noise = torch.randn(image_latents.shape)
        assert torch.equal(adapter.keep_clean(noise, noise, image_latents)[1], noise)

    def test_pipeline_layers_equal_unsplit_forward(self, adapter, lora_model):
        denoiser, _ = lora_model
        latents, _, inputs = self._inputs(adapter)
        x = inputs
        layers = adapter.pipeline_layers(denoiser)
        for layer in layers[:-1]:
            x = layer(x)
            assert isinstance(x, tuple) and all(isinstance(t, torch.Tensor) for t in x)
            # any layer may end a pipeline stage, whose float outputs are sent marked as requiring grad (masks too)
            x = tuple(ensure_grad(t) for t in x)
        split = adapter.prediction_to_latents(layers[-1](x), latents)
        with torch.no_grad():
            full = self.unsplit_forward(adapter, denoiser, inputs, latents)
        assert split.shape == latents.shape
        # float32 on CPU: the two paths may take different kernels (autograd on or off), which differ by a few
        # ulps that depend on the processor (2e-5 on outputs of about 2 on one AMD EPYC); a wrong split is off
        # by far more.
        assert torch.allclose(split, full, atol=1e-4), (split - full).abs().max()
        # Gradients reach the LoRA weights through every layer.
        split.square().mean().backward()
        grads = [p.grad for n, p in denoiser.named_parameters() if "lora_A" in n]
        assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
        denoiser.zero_grad(set_to_none=True)

    def test_pipeline_layers_compute_no_more_than_the_unsplit_forward(self, adapter, lora_model):
        """The layers do the transformer's own work and no more (matmul and attention FLOPs, counted on one sample:
        a batch pads captions to the longest, which some unsplit forwards run one by one): work a layer repeats
        per token that the transformer does once per sample shows here on the tiny model."""
        from torch.utils.flop_counter import FlopCounterMode

        denoiser, _ = lora_model
        latents, _, inputs = self._inputs(adapter, batch=1)
        counts = []
        for run in ("split", "full"):
            counter = FlopCounterMode(display=False)
            with torch.no_grad(), counter:
                if run == "split":
                    x = inputs
                    for layer in adapter.pipeline_layers(denoiser):
                        x = layer(x)
                else:
                    self.unsplit_forward(adapter, denoiser, inputs, latents)
            counts.append(counter.get_total_flops())
        assert counts[0] <= counts[1] * 1.001, counts

    def test_layers_built_as_training_builds_them_match(self, adapter, lora_model):
        """Meta init + per-stage weight loading (train/build.py) leaves no meta tensor in any layer, and
        the LoRA-free layers compute the plain denoiser's forward."""
        from diffusion_pipe.train.build import build_local_model

        local = build_local_model(adapter, 1, 0, targets=adapter.default_lora_targets, rank=4, alpha=4.0,
                                  dropout=0.0, seed=0)
        meta = [n for layer in local.layers for n, t in [*layer.named_parameters(), *layer.named_buffers()]
                if t.device.type == "meta"]
        assert not meta
        latents, _, inputs = self._inputs(adapter, seed=5)
        x = inputs
        with torch.no_grad():
            for layer in local.layers:
                x = layer(x)
            plain = self.unsplit_forward(adapter, adapter.load_denoiser(torch.device("cpu")), inputs, latents)
        assert torch.allclose(adapter.prediction_to_latents(x, latents), plain, atol=1e-5)

    def test_forward_is_deterministic_under_seed(self, adapter, lora_model):
        denoiser, _ = lora_model
        outs = []
        for _ in range(2):
            latents, noised, inputs = self._inputs(adapter, seed=3)
            with torch.no_grad():
                outs.append(self.unsplit_forward(adapter, denoiser, inputs, latents))
        assert torch.equal(outs[0], outs[1])

    def test_objective_noises_and_targets_in_latent_shape(self, adapter):
        latents, noised, inputs = self._inputs(adapter)
        assert noised.noisy.shape == noised.target.shape == latents.shape
        lo, hi = adapter.timestep_range()
        q = torch.tensor([0.0, 1.0])
        at_ends = noise_latents(adapter, latents, torch.randn(latents.shape), q, "uniform", 1.0,
                                torch.Generator().manual_seed(0))
        assert at_ends.timesteps[0] < at_ends.timesteps[1]  # quantile 1 is the noisiest step
        if adapter.objective() == "flow":
            assert torch.allclose(at_ends.timesteps, torch.tensor([lo, hi]))

    # ---- export side -------------------------------------------------------------------------------
    def test_every_format_exports(self, adapter, lora_model):
        """Every declared format maps the LoRA (fused layouts may merge modules; the round trip below checks
        the values), alphas are scalars, and an unknown format names the param."""
        _, lora = lora_model
        for fmt in adapter.capabilities.export_formats:
            out = adapter.export_lora(lora, fmt)
            assert out and all(isinstance(v, torch.Tensor) for v in out.values()), fmt
            assert all(v.ndim == 0 for k, v in out.items() if k.endswith(".alpha")), fmt
        with pytest.raises(ValueError, match=f"export.formats: 'nope' is not supported by family '{adapter.name}' "
                           rf"\(supported: {', '.join(adapter.capabilities.export_formats)}\)"):
            adapter.export_lora(lora, "nope")

    @pytest.mark.parametrize("kind", [AdapterKind("loha"), AdapterKind("lora", dora=True), AdapterKind("lokr")],
                             ids=["loha", "dora", "lokr"])
    def test_lycoris_and_dora_exports_apply_the_trained_weights(self, adapter, kind):
        """LoHa, DoRA and LoKr on the default targets, every factor off its init, at alpha != rank: each ComfyUI /
        kohya key, rebuilt with the LyCORIS formulas, makes the weight the trained peft modules make. LoHa always
        exports; DoRA and LoKr may be refused, naming the fix, where the layout fuses projections (LoKr) or fuses
        one of them with an untrained part (DoRA)."""
        denoiser = adapter.load_denoiser(torch.device("cpu"))
        add_lora(denoiser, target_module_names(denoiser, adapter.default_lora_targets, adapter.lora_exclude()),
                 rank=4, alpha=8.0, dropout=0.0, kind=kind)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in denoiser.parameters():
                if param.requires_grad:
                    param.add_(0.3 * torch.randn(param.shape, generator=generator))
        folded = fold_scale(lora_state_dict(denoiser), 4, 8.0)
        for fmt in set(adapter.capabilities.export_formats) & set(LYCORIS_FORMATS):
            try:
                exported = export_adapter(adapter, folded, fmt)
            except ValueError as exc:
                assert kind.name != "loha" and re.search(r"fused .*(train adapter: loha|train\.lora_dora: false)",
                                                         str(exc)), exc
                continue
            assert exported_weight_errors(adapter, denoiser, exported, fmt) == {}, fmt

    def test_sample_pipeline_renders_stored_embeddings(self, adapter, lora_model, tmp_path):
        """Samples during training: the family's pipeline over the LoRA-wrapped denoiser, with prompts as text
        entries and no text encoder, renders the size asked for, deterministically under the prompt's seed; an
        edit family renders from the prompt's control image, and another control image gives another sample."""
        import dataclasses

        from PIL import Image

        from diffusion_pipe.params import SamplePrompt
        from diffusion_pipe.sample.render import check_prompt, encode_sample_texts, prompt_texts, render_prompts

        if type(adapter).pipeline_class is Adapter.pipeline_class:
            pytest.skip(f"family '{adapter.name}' does not render samples yet")
        cpu = torch.device("cpu")
        multiple = adapter.sample_size_multiple()
        width = height = multiple * max(1, -(-32 // multiple))  # about 32 pixels, as the family allows
        frames = self.media_sizes[-1][2]
        controls = []
        if adapter.samples_need_control:
            for i, colour in enumerate(((200, 30, 30), (30, 30, 200))):
                controls.append(str(tmp_path / f"control{i}.png"))
                Image.new("RGB", (48, 40), colour).save(controls[-1])
        prompts = (SamplePrompt("a red circle", seed=1, width=width, height=height, frames=frames, steps=2,
                                guidance=2.0, cfg_scale=2.0, control=controls[0] if controls else ""),)
        check_prompt(adapter, prompts[0])
        others = (dataclasses.replace(prompts[0], control=controls[1]),) if controls else ()
        encoders = adapter.load_text_encoders(cpu)
        texts = encode_sample_texts(adapter, encoders, prompt_texts(adapter, prompts + others), self.text_max_length)
        pipe = adapter.sample_pipeline(lora_model[0], adapter.load_vae(cpu))
        first, again = (render_prompts(pipe, adapter, prompts, texts, cpu)[0] for _ in range(2))
        assert first.shape == (frames, height, width, 3)
        assert (first == again).all()
        if controls:
            other = render_prompts(pipe, adapter, others, texts, cpu)[0]
            assert np.abs(other.astype(int) - first.astype(int)).max() > 0

    def test_exported_lora_round_trips_into_diffusers_pipeline(self, adapter, lora_model, model_dir):
        import diffusers

        _, lora = lora_model
        want = expected_deltas(lora)
        for fmt in self.roundtrip_formats:
            pipe = getattr(diffusers, self.pipeline_cls).from_pretrained(model_dir, dtype=torch.float32,
                                                                         **self.pipeline_load_kwargs)
            pipe.load_lora_weights({k: v.clone() for k, v in adapter.export_lora(lora, fmt).items()})
            got = lora_deltas(getattr(pipe, self.denoiser_attr))
            assert set(got) == set(want), (fmt, sorted(set(got) ^ set(want))[:5])
            for name in want:
                assert torch.allclose(got[name], want[name], atol=1e-6), (fmt, name)
