"""How fast a large text encoder's weights reach the GPU: what the incremental encode waits for (BENCHMARKS.md,
Encode: loading T5-XXL is most of a 1%-changed run).

    python bench/bench_load.py --work W          # writes a Flux-layout model with real-size CLIP-L and T5-XXL
                                                 # (random init, bf16; bench_encode.build_flux_encoders) once

Each method runs in a fresh process, its imports done before the clock starts (as in the encode stage), with the
weights' pages in the page cache (as in an incremental run that follows a full one), and reports seconds from the
start of the load until the weights are on the device:
  cuda-init      creating the CUDA context alone (every other method pays it too, first)
  host           `from_pretrained` to host memory, then `.to(device)` (the encode stage's load before
                 `load_component` took the pinned path below for large transformers encoders)
  component      the encode stage's `load_component` as it is now
  device-map     `from_pretrained(..., device_map=device)`
  safetensors    `safetensors.torch.load_file(shard, device=device)` for each shard (no model built)
  pinned         the shards' bytes copied into two pinned host buffers in turn, each sent to the device
                 asynchronously while the other fills (no model built)
  pinned-read    the library's `load_safetensors_to_device`: the same with the shards read by 4 threads
                 (pread) instead of one copy from a memory map (no model built)
  pinned-model   `load_safetensors_to_device`, then the model built around those tensors without copying them
                 (`common.model_around`: parameters on the meta device, then assigned)
  pinned-state-dict  the same tensors given to `from_pretrained(None, config=..., state_dict=...,
                 device_map=device)`, which initialises the model before loading them
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = ("cuda-init", "host", "component", "device-map", "safetensors", "pinned", "pinned-read", "pinned-model",
           "pinned-state-dict")


def pinned_stream(files: list[Path], device, chunk_bytes: int = 512 << 20) -> int:
    """Every byte of the safetensors `files` onto `device` through two pinned buffers; the bytes sent."""
    import mmap

    import torch

    buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    done = [None, None]
    stream = torch.cuda.Stream(device)
    sent, turn = 0, 0
    for file in files:
        with open(file, "rb") as f:  # the map stays open until the process ends (tensors view it)
            source = torch.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=torch.uint8)
        for start in range(0, len(source), chunk_bytes):
            part = source[start:start + chunk_bytes]
            if done[turn] is not None:
                done[turn].synchronize()  # the buffer's last copy has left
            buffers[turn][:len(part)].copy_(part)
            target = torch.empty(len(part), dtype=torch.uint8, device=device)
            target.record_stream(stream)
            with torch.cuda.stream(stream):
                target.copy_(buffers[turn][:len(part)], non_blocking=True)
                done[turn] = torch.cuda.Event()
                done[turn].record(stream)
            sent += len(part)
            turn ^= 1
    stream.synchronize()
    return sent


def measure(method: str, model_dir: Path) -> dict:
    import torch

    from transformers import AutoConfig, T5EncoderModel  # imported before the clock: the encode stage has them

    from diffusion_pipe.models.common import load_component, model_around
    from diffusion_pipe.models.device_load import load_safetensors_to_device

    device = torch.device("cuda")
    started = time.perf_counter()
    torch.empty(1, device=device)
    torch.cuda.synchronize()
    init = time.perf_counter() - started
    t5 = model_dir / "text_encoder_2"
    shards = sorted(t5.glob("*.safetensors"))
    started = time.perf_counter()
    if method == "host":
        T5EncoderModel.from_pretrained(t5, dtype=torch.bfloat16).to(device)
    elif method == "component":
        load_component(T5EncoderModel, t5, torch.bfloat16, device)
    elif method == "device-map":
        T5EncoderModel.from_pretrained(t5, torch_dtype=torch.bfloat16, device_map=device)
    elif method == "safetensors":
        from safetensors.torch import load_file

        for shard in shards:
            load_file(shard, device="cuda")
    elif method == "pinned":
        pinned_stream(shards, device)
    elif method == "pinned-read":
        load_safetensors_to_device(shards, device)
    elif method == "pinned-model":
        state = load_safetensors_to_device(shards, device)
        assert model_around(T5EncoderModel, AutoConfig.from_pretrained(t5), state, torch.bfloat16) is not None
    elif method == "pinned-state-dict":
        T5EncoderModel.from_pretrained(None, config=AutoConfig.from_pretrained(t5), dtype=torch.bfloat16,
                                       state_dict=load_safetensors_to_device(shards, device), device_map=device)
    torch.cuda.synchronize()
    size = sum(s.stat().st_size for s in shards)
    return {"method": method, "cuda_init_s": init, "load_s": time.perf_counter() - started, "bytes": size,
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process: measure this method
    args = parser.parse_args()
    model_dir = args.work / "model"
    if args.one:
        print(json.dumps(measure(args.one, model_dir)))
        return
    if not (model_dir / "text_encoder_2/config.json").is_file():
        from bench_encode import build_flux_encoders

        build_flux_encoders(model_dir, "cuda")
    for shard in (model_dir / "text_encoder_2").glob("*.safetensors"):  # into the page cache
        shard.read_bytes()
    for method in args.methods.split(","):
        runs = []
        for _ in range(args.repeat):
            out = subprocess.run([sys.executable, __file__, "--work", str(args.work), "--one", method],
                                 capture_output=True, text=True)
            if out.returncode:
                print(f"{method:12s} failed: {out.stderr.strip().splitlines()[-1][:200]}")
                break
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        if runs:
            load = sorted(r["load_s"] for r in runs)[0]
            gb = runs[0]["bytes"] / 1e9
            print(f"{method:12s} load {load:6.2f} s ({gb / load:5.1f} GB/s of {gb:.1f} GB)  "
                  f"cuda init {runs[0]['cuda_init_s']:.2f} s  peak {runs[0]['peak_gb']:.1f} GB  (best of {len(runs)}: "
                  f"{', '.join(format(r['load_s'], '.2f') for r in runs)})")


if __name__ == "__main__":
    main()
