"""llama.cpp's own quantizer as a peer: the model's GGUF re-quantized by ``llama_model_quantize`` (the library
call behind ``llama-quantize``, requantization allowed) to one of llama.cpp's file types, so ``bench quality``
scores llama.cpp's formats on the same starting weights as our plans.

The starting point is the file as stored: for the embedded model, Q4_1 linears and a Q8_0 embedding, which is
exactly our fp32 reference (the file dequantized). llama.cpp dequantizes each tensor to float and quantizes it
to the target type with its usual per-tensor choices (K-quant mixtures, the output projection kept wider), no
importance matrix.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from gguf import GGUFReader

from mcp2026.bench.peers import PeerUnavailable

# The file types the quality bench can score; the default ones are the common files from 4 to 8 bits.
LLAMA_CPP_FILE_TYPES = (
    "Q8_0", "Q6_K", "Q5_K_M", "Q5_1", "Q5_0", "Q4_K_M", "Q4_1", "Q4_0", "IQ4_NL", "IQ4_XS", "Q3_K_M", "Q3_K_S",
    "Q2_K",
)  # fmt: skip
DEFAULT_LLAMA_CPP_TYPES = ("Q8_0", "Q5_K_M", "Q4_K_M", "Q4_1", "Q4_0")


@contextlib.contextmanager
def _output_to(log: Path) -> Iterator[None]:
    """Send the process's stdout and stderr (file descriptors: llama.cpp prints a line per tensor) to ``log``."""
    with open(log, "wb") as sink:
        saved = [os.dup(1), os.dup(2)]
        try:
            for fd in (1, 2):
                os.dup2(sink.fileno(), fd)
            yield
        finally:
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)


def quantize_gguf(source: Path, file_type: str, out_dir: Path) -> Path:
    """``source`` quantized by llama.cpp to ``file_type`` (one of ``LLAMA_CPP_FILE_TYPES``), written into
    ``out_dir``; raises ``PeerUnavailable`` where llama-cpp-python is absent or its quantizer fails."""
    if file_type not in LLAMA_CPP_FILE_TYPES:
        raise ValueError(
            f"llama.cpp file type {file_type!r} unknown; available: {', '.join(LLAMA_CPP_FILE_TYPES)}"
        )
    if importlib.util.find_spec("llama_cpp") is None:
        raise PeerUnavailable(f"llama.cpp {file_type} peer skipped: llama-cpp-python is not installed")
    try:
        import llama_cpp  # optional dependency (llama-cpp-python): the peer is skipped without it
    except ImportError as e:
        raise PeerUnavailable(
            f"llama.cpp {file_type} peer skipped: llama_cpp does not import ({e})"
        ) from None
    if source.suffix != ".gguf":
        raise PeerUnavailable(f"llama.cpp {file_type} peer skipped: {source} is not a GGUF file")
    out = out_dir / f"{source.stem}.requantized-{file_type}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.allow_requantize = True
    params.nthread = os.cpu_count() or 1
    log = out_dir / f"llama-quantize-{file_type}.log"
    with _output_to(log):
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if status != 0 or not out.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise PeerUnavailable(
            f"llama.cpp {file_type} peer skipped: llama_model_quantize returned {status} ({' / '.join(tail)})"
        )
    return out


def weight_bits(path: Path) -> float:
    """Bits per weight of a GGUF's matrices (2-D tensors: linears and the embedding; a tied embedding counts
    once, as our plans count the lm_head that shares it), block scales and minimums included."""
    reader = GGUFReader(str(path))
    matrices = [t for t in reader.tensors if len(t.shape) == 2]
    elements = sum(int(np.prod(t.shape)) for t in matrices)
    return 8 * sum(int(t.n_bytes) for t in matrices) / elements
