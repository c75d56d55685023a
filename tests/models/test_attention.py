"""models.attention: a staged codec's prefill chunk read apart (sealed context + each query's own staged block,
merged by log-sum-exp) against one softmax over both key sets."""

from __future__ import annotations

import pytest
import torch

from mcp2026.models.attention import _split_staged_attention


def _use_path(path: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list:
    """Route _split_staged_attention's own-block merge to the compiled kernel (spied: the calls are
    returned) or to the torch ops."""
    from mcp2026.models import attention

    calls: list = []
    if path == "torch":
        monkeypatch.setattr(attention, "_merge_kernels", lambda *t: None)
        return calls
    kernels = request.getfixturevalue("kernels")

    class Spy:
        def merge_own_blocks(self, *args):
            calls.append(args)
            return kernels.merge_own_blocks(*args)

    monkeypatch.setattr(attention, "_merge_kernels", lambda *t: Spy())
    return calls


def _additive(attend: torch.Tensor) -> torch.Tensor:
    return torch.zeros(attend.shape).masked_fill_(~attend, float("-inf"))


@pytest.mark.parametrize(
    ("bs", "start", "end", "nh", "nkv"),
    [
        (16, 0, 40, 6, 2),  # first chunk: block 0's queries see no sealed key
        (16, 21, 64, 6, 2),  # 5 staged tokens before the chunk; ends on a block's end
        (32, 45, 100, 9, 3),  # partial last block
        (32, 63, 64, 4, 4),  # one token that fills its block: sealed only
    ],
)
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_split_staged_attention_equals_one_softmax(bs, start, end, nh, nkv, path, request, monkeypatch):
    """Both ways of merging the own blocks: kernels/staged_merge.cpp and the torch ops (no kernels)."""
    calls = _use_path(path, request, monkeypatch)
    torch.manual_seed(0)
    hd, t = 16, end - start
    first = start // bs * bs
    ctx = -(-end // bs) * bs
    q = torch.randn(t, nh, hd) / hd**0.5
    kc, vc = torch.randn(nkv, ctx, hd), torch.randn(nkv, ctx, hd)  # the sealed blocks
    ks, vs = torch.randn(nkv, end - first, hd), torch.randn(nkv, end - first, hd)  # staged, from `first`
    query_pos = torch.arange(start, end).unsqueeze(1)
    staged_from = (query_pos + 1) // bs * bs
    sealed = torch.arange(ctx).unsqueeze(0) < staged_from
    staged_pos = torch.arange(first, end).unsqueeze(0)
    staged = (staged_pos >= staged_from) & (staged_pos <= query_pos)
    out = _split_staged_attention(q, kc, vc, ks, vs, _additive(sealed), start - first, bs)
    assert out.shape == q.shape and out.dtype == q.dtype and len(calls) == (path == "kernel")
    # reference: one softmax over both key sets, in float64
    keys = torch.cat((kc, ks), dim=1).double().repeat_interleave(nh // nkv, dim=0)
    values = torch.cat((vc, vs), dim=1).double().repeat_interleave(nh // nkv, dim=0)
    scores = (
        torch.einsum("thd,hsd->hts", q.double(), keys) + _additive(torch.cat((sealed, staged), 1)).double()
    )
    expected = torch.einsum("hts,hsd->thd", torch.softmax(scores, dim=-1), values)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_the_kernel_merge_equals_the_torch_merge_in_bf16(kernels, monkeypatch, request):
    """bf16 activations (a bf16 model): the kernel widens q, ks, vs and the flash output as the torch path
    does; the two agree within bf16's rounding of the output."""
    torch.manual_seed(1)
    bs, start, end, nh, nkv, hd = 32, 40, 130, 9, 3, 64
    first, t = start // bs * bs, end - start
    ctx = -(-end // bs) * bs
    q = (torch.randn(t, nh, hd) / hd**0.5).bfloat16()
    kc, vc = torch.randn(nkv, ctx, hd).bfloat16(), torch.randn(nkv, ctx, hd).bfloat16()
    ks, vs = torch.randn(nkv, end - first, hd).bfloat16(), torch.randn(nkv, end - first, hd).bfloat16()
    query_pos = torch.arange(start, end).unsqueeze(1)
    mask = _additive(torch.arange(ctx).unsqueeze(0) < (query_pos + 1) // bs * bs).bfloat16()
    outs = {}
    for path in ("kernel", "torch"):
        calls = _use_path(path, request, monkeypatch)
        outs[path] = _split_staged_attention(q, kc, vc, ks, vs, mask, start - first, bs)
        assert len(calls) == (path == "kernel")
        monkeypatch.undo()
    assert outs["kernel"].dtype == torch.bfloat16
    torch.testing.assert_close(outs["kernel"].float(), outs["torch"].float(), atol=0.02, rtol=0.02)


def test_this_torch_reads_staged_chunks_apart_on_the_cpu():
    """The CPU flash kernel returns log-sum-exps and maps 9 query heads onto 3 KV heads here (checked once
    per process against plain math); where it did not, staged chunks would take the one-call path."""
    from mcp2026.models.attention import reads_staged_apart

    assert reads_staged_apart(torch.device("cpu"))
    assert not reads_staged_apart(torch.device("meta"))
