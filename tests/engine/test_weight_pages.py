"""Weights moved into one huge-page mapping: same values, same sharing, same outputs; nothing moved where the
OS gives no huge pages."""

import copy
import mmap
import weakref

import numpy as np
import pytest
import torch

from mcp2026.engine import weight_pages


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.proj = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied, as small models tie their output projection
        self.register_buffer(
            "table", torch.arange(32, dtype=torch.int64).view(4, 8)[:, 2:]
        )  # a view at an offset
        self.small = torch.nn.Parameter(torch.randn(7).bfloat16(), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(self.embed(ids)))) + self.table.sum() + self.small.float().sum()


@pytest.fixture
def huge_pages(monkeypatch, tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(weight_pages, "_THP_SETTING", setting)
    return setting


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")
def test_weights_move_into_one_mapping_with_the_same_values_and_sharing(huge_pages):
    torch.manual_seed(0)
    model = _Tied()
    ids = torch.tensor([[1, 5, 9, 49]])
    expected = model(ids)
    before = {name: t.clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    moved = weight_pages.place_weights_in_huge_pages(model)
    assert moved >= sum(t.numel() * t.element_size() for t in before.values())
    mapping = weight_pages.placed_mapping(model)
    base = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.equal(tensor, before[name]), name
        assert base <= tensor.data_ptr() < base + len(mapping), f"{name} is not in the mapping"
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()  # still one tensor
    assert model.table.storage_offset() > 0 and torch.equal(model.table[:, 0], torch.tensor([2, 10, 18, 26]))
    assert torch.equal(model(ids), expected)
    assert weight_pages.place_weights_in_huge_pages(model) == 0  # placed once
    clone = copy.deepcopy(model)  # a copy is a model of its own, outside the mapping
    assert weight_pages.placed_mapping(clone) is None and torch.equal(clone(ids), expected)


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")
def test_each_original_is_freed_once_copied(huge_pages, monkeypatch):
    """The copy never holds two whole models: at every heap trim during the move, the originals copied so far
    are gone (numpy arrays behind the parameters show when torch lets go of their storage)."""
    arrays = [np.full((64, 64), i, dtype=np.float32) for i in range(6)]
    alive = [weakref.ref(a) for a in arrays]
    model = torch.nn.Module()
    for i, a in enumerate(arrays):
        model.register_parameter(f"w{i}", torch.nn.Parameter(torch.from_numpy(a), requires_grad=False))
    del arrays, a
    seen: list[int] = []
    monkeypatch.setattr(weight_pages, "_TRIM_EVERY", 64 * 64 * 4)  # a trim after every parameter
    monkeypatch.setattr(
        weight_pages.hardware, "release_free_heap", lambda: seen.append(sum(r() is not None for r in alive))
    )
    weight_pages.place_weights_in_huge_pages(model)
    assert seen == [5, 4, 3, 2, 1, 0, 0]  # one fewer original at each trim; the last trim after the move
    assert [int(getattr(model, f"w{i}")[0, 0]) for i in range(6)] == list(range(6))


def test_nothing_moves_where_the_os_gives_no_huge_pages(huge_pages):
    huge_pages.write_text("always madvise [never]\n")
    model = _Tied()
    pointer = model.proj.weight.data_ptr()
    assert not weight_pages.huge_pages_available()
    assert weight_pages.place_weights_in_huge_pages(model) == 0
    assert model.proj.weight.data_ptr() == pointer


def test_the_engine_generates_the_same_tokens_on_placed_weights(tiny_llama_dir, monkeypatch):
    from mcp2026.config import EngineConfig
    from mcp2026.engine.engine import LLMEngine
    from mcp2026.loading.loader import load_model
    from mcp2026.types import SamplingParams

    greedy = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = [[3, 17, 42, 9], [5] * 20]

    def run() -> tuple[bool, list[list[int]]]:
        loaded = load_model(tiny_llama_dir)
        engine = LLMEngine(loaded.model, loaded.config, None, EngineConfig())
        placed = weight_pages.placed_mapping(loaded.model) is not None
        return placed, [o.token_ids for o in engine.generate(prompts, greedy)]

    placed, tokens = run()
    assert placed == weight_pages.huge_pages_available()
    monkeypatch.setattr(weight_pages, "huge_pages_available", lambda: False)
    assert run() == (False, tokens)
