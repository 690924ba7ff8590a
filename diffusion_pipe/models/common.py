"""Helpers shared by adapters: loading components, dtype names, tiny tokenizers for tests and examples."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str, param: str, local_rank: int = 0) -> torch.device:
    """'auto' -> cuda when available, else cpu; 'cuda' without a GPU is an error naming `param`. Under a
    launcher, worker `local_rank` takes GPU `local_rank` of its machine."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            from diffusion_pipe.config import ConfigError

            raise ConfigError(f"{param}: 'cuda' asked for but no CUDA GPU is visible; set it to 'auto' or 'cpu'")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device(name)


@dataclass
class PipelineTextEncoder:
    """A family's diffusers pipeline over its text encoder and tokenizer only: the pipeline's own `encode_prompt`
    makes the text entries (what `Adapter.load_text_encoders` returns for most families)."""

    pipeline: object


def bare_pipeline(cls: type, **components: object) -> object:
    """The diffusers pipeline `cls` over `components`, with None for every other component its __init__ requires:
    its own prompt encoding, latent packing and position ids, without loading any model."""
    import inspect

    required = {name: None for name, p in inspect.signature(cls.__init__).parameters.items()
                if name != "self" and p.default is inspect.Parameter.empty}
    return cls(**(required | components))


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32, and so on."""
    return str(dtype).removeprefix("torch.")


def load_component(cls: type, directory: Path, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """`cls.from_pretrained(directory)` frozen, in eval mode, in `dtype` on `device`: a clear error if absent.
    A model view's single-file component loads from its file (diffusion_pipe.models.checkpoints)."""
    from diffusion_pipe.model_folder import model_folder_error, require_file
    from diffusion_pipe.models.checkpoints import load_single_file_component, read_single_file_marker

    require_file(directory / "config.json")
    single = read_single_file_marker(directory)
    if single is not None:
        module = load_single_file_component(cls, directory, single, dtype)
    elif shards := pinned_load_shards(cls, directory, dtype, device):
        from transformers import AutoConfig

        from diffusion_pipe.models.device_load import load_safetensors_to_device

        config = (getattr(cls, "config_class", None) or AutoConfig).from_pretrained(directory)
        state = load_safetensors_to_device(shards, device)
        module = model_around(cls, config, state, dtype) or cls.from_pretrained(
            None, config=config, state_dict=state, dtype=dtype, device_map=device)
    else:
        from safetensors import SafetensorError

        try:
            module = cls.from_pretrained(directory, torch_dtype=dtype)
        # diffusers and transformers say "no file named ..." (and diffusers a file cut short) as an OSError;
        # transformers lets safetensors' own error about a file cut short through
        except (OSError, SafetensorError) as exc:
            raise model_folder_error(directory, f"{cls.__name__} cannot load from it ({exc})",
                                     directory.parent) from exc
    module.requires_grad_(False)
    return module.eval().to(device)


PINNED_LOAD_MIN_BYTES = 1 << 30


def pinned_load_shards(cls: type, directory: Path, dtype: torch.dtype, device: torch.device) -> list[Path]:
    """The safetensors shards of a transformers model to load straight onto a CUDA `device` through pinned memory
    (diffusion_pipe.models.device_load: BENCHMARKS.md, Encode), or [] where `from_pretrained` to host memory is
    kept: another device, a diffusers model, under PINNED_LOAD_MIN_BYTES, a floating-point tensor stored in
    another dtype than `dtype` (converting on the device would hold both copies there at once), or a dtype the
    loader cannot read."""
    from transformers import PreTrainedModel
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    from diffusion_pipe.model_folder import read_model_json
    from diffusion_pipe.models.checkpoints import SAFETENSORS_DTYPES
    from diffusion_pipe.models.device_load import read_header

    if torch.device(device).type != "cuda" or not issubclass(cls, (PreTrainedModel, _BaseAutoModelClass)):
        return []
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted({directory / name for name in read_model_json(index).get("weight_map", {}).values()})
    else:
        shards = [directory / "model.safetensors"]
    if not all(shard.is_file() for shard in shards) or sum(s.stat().st_size for s in shards) < PINNED_LOAD_MIN_BYTES:
        return []
    stored = {SAFETENSORS_DTYPES.get(info["dtype"]) for shard in shards for info in read_header(shard)[1].values()}
    return shards if all(d is not None and (d == dtype or not d.is_floating_point) for d in stored) else []


def model_around(cls: type, config, state: dict[str, torch.Tensor], dtype: torch.dtype) -> nn.Module | None:
    """The transformers model `cls` of `config` in `dtype` whose parameters are the tensors of `state` (in `dtype`)
    themselves (no copy, no random init: built with its parameters on the meta device, then assigned; tied weights
    tied; buffers the model computes, such as rotary frequencies, built on the host as usual), or None where that
    is not the model `from_pretrained` gives: a parameter the checkpoint does not name as the model does (a renamed
    key), or modules transformers keeps in float32 in `dtype` (T5's `wo` in float16, where it would overflow).
    `from_pretrained(state_dict=...)` then builds it, at the cost of initialising it first. Keys the model has no
    place for are ignored, as `from_pretrained` ignores them."""
    from accelerate import init_empty_weights
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    with init_empty_weights(include_buffers=False):
        model = cls.from_config(config) if issubclass(cls, _BaseAutoModelClass) else cls(config)
    if model._get_dtype_plan(dtype):  # modules from_pretrained would keep in float32 in this dtype
        return None
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return None
    return model


# Words a working tokenizer of any family's vocabulary encodes to different ids. A folder without its vocabulary
# files (tokenizer.json, vocab.json + merges.txt, spiece.model) still loads: transformers builds a tokenizer of
# its special tokens alone that maps every word to <unk>, so every caption would encode alike (five of these
# words have three letters each, which catches a vocabulary whose every character is unknown too).
TOKENIZER_PROBE = "a red cat sat on a big dog"


# Files of which a tokenizer folder holds at least one (its config, or its vocabulary in one of the formats)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "vocab.json", "spiece.model", "tokenizer.model")


def is_image_processor_only(directory: Path) -> bool:
    """Whether `directory` holds an image processor's settings (preprocessor_config.json) and no tokenizer file:
    a text component that is not a tokenizer. A folder with neither is a tokenizer with its files missing."""
    directory = Path(directory)
    return ((directory / "preprocessor_config.json").is_file()
            and not any((directory / name).is_file() for name in TOKENIZER_FILES))


def load_tokenizer(directory: Path) -> object:
    """The tokenizer in `directory` (a tokenizer folder, or a processor folder holding one), through
    `AutoTokenizer`, checked to tell the words of `TOKENIZER_PROBE` apart: a ModelFolderError naming the folder
    when it is missing, cannot be loaded, or maps different words to the same ids (its vocabulary files are
    missing or broken)."""
    from transformers import AutoTokenizer

    from diffusion_pipe.model_folder import model_folder_error, require_dir

    directory = require_dir(Path(directory))
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError, TypeError) as exc:  # no tokenizer class, unreadable or missing files
        raise model_folder_error(directory, f"transformers cannot load a tokenizer from it ({exc})",
                                 directory.parent) from exc
    ids: dict[tuple[int, ...], list[str]] = {}
    for word in dict.fromkeys(TOKENIZER_PROBE.split()):
        ids.setdefault(tuple(tokenizer(word, add_special_tokens=False)["input_ids"]), []).append(word)
    if alike := next((words for key, words in ids.items() if len(words) > 1 or not key), None):
        raise model_folder_error(
            directory, f"its tokenizer ({type(tokenizer).__name__}, {len(tokenizer)} tokens) encodes the words "
            f"{', '.join(repr(w) for w in alike)} alike, so every caption would train as the same text: its "
            "vocabulary files (tokenizer.json, or vocab.json and merges.txt, or spiece.model / tokenizer.model) are "
            "missing or broken", directory.parent)
    return tokenizer


HUB_CONFIG_PATTERNS = ["*.json", "*.txt", "*.model", "tokenizer*/*"]  # fnmatch: '*' spans folders too


def resolve_model_dir(path: str, root: Path | None = None, allow_patterns: list[str] | None = None) -> Path:
    """A local diffusers directory (relative to `root`, default the working directory) as is; otherwise a hub
    id, resolved to its local snapshot in the Hugging Face cache (HF_HOME; downloaded once when the hub is
    reachable, read from the cache when offline or HF_HUB_OFFLINE=1). `allow_patterns` limits what is fetched
    (default: configs, tokenizers and safetensors weights)."""
    local = Path(root) / path if root is not None else Path(path)
    if local.is_dir():
        return local.resolve()
    if local.is_absolute() or path.startswith((".", "~")) or path.count("/") != 1:
        raise FileNotFoundError(f"model.path: {path!r} is neither a directory nor a hub id like 'org/name'")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path, allow_patterns=allow_patterns or [*HUB_CONFIG_PATTERNS,
                                                                              "*.safetensors"]))
    except Exception as exc:  # offline and not cached, gated, misspelled: all say the same thing to a user
        raise FileNotFoundError(
            f"model.path: could not find {path!r} locally or download it from the hub ({exc}); "
            "point model.path at a local diffusers directory"
        ) from exc


TOKENIZER_CORPUS = [
    "a red circle on a white background", "a green square on a black background",
    "a blue triangle on a gray background", "a yellow circle and a purple square",
    "a photo of a cat", "an orange ring", "a small large big tiny shape", "the quick brown fox jumps over the lazy dog",
    "0 1 2 3 4 5 6 7 8 9 , . ! ? - : ; ' \" ( )",
]


def save_tiny_tokenizers(out_dir: Path, corpus: Sequence[str] = TOKENIZER_CORPUS,
                         vocab_sizes: tuple[int, int] = (300, 200)) -> tuple[object, object]:
    """Train a CLIP-style BPE and a T5-style Unigram tokenizer on a few sentences (`corpus`, to vocabularies of
    `vocab_sizes`), no hub needed, and save them to `out_dir/tokenizer` and `out_dir/tokenizer_2`. Returns
    (clip_tokenizer, t5_tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import CLIPTokenizer, T5TokenizerFast

    bpe = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_sizes[0], special_tokens=["<|startoftext|>", "<|endoftext|>"], end_of_word_suffix="</w>",
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    ))
    model = bpe.model
    vocab = bpe.get_vocab()
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model.save(tmp)
        merges = [tuple(line.split()) for line in Path(tmp, "merges.txt").read_text().splitlines()
                  if line and not line.startswith("#")]
    clip = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)
    clip.save_pretrained(out_dir / "tokenizer")

    uni = Tokenizer(models.Unigram())
    uni.pre_tokenizer = pre_tokenizers.Metaspace()
    uni.train_from_iterator(corpus, trainers.UnigramTrainer(
        vocab_size=vocab_sizes[1], special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
    ))
    vocab_scores = json.loads(uni.to_str())["model"]["vocab"]
    t5 = T5TokenizerFast(vocab=[tuple(v) for v in vocab_scores], extra_ids=0, model_max_length=512)
    t5.save_pretrained(out_dir / "tokenizer_2")
    return clip, t5


def save_tiny_t5_encoder(out_dir: Path, tokenizer: object, model_cls: type, config_cls: type) -> None:
    """A 2-layer, 32-wide T5-style encoder (`model_cls` over `config_cls`: T5's or UMT5's) reading `tokenizer`'s
    vocabulary, saved to `out_dir`; its weights drawn from torch's global RNG as seeded by the caller."""
    model_cls(config_cls(
        vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
    )).save_pretrained(out_dir)


QWEN_SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>")


def save_tiny_qwen_tokenizer(out_dir: Path, template: str = "", chat_template: str | None = None,
                             special_tokens: tuple[str, ...] = ()) -> object:
    """A byte-level BPE trained on a few sentences and on `template` (the prompt template a pipeline wraps
    captions in, so its words become single tokens as in Qwen's real vocabulary, and a pipeline that drops the
    template by token count drops exactly it), wrapped in `Qwen2Tokenizer` with the chat special tokens (and
    `special_tokens`, e.g. a VL model's vision tokens) and `chat_template`, saved to `out_dir`. Returns the
    tokenizer."""
    import tempfile

    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    text = template
    specials = (*QWEN_SPECIAL_TOKENS, *special_tokens)
    for special in specials:
        text = text.replace(special, "\n")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator([*TOKENIZER_CORPUS, text], trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", *specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    ))
    with tempfile.TemporaryDirectory() as tmp:
        bpe.model.save(tmp)
        merges = [tuple(line.split()) for line in Path(tmp, "merges.txt").read_text().splitlines()
                  if line and not line.startswith("#")]
    tokenizer = Qwen2Tokenizer(vocab=bpe.get_vocab(), merges=merges, model_max_length=32768)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials],
                         special_tokens=True)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def image_only_qwen_vl_processor(processor_dir: Path, processor: str = "Qwen2VLProcessor") -> object:
    """The Qwen-VL processor `processor` (transformers' Qwen2VLProcessor or Qwen3VLProcessor) saved in
    `processor_dir` (its tokenizer, chat template and image processor), without the video processor: transformers
    builds the stock one only with torchvision (its video processor needs it). The image processor is the PIL one, on
    a machine with torchvision too, so text keys and entries do not depend on what is installed. Pipelines that take
    the processor as their VL model's tokenizer (Qwen-Image-Edit and 2.1, Kandinsky 5) call it on text and images
    only."""
    import transformers
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    class ImageOnlyProcessor(getattr(transformers, processor)):
        """The processor for text and images only: its attributes are the ones this signature names."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    tokenizer = AutoTokenizer.from_pretrained(processor_dir)
    return ImageOnlyProcessor(image_processor=Qwen2VLImageProcessorPil.from_pretrained(processor_dir),
                              tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def vae_latent_stats(model_dir: Path, model_name: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A VAE's `latents_mean` / `latents_std` buffers, stored with its weights rather than in its config (LTX-Video's
    and LTX-2's), and its config's `scaling_factor`; `model_name` names the model in the error for a folder
    without weights."""
    from safetensors import safe_open

    from diffusion_pipe.model_folder import model_folder_error, read_model_json, require_dir

    path = next(iter(sorted(require_dir(model_dir / "vae").glob("*.safetensors"))), None)
    if path is None:
        raise model_folder_error(model_dir / "vae", f"no .safetensors weights of the {model_name} VAE", model_dir)
    with safe_open(str(path), framework="pt") as f:
        if missing := {"latents_mean", "latents_std"} - set(f.keys()):
            raise model_folder_error(path, f"no {' or '.join(sorted(missing))} tensor: not the {model_name} VAE's "
                                     "weights", model_dir)
        mean, std = f.get_tensor("latents_mean"), f.get_tensor("latents_std")
    config = read_model_json(model_dir / "vae" / "config.json", model_dir)
    return mean.float(), std.float(), float(config.get("scaling_factor", 1.0))


def padded_text_entry(states: torch.Tensor, max_length: int) -> dict[str, torch.Tensor]:
    """The text entry of one caption's token states (tokens, width): `prompt_embeds` zero-padded to `max_length`
    rows, `prompt_mask` 1 on the caption's own rows and 0 on the padding."""
    padded = states.new_zeros(max_length, states.shape[-1])
    padded[:len(states)] = states
    mask = torch.zeros(max_length, dtype=torch.long)
    mask[:len(states)] = 1
    return {"prompt_embeds": padded.contiguous().cpu(), "prompt_mask": mask}


def attention_mask(mask: torch.Tensor) -> torch.Tensor | None:
    """A main layer's attention mask from the one its family's first layer sends over the joint sequence: None for
    a (B, 1) mask, which stands for "no item is padded". The transformers (Z-Image, Lumina 2) pass None then, and
    so must we: a mask, even all ones, keeps scaled_dot_product_attention off its flash kernel (Z-Image's split
    forward measured 37% behind the plain loop with one, 4% without). Told by the shape, so no layer waits on the
    device to decide."""
    return None if mask.shape[1] == 1 else mask.bool()
