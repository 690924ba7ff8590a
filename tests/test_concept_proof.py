"""The learning proof: a LoRA trained by the pipeline makes the model paint what its data shows.

examples/concept-tiny holds a tiny Flux base model pretrained (scripts/make_concept_base.py) on shapes in four
colours, and a LoRA dataset of shapes in a fifth colour it never saw, captioned "purple"; examples/concept-sdxl-tiny
and examples/concept-wan-tiny a tiny SDXL and Wan base pretrained on the same images (through the adapter
contract), trained on the same LoRA dataset. `dvc repro` on that
example trains and exports the LoRA, and its sample stage renders the prompts without and then with the exported
file loaded by `load_lora_weights`; here the purple is measured in those pixels. The Flux example runs once more
as a full fine-tune (train.adapter: full), its exported denoiser loaded with `from_pretrained`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffusion_pipe.concept_proof import BASE_COLOURS, CONCEPT_WORD, colour_fraction
from tests.conftest import REPO, make_pipeline_repo
from tests.encode.helpers import reproduce

# Thresholds from measured values (BENCHMARKS.md, Learning proof) with margin, per example: each family's tiny
# base paints its own way (the Wan base's noisier blobs leave fewer pixels near purple).
# Flux measured: trigger prompts 0.26, 0.27, 0.145 of pixels purple with the LoRA, 0, 0, 0.023 without; prompts
# without the trigger word 0 purple with it, their pixels moved 7-15/255, their named colour kept.
# Wan measured: trigger prompts 0.171, 0.140, 0.065 with the LoRA, 0 without; the others 0 purple with it,
# moved 4-13/255, their named colour kept.
# SDXL measured: trigger prompts 0.105, 0.412, 0.091 with the LoRA, 0 without; the others 0 purple with it,
# moved 2-18/255, their named colour kept.
TRIGGER_WITHOUT_MAX = 0.05  # each trigger prompt without the LoRA (the base never saw purple): at most this
OTHER_WITH_MAX = 0.02  # prompts without the trigger word, with the LoRA: hardly any purple
OTHER_CHANGE_MAX = 25.0  # ... and their pixels move little (mean absolute difference, 0-255)
# each trigger prompt with the LoRA: at least this fraction of pixels purple, and on average over them
# Flux full fine-tune (train.adapter: full, lr 5e-4) measured: 0.239, 0.138, 0.142 with it, 0, 0, 0.023 without;
# the others 0 purple, moved 7-22/255, their named colour kept.
TRIGGER_WITH_MIN = {"concept-tiny": 0.07, "concept-sdxl-tiny": 0.05, "concept-wan-tiny": 0.035,
                    "concept-tiny-full": 0.07}
TRIGGER_WITH_MEAN_MIN = {"concept-tiny": 0.12, "concept-sdxl-tiny": 0.10, "concept-wan-tiny": 0.08,
                         "concept-tiny-full": 0.12}
# a case that is not an example of its own: the example it runs and its params edits
VARIANTS = {"concept-tiny-full": ("concept-tiny", {
    "lora_rank: 8": "lora_rank: 8\n  adapter: full", "learning_rate: 5.0e-3": "learning_rate: 5.0e-4",
    "formats: [diffusers, comfyui]": "formats: [diffusers]"})}


def concept_measurements(repo: Path) -> list[dict]:
    """Per sample prompt of the repo's params: whether it names the concept, the purple fraction without and
    with the LoRA, the fraction of its named base colour, and the mean pixel change, from the sample stage's
    images (reports/lora_samples/<i>-without.png, <i>-with.png)."""
    out = []
    for i, entry in enumerate(json.loads((repo / "reports/sample.json").read_text())["prompts"]):
        without, with_lora = (np.asarray(Image.open(repo / f"reports/lora_samples/{i:02d}-{tag}.png").convert("RGB"))
                              for tag in ("without", "with"))
        named = next((c for c in BASE_COLOURS if f" {c} " in entry["prompt"]), None)
        out.append({
            "prompt": entry["prompt"], "trigger": f" {CONCEPT_WORD} " in entry["prompt"],
            "concept_without": colour_fraction(without, CONCEPT_WORD),
            "concept_with": colour_fraction(with_lora, CONCEPT_WORD),
            "named_without": colour_fraction(without, named) if named else None,
            "named_with": colour_fraction(with_lora, named) if named else None,
            "mean_abs_difference": entry["mean_abs_difference"],
        })
    return out


def train_concept_lora(root: Path, params_edits: dict[str, str] | None = None, example: str = "concept-tiny") -> Path:
    """`dvc repro` (scan, encode, train, export, sample) on an example's params in a throwaway repo."""
    store = root / "store"
    repo = make_pipeline_repo(root / "repo", store)
    params = (REPO / "examples" / example / "params.yaml").read_text()
    for old, new in (params_edits or {}).items():
        assert old in params, old
        params = params.replace(old, new)
    (repo / "params.yaml").write_text(params)
    assert reproduce(repo, store) == ["scan", "encode", "train", "export", "sample"]
    return repo


@pytest.mark.slow  # on 2 CPU cores: about 65 s for Flux (100 s full), 3 minutes each for SDXL and Wan
@pytest.mark.parametrize("case", sorted(TRIGGER_WITH_MIN))
def test_lora_teaches_a_colour_the_base_never_saw(tmp_path, case):
    """Per family's example; concept-tiny-full is the Flux example as a full fine-tune (train.adapter: full),
    exported as a denoiser directory that the sample stage loads with from_pretrained."""
    example, edits = VARIANTS.get(case, (case, {}))
    repo = train_concept_lora(tmp_path, edits, example=example)
    measured = concept_measurements(repo)
    print(json.dumps(measured, indent=1))
    triggers = [m for m in measured if m["trigger"]]
    others = [m for m in measured if not m["trigger"]]
    assert len(triggers) == 3 and len(others) == 3
    for m in triggers:
        assert m["concept_without"] <= TRIGGER_WITHOUT_MAX, m
        assert m["concept_with"] >= TRIGGER_WITH_MIN[case], m
    assert np.mean([m["concept_with"] for m in triggers]) >= TRIGGER_WITH_MEAN_MIN[case]
    for m in others:
        assert m["concept_with"] <= OTHER_WITH_MAX, m
        assert m["mean_abs_difference"] <= OTHER_CHANGE_MAX, m
        assert m["named_with"] >= 0.5 * m["named_without"], m  # the base's own colours survive the LoRA
