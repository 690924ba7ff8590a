"""`diffusion-pipe lineage A --diff B`: what differs between two lineage records."""

from __future__ import annotations

from diffusion_pipe.lineage.record import flatten
from diffusion_pipe.lineage.show import format_value


def diff_lineage(a: dict, b: dict) -> list[tuple[str, object, object]]:
    """(dotted path, value in a, value in b) of every leaf that differs; `<absent>` where one record lacks it.

    The nested record of the trained LoRA is left out: its differences show as the LoRA's own hash and the
    inputs, params and training values it shares with the export.
    """
    absent = "<absent>"
    fa = flatten({k: v for k, v in a.items() if k not in ("trained_lora", "files")})
    fb = flatten({k: v for k, v in b.items() if k not in ("trained_lora", "files")})
    return [(path, fa.get(path, absent), fb.get(path, absent)) for path in sorted(set(fa) | set(fb))
            if fa.get(path, absent) != fb.get(path, absent)]


def format_diff(diffs: list[tuple[str, object, object]], a: str, b: str) -> str:
    """One line per differing dotted path: `path: A -> B`."""
    if not diffs:
        return f"{a} and {b}: lineage records are identical\n"
    lines = [f"--- {a}", f"+++ {b}"]
    lines += [f"{path}: {format_value(x)} -> {format_value(y)}" for path, x, y in diffs]
    return "\n".join(lines) + f"\n{len(diffs)} differences\n"
