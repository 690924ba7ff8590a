"""load_safetensors_to_device: every tensor of safetensors files, read in chunks by several threads, equal to
what safetensors itself loads (the CUDA path, pinned buffers and a side stream, is in tests/test_gpu.py)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffusion_pipe.model_folder import ModelFolderError
from diffusion_pipe.models.device_load import load_safetensors_to_device


def tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(33, 17, generator=gen).bfloat16(), "b": torch.randn(5, generator=gen),
            "ids": torch.randint(-9, 9, (11,), generator=gen, dtype=torch.int8),
            "half": torch.randn(2, 3, 4, generator=gen).half(), "step": torch.tensor(7, dtype=torch.int64),
            "empty": torch.empty(0, 4), "fp8": torch.randn(6, generator=gen).to(torch.float8_e4m3fn)}


def assert_same(loaded: dict, reference: dict) -> None:
    assert loaded.keys() == reference.keys()
    for name, want in reference.items():
        got = loaded[name]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name


@pytest.mark.parametrize("chunk_bytes,readers", [(1 << 20, 4), (64, 3), (7, 1), (100, 8)])
def test_shards_load_as_safetensors_loads_them(tmp_path, chunk_bytes, readers):
    files = []
    reference = {}
    for i in range(3):  # a sharded checkpoint: the state is the union of its files
        shard = {f"shard{i}.{name}": t for name, t in tensors(i).items()}
        save_file(shard, tmp_path / f"model-{i}.safetensors", metadata={"format": "pt"})
        files.append(tmp_path / f"model-{i}.safetensors")
        reference |= load_file(files[-1])
    assert_same(load_safetensors_to_device(files, torch.device("cpu"), chunk_bytes, readers), reference)


def write_by_hand(path, entries: list[tuple[str, str, list[int], bytes]]) -> None:
    """A safetensors file laid out in the given order (safetensors itself sorts by alignment)."""
    header, offset, data = {}, 0, b""
    for name, dtype, shape, raw in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset, data = offset + len(raw), data + raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_a_tensor_at_an_offset_its_dtype_cannot_view_is_copied(tmp_path):
    """Three int8 bytes first put the bf16 tensor at an odd offset: a view of the file's bytes cannot express it."""
    weight = torch.randn(4, 3).bfloat16()
    raw = weight.view(torch.uint8).numpy().tobytes()
    tensors = [("ids", "I8", [3], bytes([1, 2, 255])), ("weight", "BF16", [4, 3], raw)]
    write_by_hand(tmp_path / "odd.safetensors", tensors)
    loaded = load_safetensors_to_device([tmp_path / "odd.safetensors"], torch.device("cpu"), chunk_bytes=5)
    assert loaded["ids"].tolist() == [1, 2, -1]
    assert torch.equal(loaded["weight"], weight)
    assert torch.equal(loaded["weight"], load_file(tmp_path / "odd.safetensors")["weight"])


def test_a_truncated_file_is_named(tmp_path):
    save_file(tensors(0), tmp_path / "whole.safetensors")
    raw = (tmp_path / "whole.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[:-10])
    # a UserError the stages print as one line, naming the model folder's layout (an OSError was a traceback)
    with pytest.raises(ModelFolderError, match="cut.safetensors: the file ends .*truncated.* a diffusers-format"):
        load_safetensors_to_device([tmp_path / "cut.safetensors"], torch.device("cpu"), chunk_bytes=64)


def tiny_t5(directory, dtype=torch.bfloat16, max_shard_size=None):
    from transformers import T5Config, T5EncoderModel

    model = T5EncoderModel(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4))
    model.to(dtype).save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return T5EncoderModel


def test_large_transformers_weights_stored_in_the_asked_dtype_go_through_pinned_memory(tmp_path, monkeypatch):
    """The shards load_component streams to a CUDA device: all of them (a sharded checkpoint's index names them),
    and only where that is a win and safe; every other case keeps from_pretrained to host memory."""
    from diffusers import AutoencoderKL

    from diffusion_pipe.models import common

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    cls = tiny_t5(tmp_path / "one")
    tiny_t5(tmp_path / "sharded", max_shard_size="20KB")
    tiny_t5(tmp_path / "float32", torch.float32)
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 1
    assert common.pinned_load_shards(cls, tmp_path / "one", torch.bfloat16, cuda) == []  # under 1 GiB
    monkeypatch.setattr(common, "PINNED_LOAD_MIN_BYTES", 0)
    assert common.pinned_load_shards(cls, tmp_path / "one", torch.bfloat16, cuda) == [
        tmp_path / "one/model.safetensors"]
    assert common.pinned_load_shards(cls, tmp_path / "sharded", torch.bfloat16, cuda) == shards
    assert common.pinned_load_shards(cls, tmp_path / "one", torch.bfloat16, cpu) == []
    assert common.pinned_load_shards(cls, tmp_path / "one", torch.float16, cuda) == []  # would convert on the GPU
    assert common.pinned_load_shards(cls, tmp_path / "float32", torch.bfloat16, cuda) == []
    assert common.pinned_load_shards(AutoencoderKL, tmp_path / "one", torch.bfloat16, cuda) == []
    (tmp_path / "unreadable").mkdir()  # a dtype the loader has no torch dtype for: from_pretrained's to deal with
    write_by_hand(tmp_path / "unreadable/model.safetensors", [("ids", "U16", [2], bytes(4))])
    assert common.pinned_load_shards(cls, tmp_path / "unreadable", torch.bfloat16, cuda) == []
    (tmp_path / "sharded" / shards[0].name).unlink()  # a shard the index names is missing: from_pretrained says so
    assert common.pinned_load_shards(cls, tmp_path / "sharded", torch.bfloat16, cuda) == []


@pytest.mark.parametrize("family", ["t5", "qwen2", "clip"])
def test_a_model_built_around_loaded_tensors_is_the_one_from_pretrained_loads(tmp_path, family):
    """model_around: the checkpoint's tensors become the parameters themselves (no copy), tied weights stay tied,
    buffers the model computes (rotary frequencies, position ids) are there, and the output is from_pretrained's;
    a checkpoint whose names do not match the model's, or a dtype in which transformers keeps some modules in
    float32 (T5 in float16), gives None (from_pretrained's own path then); one with keys the model has no place for
    is built, as from_pretrained builds it."""
    from safetensors.torch import load_file
    from transformers import (AutoConfig, CLIPTextConfig, CLIPTextModel, Qwen2Config, Qwen2Model, T5Config,
                              T5EncoderModel)

    from diffusion_pipe.models.common import model_around

    cls, config = {
        "t5": (T5EncoderModel, T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)),
        "qwen2": (Qwen2Model, Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2)),
        "clip": (CLIPTextModel, CLIPTextConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=16,
                                               bos_token_id=0, eos_token_id=1)),
    }[family]
    torch.manual_seed(0)
    cls(config).to(torch.bfloat16).save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    built = model_around(cls, AutoConfig.from_pretrained(tmp_path), state, torch.bfloat16)
    reference = cls.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert built is not None and built.dtype == torch.bfloat16
    assert all(p.data_ptr() == state[name].data_ptr() for name, p in built.named_parameters() if name in state)
    if family == "t5":
        assert built.shared.weight is built.encoder.embed_tokens.weight
        half = {name: tensor.half() for name, tensor in state.items()}  # from_pretrained keeps `wo` in float32
        assert model_around(cls, AutoConfig.from_pretrained(tmp_path), half, torch.float16) is None
    assert built.state_dict().keys() == reference.state_dict().keys()
    ids = torch.randint(2, 64, (2, 9))
    assert torch.equal(built.eval()(ids).last_hidden_state, reference(ids).last_hidden_state)
    renamed = {f"model.{name}": tensor for name, tensor in state.items()}
    assert model_around(cls, AutoConfig.from_pretrained(tmp_path), renamed, torch.bfloat16) is None
    extra = state | {"decoder.unused.weight": torch.zeros(2)}  # ignored, as from_pretrained ignores it
    assert model_around(cls, AutoConfig.from_pretrained(tmp_path), extra, torch.bfloat16) is not None
