"""Paged KV storage through codecs: slot writes, block reads, and the int4 staging store."""

from __future__ import annotations

import pytest
import torch

from mcp2026.kv.codecs import make_codec
from mcp2026.kv.paged_cache import PagedKVCache

BS, NKV, HD = 8, 2, 32


def make(codec: str, num_blocks: int = 16) -> PagedKVCache:
    return PagedKVCache(2, num_blocks, BS, NKV, HD, codec=make_codec(codec), error_check_interval=1)


def write(cache: PagedKVCache, chunks, values: dict[str, torch.Tensor]):
    """chunks: (rid, start, n, table); values[rid]: (len, nkv, hd). Writes both layers and commits."""
    plan = cache.plan_write(chunks)
    k = torch.cat([values[rid][s : s + n] for rid, s, n, _ in chunks])
    for layer in range(cache.num_layers):
        cache.write(layer, plan, k, -k)
    cache.commit(plan)
    return plan


def read(cache: PagedKVCache, rid: str, table: list[int], num_tokens: int) -> torch.Tensor:
    ids = table[: -(-num_tokens // BS)]
    idx = cache.stage_index(rid)
    if idx is not None:
        ids = ids[:-1] + [cache.num_blocks + idx]
    k, v = cache.gather(1, cache.block_read(torch.tensor([ids])))
    assert k.shape == v.shape == (1, NKV, len(ids) * BS, HD)
    return k[0, :, :num_tokens].transpose(0, 1)  # (tokens, nkv, hd)


def seal(tc, x: torch.Tensor) -> torch.Tensor:
    """What a block codec stores for tokens x (n*bs, nkv, hd), decoded back in token order."""
    chunks = x.view(-1, BS, NKV, HD).transpose(1, 2).flatten(0, 1)
    return tc.decode(tc.encode(chunks), torch.float32).view(-1, NKV, BS, HD).transpose(1, 2).flatten(0, 1)


def test_per_token_codecs_write_and_read_blocks():
    x = torch.randn(20, NKV, HD)
    for name in ("fp32", "bf16", "int8", "fp8"):
        cache = make(name)
        table = [5, 2, 9]
        write(cache, [("a", 0, 13, table)], {"a": x})
        write(cache, [("a", 13, 7, table)], {"a": x})
        got = read(cache, "a", table, 20)
        tc = cache.codec.key
        assert torch.allclose(got, tc.decode(tc.encode(x), torch.float32), atol=1e-6), name
        assert torch.equal(
            cache.gather(0, cache.block_read(torch.tensor([table])))[0][0, :, :20], got.transpose(0, 1)
        )
        assert cache.num_staged == 0


def bf16_exact(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16).float()


def test_int4_staging_is_16_bit_and_rounds_the_tail_once():
    cache = make("int4")
    x = torch.randn(5, NKV, HD)  # less than a block: all of it staged
    write(cache, [("a", 0, 5, [0])], {"a": x})
    assert cache.stage_dtype == torch.bfloat16 and cache.staging.k.dtype == torch.bfloat16
    assert torch.equal(read(cache, "a", [0], 5), x.to(torch.bfloat16).float())


def test_int4_staging_seals_full_blocks_and_keeps_the_tail_exact():
    cache = make("int4")
    tc = cache.codec.key
    # Values exactly representable in bf16: the staging store keeps unfilled blocks in 16 bits.
    xa, xb = bf16_exact(30, NKV, HD), bf16_exact(12, NKV, HD)
    ta, tb = [3, 7, 1, 12], [4, 0]
    # Odd chunk sizes, two requests per step, tails that cross block boundaries.
    write(cache, [("a", 0, 5, ta), ("b", 0, 3, tb)], {"a": xa, "b": xb})
    write(cache, [("a", 5, 6, ta), ("b", 3, 9, tb)], {"a": xa, "b": xb})
    assert cache.num_staged == 2  # a: tokens 8..10 staged; b: 8..11 staged
    write(cache, [("a", 11, 19, ta)], {"a": xa})
    got_a, got_b = read(cache, "a", ta, 30), read(cache, "b", tb, 12)
    assert torch.equal(got_a[:24], seal(tc, xa[:24]))  # full blocks: per-channel int4 of the whole block
    assert torch.equal(got_a[24:], xa[24:])  # the filling block: full precision
    assert torch.equal(got_b[:8], seal(tc, xb[:8])) and torch.equal(got_b[8:], xb[8:])
    report = cache.debug_report()
    assert report["num_shape_checks"] > 0 and max(report["k_error_max"]) > 0


def test_int4_plan_is_pure_until_commit_and_release_frees_staging():
    cache = make("int4")
    x = bf16_exact(20, NKV, HD)
    table = [0, 1, 2]
    write(cache, [("a", 0, 5, table)], {"a": x})
    before = cache.stage_index("a")
    plan = cache.plan_write([("a", 5, 6, table)])  # seals block 0: the tail moves to a fresh entry
    assert plan.stage_after["a"] != before and cache.stage_index("a") == before
    k = x[5:11]
    for _ in range(2):  # a failed step rerun: the same plan writes the same bytes
        for layer in range(2):
            cache.write(layer, plan, k, -k)
    cache.commit(plan)
    assert torch.equal(read(cache, "a", table, 11)[8:], x[8:11])
    cache.release_requests(["a"])
    assert cache.num_staged == 0 and cache.stage_index("a") is None


def test_release_blocks_for_every_plane():
    cache = PagedKVCache(2, 64, 16, 2, 64, codec=make_codec("int8"))
    for plane in (*cache.k_planes.values(), *cache.v_planes.values()):
        plane.view(torch.uint8).fill_(1)
    released = cache.release_blocks(32, 64)
    assert released >= 0.9 * cache.nbytes / 2
    assert cache.k_planes["q"][:, 32:].sum() == 0 and cache.k_planes["q"][:, :32].min() == 1


def test_which_layouts_the_decode_kernel_reads_in_place():
    def kind(codec: str, dtype: torch.dtype = torch.float32, hd: int = 64) -> int:
        return PagedKVCache(2, 4, 16, 2, hd, dtype, codec=make_codec(codec)).quantized_kernel_kind

    assert [kind(c) for c in ("fp32", "bf16", "fp8", "int8", "int4", "int4-g64")] == [0, 0, 3, 1, 2, 2]
    assert kind("int4", torch.bfloat16) == 2  # staged in bf16 either way
    assert kind("int4", torch.float16) == 0  # staged in fp16: the kernel reads bf16 staging only
    assert kind("int4", hd=4096) == 0  # 128 value groups of 32: past the kernel's 64


def _with_and_without_kernels(kernels, monkeypatch, new_cache, steps, x, counted: str):
    """The same writes into a cache built with the kernels (counting calls to ``counted``) and into one built
    without them: (both caches, the number of calls)."""
    from mcp2026.kv import paged_cache

    calls = []

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(kernels, name)

    caches = []
    for module in (Counting(), None):
        monkeypatch.setattr(paged_cache.kernel_ops, "kernels_for", lambda *t, m=module: m)
        cache = new_cache()
        for rid, start, n in steps:
            write(cache, [(rid, start, n, [5, 2, 7, 1])], {"a": x})
        caches.append(cache)
    monkeypatch.undo()
    return caches, calls.count(counted)


def _assert_same_planes(a: PagedKVCache, b: PagedKVCache) -> None:
    for planes in ("k_planes", "v_planes"):
        for plane, x in getattr(a, planes).items():
            assert torch.equal(x.view(torch.uint8), getattr(b, planes)[plane].view(torch.uint8)), (
                planes,
                plane,
            )


def test_per_token_codecs_encode_on_write_in_one_kernel_call(kernels, monkeypatch):
    """int8 / fp8 steps the error monitor skips are encoded by kernels/kv_write.cpp, which stores exactly the
    bytes of the torch encoders (the monitored steps and any machine without the kernels use those)."""
    x = torch.randn(40, NKV, HD) * torch.logspace(-3, 2, 40).view(-1, 1, 1)
    steps = [("a", 0, 13), ("a", 13, 1), ("a", 14, 1), ("a", 15, 9), ("a", 24, 1)]
    for name in ("int8", "fp8"):
        (with_kernels, without), calls = _with_and_without_kernels(
            kernels,
            monkeypatch,
            lambda name=name: PagedKVCache(2, 8, BS, NKV, HD, codec=make_codec(name), error_check_interval=3),
            steps,
            x,
            "write_kv_rows_quantized",
        )
        assert calls == 2 * 3  # 2 layers x the 3 of 5 steps the monitor skips
        _assert_same_planes(with_kernels, without)


def test_int4_tail_only_steps_write_staging_in_one_kernel_call(kernels, monkeypatch):
    """A step whose tokens all go to staging (no block seals) writes them with one kernel call per layer:
    the same staged bf16 rows and sealed blocks as the torch path, step after step."""
    x = torch.randn(40, NKV, HD)
    steps = [("a", 0, 13), ("a", 13, 1), ("a", 14, 1), ("a", 15, 1), ("a", 16, 9), ("a", 25, 1)]
    (with_kernels, without), calls = _with_and_without_kernels(
        kernels, monkeypatch, lambda: make("int4"), steps, x, "write_kv_rows"
    )
    assert calls == 2 * 3  # 2 layers x the steps 13, 14 and 25 (15 and 16 seal a block)
    for name in ("k", "v"):
        assert torch.equal(getattr(with_kernels.staging, name), getattr(without.staging, name))
    _assert_same_planes(with_kernels, without)
    table = [5, 2, 7, 1]
    assert torch.equal(read(with_kernels, "a", table, 26), read(without, "a", table, 26))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_seals_encode_in_one_kernel_call(kernels, monkeypatch, dtype):
    """Blocks sealed on steps the error monitor skips are encoded by one kernel call per tensor and layer
    (kernels/kv_write.cpp), into the same bytes as the torch encoders (which the monitored steps use)."""
    x = (torch.randn(32, NKV, HD) * torch.logspace(-3, 2, 32).view(-1, 1, 1)).to(dtype)
    # block size 8; monitored: steps 1 and 5 (every 4th); seals: block 0 (step 1), 1 (step 3: 7 staged + 1
    # new), 2 (step 4), 3 (step 5)
    steps = [("a", 0, 13), ("a", 13, 2), ("a", 15, 1), ("a", 16, 9), ("a", 25, 7)]

    def new_cache() -> PagedKVCache:
        return PagedKVCache(2, 8, BS, NKV, HD, dtype, codec=make_codec("int4"), error_check_interval=4)

    returned = []

    class Sealing:  # the kernels, recording what each seal call returned (False: it declined)
        def __getattr__(self, name):
            return getattr(kernels, name)

        def seal_int4_blocks(self, *args):
            returned.append(kernels.seal_int4_blocks(*args))
            return returned[-1]

    (with_kernels, without), calls = _with_and_without_kernels(
        Sealing(), monkeypatch, new_cache, steps, x, "seal_int4_blocks"
    )
    assert calls == 2 * 2 * 2 and returned == [True] * calls  # steps 3 and 4 x 2 layers x K and V
    _assert_same_planes(with_kernels, without)


def test_int4_seal_of_a_nan_block_falls_back_to_the_torch_encoder(kernels, monkeypatch):
    """A block holding a NaN is declined by the kernel and encoded by torch, as without the kernels."""
    x = torch.randn(32, NKV, HD)
    x[17, 1, 3] = float("nan")  # in block 2, sealed by an unmonitored step
    steps = [("a", 0, 13), ("a", 13, 12), ("a", 25, 7)]

    def new_cache() -> PagedKVCache:
        return PagedKVCache(2, 8, BS, NKV, HD, codec=make_codec("int4"), error_check_interval=4)

    (with_kernels, without), calls = _with_and_without_kernels(
        kernels, monkeypatch, new_cache, steps, x, "seal_int4_blocks"
    )
    assert calls == 2 * 2 * 2  # steps 2 and 3 x 2 layers x K and V, each tried
    _assert_same_planes(with_kernels, without)


def test_stores_exactly_only_as_is_in_the_activation_dtype():
    """What a prompt's first prefill chunk may attend to without reading the cache back (engine/runner.py)."""
    cases = {("fp32", torch.float32): True, ("bf16", torch.bfloat16): True, ("bf16", torch.float32): False}
    cases |= {
        ("fp32", torch.bfloat16): False,
        ("int8", torch.float32): False,
        ("int4", torch.bfloat16): False,
    }
    for (codec, dtype), exact in cases.items():
        assert PagedKVCache(2, 4, BS, NKV, HD, dtype, codec=make_codec(codec)).stores_exactly is exact, codec
