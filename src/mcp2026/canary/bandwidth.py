"""Memory bandwidth utilisation of an arm's decode, estimated from what a decode step must read.

bytes moved = decode steps x weight bytes read per step (the actual storage of every parameter and buffer,
quantized modules included; tied embeddings once, the embedding table only when it is also the lm_head)
+ tokens attended over all decode steps x KV bytes per token (the cache's pool format, evicted blocks not
read). Utilisation = bytes moved / decode wall time / the machine's measured peak read bandwidth (cached by
``hardware.peak_read_bandwidth``). Assumptions: every weight is read once per step (no cache reuse across
steps, true when weights exceed the last-level cache), activations and logits are not counted, and the
decode wall time includes the step's Python overhead (so the estimate errs low).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from mcp2026.canary.gate import BANDWIDTH, Measurement

ASSUMPTIONS = (
    "bytes moved per decode step = weight storage bytes (quantized buffers as stored, tied embeddings once) "
    "+ attended context tokens x KV pool bytes per token (evicted blocks not read)",
    "every weight is read from memory once per step; activations, logits and sampling are not counted",
    "decode time is the wall time of pure-decode engine steps (Python overhead included, so it errs low)",
    "peak = hardware.peak_read_bandwidth(): best of 5 timed 256 MiB reductions, cached per machine",
)


@dataclass(frozen=True)
class BandwidthEstimate:
    weight_bytes_per_step: int
    kv_bytes_per_token: float
    decode_steps: int
    decode_context_tokens: int  # sum over decode steps of tokens attended
    decode_seconds: float
    peak_bytes_per_s: float

    @property
    def bytes_moved(self) -> float:
        return (
            self.decode_steps * self.weight_bytes_per_step
            + self.decode_context_tokens * self.kv_bytes_per_token
        )

    @property
    def bytes_per_s(self) -> float | None:
        return self.bytes_moved / self.decode_seconds if self.decode_seconds > 0 else None

    @property
    def utilisation_pct(self) -> float | None:
        rate = self.bytes_per_s
        return None if rate is None or self.peak_bytes_per_s <= 0 else 100.0 * rate / self.peak_bytes_per_s

    def measurement(self, name: str = "bandwidth_utilisation") -> Measurement:
        return Measurement(
            name,
            BANDWIDTH,
            self.utilisation_pct,
            "%",
            self.decode_steps,
            missing_reason="no decode step was measured",
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {
            "bytes_moved": self.bytes_moved,
            "bytes_per_s": self.bytes_per_s,
            "utilisation_pct": self.utilisation_pct,
        }


def estimate_bandwidth(
    weight_bytes_per_step: int, kv_bytes_per_token: float, stats: Any, peak_bytes_per_s: float
) -> BandwidthEstimate:
    """``stats``: an engine's ``StepStats`` (decode steps, decode ms, tokens attended) over the measured span."""
    return BandwidthEstimate(
        weight_bytes_per_step,
        kv_bytes_per_token,
        stats.num_decode_steps,
        stats.decode_context_tokens,
        stats.decode_ms / 1e3,
        peak_bytes_per_s,
    )
