"""compressed-tensors' int32 packing: ours against the package's own, both directions."""

from __future__ import annotations

import pytest
import torch

from mcp2026.loading.compressed_tensors import pack_int32, unpack_int32


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_packing_round_trips(bits, dim):
    q = torch.randint(-(1 << bits - 1), 1 << bits - 1, (24, 72), dtype=torch.int8)
    packed = pack_int32(q, bits, dim)
    u = unpack_int32(packed, bits, q.shape[dim], dim)
    assert torch.equal(u.to(torch.int16) - (1 << bits - 1), q.to(torch.int16))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_packing_is_the_packages_own(bits, dim):
    helpers = pytest.importorskip(
        "compressed_tensors.compressors.pack_quantized.helpers", reason="compressed-tensors is not installed"
    )
    q = torch.randint(-(1 << bits - 1), 1 << bits - 1, (24, 72), dtype=torch.int8)
    assert torch.equal(pack_int32(q, bits, dim), helpers.pack_to_int32(q, bits, packed_dim=dim))
