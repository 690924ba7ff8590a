"""Safetensors files straight onto a CUDA device through pinned host memory: what a large text encoder's load waits
for in an incremental encode (BENCHMARKS.md, Encode). Each file's bytes are read from disk (or the page cache) by
several threads into one of two pinned buffers while the other one's bytes go to the device on a side stream, so
reading and copying overlap; the tensors are views of one device allocation per file."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from diffusion_pipe.model_folder import model_folder_error
from diffusion_pipe.models.checkpoints import SAFETENSORS_DTYPES
from diffusion_pipe.store import pack


def read_header(path: Path) -> tuple[int, dict]:
    """(byte offset of the data section, {name: {"dtype", "shape", "data_offsets"}}) of a safetensors file."""
    try:
        header, start = pack.read_header(path)
    except ValueError as exc:
        raise model_folder_error(path, f"{exc} (not a whole safetensors file)", Path(path).parent.parent) from exc
    return start, header


def load_safetensors_to_device(files: list[Path], device: torch.device, chunk_bytes: int = 256 << 20,
                               readers: int = 4) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors `files` on `device`, in its stored dtype: a {name: tensor} dict. On a CUDA
    device through two pinned buffers of `chunk_bytes` and a side stream; elsewhere the same reads, copied in
    turn."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
    views = [memoryview(b.numpy()) for b in buffers]
    copied = [None, None]  # the event after each buffer's last copy to the device
    stream = torch.cuda.Stream(device) if cuda else None
    state: dict[str, torch.Tensor] = {}
    turn = 0
    with ThreadPoolExecutor(readers) as pool:
        for path in files:
            start, header = read_header(path)
            size = max((t["data_offsets"][1] for t in header.values()), default=0)
            data = torch.empty(size, dtype=torch.uint8, device=device)
            if cuda:  # the side stream writes it after whatever last used its memory on the default stream
                stream.wait_stream(torch.cuda.current_stream(device))
            fd = os.open(path, os.O_RDONLY)
            try:
                for offset in range(0, size, len(views[0])):
                    n = min(len(views[0]), size - offset)
                    if copied[turn] is not None:
                        copied[turn].synchronize()  # the buffer's bytes have left for the device
                    _pread_into(pool, readers, fd, views[turn][:n], start + offset, path)
                    if not cuda:
                        data[offset:offset + n].copy_(buffers[turn][:n])
                        continue
                    with torch.cuda.stream(stream):
                        data[offset:offset + n].copy_(buffers[turn][:n], non_blocking=True)
                        copied[turn] = torch.cuda.Event()
                        copied[turn].record(stream)
                    turn ^= 1
            finally:
                os.close(fd)
            if cuda:  # a misaligned tensor's copy (_tensor_view) runs on the default stream, after the bytes
                data.record_stream(stream)
                torch.cuda.current_stream(device).wait_stream(stream)
            for name, info in header.items():
                state[name] = _tensor_view(data, info)
    if cuda:
        stream.synchronize()  # the pinned buffers are free again when they are dropped
    return state


def _pread_into(pool: ThreadPoolExecutor, readers: int, fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fill `view` with the file's bytes from `offset`, `readers` slices read in parallel (preadv drops the GIL)."""
    part = -(-len(view) // readers)

    def read(begin: int) -> None:
        end = min(begin + part, len(view))
        while begin < end:
            got = os.preadv(fd, [view[begin:end]], offset + begin)
            if got == 0:
                raise model_folder_error(path, "the file ends before its safetensors header says (truncated or "
                                         "damaged)", Path(path).parent.parent)
            begin += got

    list(pool.map(read, range(0, len(view), part)))


def _tensor_view(data: torch.Tensor, info: dict) -> torch.Tensor:
    """The tensor `info` describes, as a view of the file's bytes on the device (a copy where its offset is not a
    multiple of its element size, which a view cannot express)."""
    dtype = SAFETENSORS_DTYPES[info["dtype"]]
    begin, end = info["data_offsets"]
    raw = data[begin:end]
    if begin % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype).view(info["shape"])
