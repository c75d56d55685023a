"""What an export wrote: per tensor its stored type, where its values came from, and how far the written
values (as the target format dequantizes them) are from the ones the model runs."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from mcp2026.errors import ExportError

# Where a tensor's bytes came from
PACKED = "packed"  # our quantized values packed into the format's blocks
SOURCE = "source"  # the source file's own bytes (a tensor the model holds as that file stored it)
FLOAT = "float"  # a float tensor as the model holds it
CONVERTED = "converted"  # the format cannot hold our values as they are: the nearest it can (see notes)


@dataclass(frozen=True)
class TensorRecord:
    name: str
    type_name: str  # "Q4_1", "F32", "pack-quantized int4 g32", ...
    origin: str  # PACKED | SOURCE | FLOAT | CONVERTED
    max_abs_error: float  # max |written - ours| over the elements
    max_abs_weight: float  # max |ours|, to read the error against

    @property
    def is_exact(self) -> bool:
        return self.max_abs_error == 0.0


@dataclass
class ExportReport:
    path: Path
    format: str  # "gguf" | "compressed-tensors"
    tensors: list[TensorRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, record: TensorRecord) -> None:
        self.tensors.append(record)

    @property
    def max_relative_error(self) -> float:
        """The largest error of any tensor relative to that tensor's largest weight (0 when all are exact)."""
        return max((r.max_abs_error / max(r.max_abs_weight, 1e-30) for r in self.tensors), default=0.0)

    def summary(self) -> list[str]:
        types = Counter(r.type_name for r in self.tensors)
        listing = ", ".join(f"{n} {t}" for t, n in types.most_common())
        lines = [f"{len(self.tensors)} tensors: {listing}"]
        copied = sum(r.origin == SOURCE for r in self.tensors)
        if copied:
            lines.append(f"{copied} tensors written as the source file stored them (the same bytes)")
        inexact = [r for r in self.tensors if not r.is_exact]
        if inexact:
            worst = max(inexact, key=lambda r: r.max_abs_error / max(r.max_abs_weight, 1e-30))
            lines.append(
                f"{len(self.tensors) - len(inexact)} tensors hold exactly the weights mcp2026 runs; {len(inexact)} "
                f"differ by at most {self.max_relative_error:.2e} of their largest weight (worst: {worst.name}, "
                f"{worst.type_name})"
            )
        else:
            lines.append("every tensor holds exactly the weights mcp2026 runs")
        return lines + self.notes


def check_new_path(out: str | os.PathLike[str], suffix: str | None = None) -> Path:
    """``out`` as a Path that does not exist yet and whose folder does (``suffix``: the file ending required)."""
    path = Path(out)
    if path.exists():
        raise ExportError(f"{path}: already exists; choose another --out (an export never overwrites)")
    if not path.parent.is_dir():
        raise ExportError(f"{path.parent}: no such folder for --out")
    if suffix is not None and path.suffix != suffix:
        raise ExportError(
            f"{path}: a {suffix[1:].upper()} export is one file; give --out a name ending in {suffix}"
        )
    return path
