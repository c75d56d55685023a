"""QBench plugin: how much does *where* eviction chooses matter? A simulation with explicit masks (full K/V
kept, attention masked to what each variant keeps), on the kv bench's text and chunking, to compare ranking
granularities the engine does not all implement. docs/kv-cache.md quotes its figures.

    mcp2026 bench plugin examples/bench_plugins/kv_eviction_sim.py:EvictionSimulation --dtype fp32

Parameters (``--param KEY=VALUE``): context_tokens (2048), text (0: which of ``mcp2026 bench kv
--num-sequences``'s texts), sparsity (0.7), defer_prompt (0; 1 = evict from
the prompt's end on, as ``heavy_hitter``), sinks (4 tokens), recent (the smallest recent window, 64 tokens),
value_norm (0; 1 = split variants' scores weighted by |v|), scorer (``attention``, the engine's rule, or
``expected``: Expected Attention, arXiv:2510.00636, the split variants' observation is the softmax of the
expected logits of a Gaussian fit to the last ``stats_window`` (32) pre-RoPE queries, moved ``horizon`` (512)
positions ahead), summary (``none``; ``mean`` / ``diag`` / ``full``: every policy variant also keeps, per lane,
one slot standing for all the tokens it dropped: logit log(count) + q.mean_k, plus q'Sigma q / 2 for a diagonal
or full key covariance, the Gaussian estimate of the dropped keys' summed exp(q.k); value their mean, or with
``summary_value=1`` (diag/full) the tilted mean mean_v + Sigma_vk q), layer_budget (``uniform``; or how the
same total is shared between layers: ``pyramid:R`` linear, the first layer R times the last, PyramidKV;
``dense:K`` the first K layers keep everything; ``weights:w0/w1/...``; ``reach:P`` online, each layer's current
reach to the power P; ``sensitivity:T1+T2`` weights calibrated from ``only:L`` probes on those texts
(reported as ``only_layer_<L>_delta_ppl_pct_<variant>_t<T>``); ``only:L`` evicts in layer L alone, a
sensitivity probe; several specs separated by ``;`` run one after another, each variant's metrics then named
``<variant>@<spec>``; not for the oracles and Ada-KV, which do not keep per layer), variants
(comma list, default all):
``block-global`` one block ranking shared by every layer and KV head (the simplest rule, for comparison),
``block-lane`` an H2O block ranking per (layer, KV head), ``token-lane`` per lane and token,
``token-window`` sinks + a recent window of 97% of the budget, per token (StreamingLLM);
``block-split`` / ``token-split`` the engine's ``heavy_hitter`` rule (decayed scores relative to uniform, the
prompt's last queries replacing them at its end, each lane's split between heavy hitters and its newest
blocks; no successor rule) in blocks / per token: what token-granular eviction would add to the engine;
``token-ada-layer`` / ``token-ada-all`` unequal budgets per lane (Ada-KV, arXiv:2407.11550): every lane keeps
sinks and the window, and the rest of a layer's (of all layers') total goes to the highest decayed scores over
its lanes; ``oracle-token`` / ``oracle-block`` per query, the keys it attends to most (a bound, no policy);
``future-token`` / ``future-block`` a persistent cache ranked by the attention later queries pay (clairvoyant).
H2O rankings use the attention mass of each chunk's last 32 queries, summed over chunks; sinks are 4 tokens,
the recent window at least 64. The prompt (first half) is prefilled in 256-token chunks, the rest in 32-token
chunks, evicting after each chunk, as ``mcp2026 bench kv``. Slow (pure PyTorch attention): ~2 minutes at 2k.

Metrics: ppl_ref, and delta_ppl_pct_<variant> and delta_ppl_after_prompt_pct_<variant> for each variant.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from mcp2026.bench.plugins import PluginContext

VARIANTS = (
    "block-global", "block-lane", "token-lane", "token-window",
    "oracle-token", "oracle-block", "future-block", "future-token", "block-split", "token-split",
    "token-ada-layer", "token-ada-all",
)  # fmt: skip
ADAS = ("token-ada-layer", "token-ada-all")  # unequal budgets per lane (Ada-KV), ranked across lanes
SPLITS = ("block-split", "token-split")  # the engine's heavy_hitter: decayed scores, a split per lane
ORACLES = ("oracle-token", "oracle-block")  # per-query selection: a bound for any policy
FUTURES = ("future-block", "future-token")  # eviction ranked by the attention yet to come: clairvoyant
BLOCK, WINDOW = 16, 32
DEFAULT_SINK, DEFAULT_RECENT = 4, 64
SINK, MIN_RECENT = DEFAULT_SINK, DEFAULT_RECENT  # this run's (``--param sinks=``, ``recent=``)


class _MaskedAttention:
    """Replaces the model's attention: keeps every K/V, masks to what ``keep`` says, sums the last queries'
    attention per (KV head, position) into ``score``."""

    def __init__(
        self,
        num_layers: int,
        oracle: str | None = None,
        future: list[torch.Tensor] | None = None,
        record: int = 0,
    ) -> None:
        self.layers: list[dict[str, Any]] = [{} for _ in range(num_layers)]
        self.oracle = oracle  # per query: keep only its own top keys (a bound, not a policy)
        self.budget: tuple[int, int] | None = None  # (tokens kept, at context length) for the oracle
        self.future = future  # per layer (nkv, T, T): the full-attention run's mass of query t on key s
        # a full-attention run records that mass for a ``record``-token text (fp16: 0.75 GB at 2k)
        self.recorded = [torch.zeros(0)] * num_layers if record else None
        self.record_len = record
        self.value_norm = False
        self.inv_freq: torch.Tensor | None = None  # set for scorer=expected: RoPE frequencies (hd/2,)
        self.horizon = 512  # expected attention: future positions averaged over
        self.stats_window = WINDOW  # expected attention: the last queries its Gaussian is fit to
        self.summary = "none"  # dropped keys/values summarised per lane: none, mean, diag, full
        self.summary_value = False  # diag/full: the summary's value tilted by the query (mu_v + Sigma_vk q)
        self.layer_budget = "uniform"  # tokens kept per layer (_layer_budgets)

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: Any,
        window: int | None = None,
    ) -> torch.Tensor:
        if window is not None:
            raise ValueError(
                f"layer {layer} slides over {window} positions; the eviction simulation models full attention "
                "only: run it on a model without sliding-window layers"
            )
        st = self.layers[layer]
        t, nh, hd = q.shape
        nkv = k.shape[1]
        if not st:
            st.update(k=k.new_zeros(nkv, 0, hd), v=v.new_zeros(nkv, 0, hd))
            st.update(keep=torch.zeros(nkv, 0, dtype=torch.bool), score=torch.zeros(nkv, 0))
            st.update(recent=torch.zeros(nkv, 0), last=torch.zeros(nkv, 0))
        st["k"] = torch.cat([st["k"], k.transpose(0, 1)], 1)
        st["v"] = torch.cat([st["v"], v.transpose(0, 1)], 1)
        st["keep"] = torch.cat([st["keep"], torch.ones(nkv, t, dtype=torch.bool)], 1)
        st["score"] = torch.cat([st["score"], torch.zeros(nkv, t)], 1)
        old = torch.cat([st["recent"], torch.full((nkv, t), float("nan"))], 1)
        total = st["k"].shape[1]
        start = total - t
        causal = torch.arange(total)[None, :] <= (start + torch.arange(t))[:, None]  # (T, S)
        mask = st["keep"][:, None, :] & causal[None]  # (nkv, T, S)
        qg = q.view(t, nkv, nh // nkv, hd).permute(1, 2, 0, 3)  # (nkv, g, T, hd)
        scores = (qg @ st["k"].transpose(-1, -2)[:, None]).masked_fill(~mask[:, None], float("-inf"))
        extra = self._summary(qg, st) if self.summary != "none" else None
        summary_out = None
        if extra is not None:  # one more slot per lane: the dropped tokens' expected logit and value
            logit, value = extra
            both = torch.softmax(torch.cat([scores, logit[..., None]], -1), -1)
            probs, summary_out = both[..., :-1], both[..., -1:] * value
        else:
            probs = torch.softmax(scores, -1)
        if self.oracle is not None and self.budget is not None:
            probs = self._oracle_probs(scores, probs, start)
        st["score"] += probs[:, :, -min(WINDOW, t) :].sum((1, 2))
        # the engine's "recent" score: each observation's mean relative to uniform, decayed by age
        if self.inv_freq is not None:  # scorer=expected: the attention future queries are expected to pay
            obs = self._expected(qg[:, :, -min(self.stats_window, t) :], st["k"], st["keep"], total)
        else:
            obs = probs[:, :, -min(WINDOW, t) :].sum(1).mean(1)
        obs = obs * (st["keep"][0].sum() / BLOCK)
        if self.value_norm:  # VATP (arXiv:2406.12335): what a key contributes is its weight times |v|
            obs = obs * st["v"].norm(dim=-1)
        decay = 0.5 ** (t / WINDOW)
        st["recent"] = torch.where(old.isnan(), obs, decay * old + (1 - decay) * obs)
        st["last"] = obs
        if self.recorded is not None:
            if not self.recorded[layer].numel():
                self.recorded[layer] = torch.zeros(nkv, self.record_len, self.record_len, dtype=torch.float16)
            self.recorded[layer][:, start:total, :total] = probs.sum(1).half()
        out = probs @ st["v"][:, None]
        if summary_out is not None:
            out = out + summary_out
        return out.permute(2, 0, 1, 3).reshape(t, nh, hd)

    def _summary(self, qg: torch.Tensor, st: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The dropped keys of each lane as a Gaussian (mean, variance) and their values regressed on them:
        sum_j exp(q.k_j) ~ n exp(q.mu + q'Sigma q / 2), and the tilted mean of v is mu_v + Sigma_vk q.
        Returns (logit (nkv, g, T), value (nkv, g, T, hd)) or None when nothing is dropped."""
        dropped = ~st["keep"]  # (nkv, S): the chunk's own tokens are all kept
        count = dropped.sum(1)  # (nkv,)
        if int(count.max()) == 0:
            return None
        w = dropped.float() / count.clamp_min(1)[:, None]
        k, v = st["k"].float(), st["v"].float()
        mu_k = (w[..., None] * k).sum(1)  # (nkv, hd)
        mu_v = (w[..., None] * v).sum(1)
        logit = qg @ mu_k[:, None, :, None]  # (nkv, g, T, 1)
        value = mu_v[:, None, None, :].expand(*qg.shape[:3], -1)
        if self.summary in ("diag", "full"):
            ck, cv = k - mu_k[:, None], v - mu_v[:, None]
            if self.summary == "diag":
                var = (w[..., None] * ck * ck).sum(1)  # (nkv, hd)
                logit = logit + 0.5 * (qg * qg * var[:, None, None]).sum(-1, keepdim=True)
                sig_q = qg * var[:, None, None]
            else:
                cov = (w[..., None] * ck).transpose(1, 2) @ ck  # (nkv, hd, hd)
                sig_q = qg @ cov[:, None]
                logit = logit + 0.5 * (sig_q * qg).sum(-1, keepdim=True)
            if self.summary_value:
                cross = (w[..., None] * cv).transpose(1, 2) @ ck  # (nkv, hd_v, hd_k): E[(v-mv)(k-mk)']
                value = value + qg @ cross.transpose(1, 2)[:, None]
        logit = logit.squeeze(-1) + count.clamp_min(1).log()[:, None, None]
        logit = logit.masked_fill((count == 0)[:, None, None], float("-inf"))
        return logit, value

    def _expected(self, qg: torch.Tensor, k: torch.Tensor, keep: torch.Tensor, total: int) -> torch.Tensor:
        """Expected Attention (KVPress, arXiv:2510.00636): the last queries, un-rotated to pre-RoPE, as a
        Gaussian (mean, covariance per query head), moved to the next ``horizon`` positions by the mean RoPE
        rotation; a key's expected logit is mu.k + k'Sigma k / 2 (E[exp(q.k)] of a Gaussian q). Returns the
        softmax over live keys, summed over the group: (nkv, S)."""
        nkv, g, w, hd = qg.shape
        pos = torch.arange(total - w, total, dtype=torch.float32)

        def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
            return x * torch.cat((cos, cos), -1) + torch.cat((-x2, x1), -1) * torch.cat((sin, sin), -1)

        angle = pos[:, None] * self.inv_freq  # (w, hd/2)
        pre = rotate(qg.float(), angle.cos(), -angle.sin())  # R(-p) q: pre-RoPE queries
        mu = pre.mean(2)  # (nkv, g, hd)
        centred = pre - mu[:, :, None]
        sigma = centred.transpose(-1, -2) @ centred / max(w - 1, 1)  # (nkv, g, hd, hd)
        future = (total + torch.arange(self.horizon, dtype=torch.float32))[:, None] * self.inv_freq
        rbar = rotate(torch.eye(hd), future.cos().mean(0), future.sin().mean(0)).T  # rbar @ x
        mu_f = mu @ rbar.T
        sigma_f = rbar @ sigma @ rbar.T
        kf = k.float()  # (nkv, S, hd)
        logit = mu_f @ kf.transpose(-1, -2) + 0.5 * ((kf[:, None] @ sigma_f) * kf[:, None]).sum(-1)
        logit = logit.masked_fill(~keep[:, None], float("-inf"))
        return torch.softmax(logit, -1).sum(1)

    def _oracle_probs(self, scores: torch.Tensor, probs: torch.Tensor, start: int) -> torch.Tensor:
        """Each query keeps, per KV head, the keys its own group attends to most: as many as the engine's
        lane holds at that position (the budget at the last eviction + the tokens since). No eviction
        policy, which must decide before the queries come, can keep a better set of that size."""
        kept, at = self.budget
        nkv, _, t, total = probs.shape
        mass = probs.sum(1)  # (nkv, T, S): the group's attention
        if self.oracle == "oracle-block":
            nb = -(-total // BLOCK)
            mass = F.pad(mass, (0, nb * BLOCK - total)).view(nkv, t, nb, BLOCK).sum(-1)
        ranks = mass.argsort(-1, descending=True).argsort(-1)  # 0 = the most attended key (block)
        pos = start + torch.arange(t)
        num = (kept + pos + 1 - at).clamp(max=pos + 1)  # (T,) tokens the lane holds for this query
        if self.oracle == "oracle-block":
            num = -(-num // BLOCK)
        keep = ranks < num[None, :, None]
        if self.oracle == "oracle-block":
            keep = keep.repeat_interleave(BLOCK, -1)[..., :total]
        return torch.softmax(scores.masked_fill(~keep[:, None], float("-inf")), -1)

    def evict(self, n: int, sparsity: float, variant: str) -> None:
        budget = n - int(n * sparsity)
        reach = _layer_reach(self.layers, n, budget) if self.layer_budget.startswith("reach:") else None
        budgets = _layer_budgets(self.layer_budget, budget, n, len(self.layers), reach)
        if variant in ORACLES:
            self.budget = (budget, n)
            return
        if variant in ADAS:
            groups = [[st] for st in self.layers] if variant == "token-ada-layer" else [self.layers]
            for group in groups:
                _keep_ranked_across(group, n, budget)
            return
        if variant in SPLITS:
            unit = BLOCK if variant == "block-split" else 1
            for st, lb in zip(self.layers, budgets, strict=True):
                keep = _keep_split(st["recent"], st["keep"], n, lb, unit)
                if keep is not None:
                    st["keep"][:, :n] = keep
            return
        shared = sum(st["score"].sum(0) for st in self.layers)[None] if variant == "block-global" else None
        for layer, st in enumerate(self.layers):
            budget = budgets[layer]
            recent = max(MIN_RECENT, int(budget * 0.97)) if variant == "token-window" else MIN_RECENT
            score = st["score"] if shared is None else shared
            if variant in FUTURES:  # what the queries from here on attend to (in the full-attention run)
                score = self.future[layer][:, n:, :].float().sum(1)
            keep = _keep_blocks(score, st["keep"], n, budget, recent) if "block" in variant else None
            if keep is None:
                keep = _keep_tokens(score, st["keep"], n, budget, recent)
            if keep is not None:
                st["keep"][:, :n] = keep


def _layer_reach(layers: list[dict[str, Any]], n: int, budget: int) -> list[float]:
    """Per layer, the mean over its lanes of the decayed attention share a recent window of ``budget``
    tokens would miss (the split's "reach", per token): how far back the layer looks now."""
    out = []
    for st in layers:
        score = st["recent"][:, :n].nan_to_num(0.0) * st["keep"][:, :n]
        score[:, :SINK] = 0.0
        live = st["keep"][0, :n]
        newest = live.flip(0).cumsum(0).flip(0) <= budget  # the newest ``budget`` live tokens
        far = (score * ~newest).sum(1) / score.sum(1).clamp_min(1e-12)
        out.append(float(far.mean()))
    return out


def _layer_budgets(
    spec: str, budget: int, n: int, num_layers: int, reach: list[float] | None = None
) -> list[int]:
    """Tokens each layer keeps of ``n``. ``uniform``: ``budget`` everywhere. ``pyramid:R``: linear in the
    layer index, the first layer R times the last (PyramidKV, arXiv:2406.02069; R < 1 inverts it).
    ``dense:K``: the first K layers keep everything. ``weights:w0/w1/...``: one weight per layer.
    ``reach:P``: ``reach`` (``_layer_reach``) to the power P. These keep the same total as ``uniform`` (a
    layer given more than ``n`` keeps ``n``, the rest share the excess by weight). ``only:L``: only layer L
    evicts (a sensitivity probe, the total is not kept)."""
    kind, _, arg = spec.partition(":")
    try:
        if kind == "only":
            layer = int(arg)
            if not 0 <= layer < num_layers:
                raise ValueError
        elif kind == "pyramid":
            ratio = float(arg)
            weights = [ratio + (1 - ratio) * layer / max(num_layers - 1, 1) for layer in range(num_layers)]
        elif kind == "dense":
            weights = [1e9 if layer < int(arg) else 1.0 for layer in range(num_layers)]
        elif kind == "weights":
            weights = [float(w) for w in arg.split("/")]
        elif kind == "reach":  # online: each layer's current reach (``_layer_reach``) to the power P
            weights = [max(r, 1e-3) ** float(arg) for r in (reach or [1.0] * num_layers)]
        elif kind != "uniform":
            raise ValueError
    except ValueError:
        raise ValueError(
            "layer_budget must be uniform, pyramid:R, dense:K, weights:W0/W1/..., reach:P, only:L or "
            f"sensitivity:T1+T2, got {spec!r}"
        ) from None
    if kind == "uniform" or budget >= n:
        return [budget] * num_layers
    if kind == "only":
        return [budget if i == layer else n for i in range(num_layers)]
    if len(weights) != num_layers or min(weights) <= 0:
        raise ValueError(f"layer_budget {spec!r}: needs {num_layers} positive weights")
    total, capped = budget * num_layers, [False] * num_layers
    while True:  # water-filling: layers over n keep n, the others share what is left by weight
        free = [layer for layer in range(num_layers) if not capped[layer]]
        left = total - n * (num_layers - len(free))
        scale = left / sum(weights[layer] for layer in free)
        over = [layer for layer in free if weights[layer] * scale >= n]
        if not over:
            break
        for layer in over:
            capped[layer] = True
    return [n if capped[layer] else max(1, int(weights[layer] * scale)) for layer in range(num_layers)]


def _keep_blocks(
    score: torch.Tensor, live: torch.Tensor, n: int, budget: int, recent: int
) -> torch.Tensor | None:
    nb, nkv = -(-n // BLOCK), live.shape[0]
    pad = nb * BLOCK - n
    block_score = F.pad(score[:, :n], (0, pad)).view(score.shape[0], nb, BLOCK).sum(-1)
    block_live = F.pad(live[:, :n].float(), (0, pad)).view(nkv, nb, BLOCK).amax(-1).bool()[: score.shape[0]]
    protected = torch.zeros_like(block_live)
    protected[:, : -(-SINK // BLOCK)] = True
    protected[:, max(0, n - recent) // BLOCK :] = True
    num_live, num_keep = int(block_live[0].sum()), -(-budget // BLOCK)
    if num_live <= num_keep:
        return None
    key = block_score.masked_fill(protected, float("inf")).masked_fill(~block_live, float("-inf"))
    drop = key.topk(nb - num_keep, largest=False).indices  # the dead ones (-inf) and the lowest live ones
    kept = torch.ones_like(block_live).scatter_(1, drop, False)
    return kept.repeat_interleave(BLOCK, 1)[:, :n].expand(nkv, n)


def _keep_split(
    score: torch.Tensor, live: torch.Tensor, n: int, budget: int, unit: int
) -> torch.Tensor | None:
    """heavy_hitter's per-lane split (kv/eviction.py) at ``unit``-token granularity."""
    nu, nkv = -(-n // unit), live.shape[0]
    pad = nu * unit - n
    s = F.pad(score[:, :n].nan_to_num(0.0), (0, pad)).view(nkv, nu, unit).sum(-1)
    alive = F.pad(live[:, :n].float(), (0, pad)).view(nkv, nu, unit).amax(-1).bool()
    sink = torch.zeros_like(alive)
    sink[:, : -(-SINK // unit)] = True
    recent = torch.zeros_like(alive)
    recent[:, max(0, n - MIN_RECENT) // unit :] = True
    num_live, num_keep = int(alive[0].sum()), -(-budget // unit)
    num_over = num_live - num_keep
    if num_over <= 0:
        return None
    cand = alive & ~sink & ~recent
    num_cand = int(cand[0].sum())
    window_drops = cand & (cand.cumsum(1) <= num_over)
    reach = (s * window_drops).sum(1) / (s * (alive & ~sink)).sum(1).clamp_min(1e-12)
    num_sinks, num_recent = int((sink & alive)[0].sum()), int(recent[0].sum())
    flexible = num_keep - num_sinks - num_recent
    heavy = (reach.clamp(0, 0.9) * (num_keep - num_sinks)).floor().long().clamp(0, max(flexible, 0))
    newest = cand & (cand.cumsum(1) > (num_cand - (flexible - heavy)).unsqueeze(1))
    key = s.masked_fill(newest | ~cand, float("inf"))
    key = key.masked_fill(~alive, float("-inf"))
    num_drop = min(num_over, num_cand)
    drop = key.topk(num_drop + int((~alive)[0].sum()), largest=False).indices
    kept = torch.ones_like(alive).scatter_(1, drop, False)
    return kept.repeat_interleave(unit, 1)[:, :n]


def _keep_ranked_across(layers: list[dict[str, Any]], n: int, budget: int) -> None:
    """Every lane keeps sinks and the recent window; the rest of the group's total budget goes to the
    highest decayed scores over all its lanes (so lanes keep different numbers of tokens)."""
    score = torch.cat([st["recent"][:, :n] for st in layers]).nan_to_num(0.0)
    live = torch.cat([st["keep"][:, :n] for st in layers])
    protected = torch.zeros_like(live)
    protected[:, :SINK] = True
    protected[:, max(0, n - MIN_RECENT) :] = True
    total = budget * live.shape[0]
    if int(live.sum()) <= total:
        return
    key = score.masked_fill(protected, float("inf")).masked_fill(~live, float("-inf")).flatten()
    drop = key.topk(live.numel() - total, largest=False).indices
    keep = torch.ones(live.numel(), dtype=torch.bool).scatter_(0, drop, False).view_as(live)
    start = 0
    for st in layers:
        nkv = st["keep"].shape[0]
        st["keep"][:, :n] = keep[start : start + nkv]
        start += nkv


def _keep_tokens(
    score: torch.Tensor, live: torch.Tensor, n: int, budget: int, recent: int
) -> torch.Tensor | None:
    nkv = live.shape[0]
    if int(live[0, :n].sum()) <= budget:
        return None
    protected = torch.zeros(score.shape[0], n, dtype=torch.bool)
    protected[:, :SINK] = True
    protected[:, n - recent :] = True
    key = (
        score[:, :n]
        .masked_fill(protected, float("inf"))
        .masked_fill(~live[: score.shape[0], :n], float("-inf"))
    )
    drop = key.topk(n - budget, largest=False).indices
    return torch.ones(score.shape[0], n, dtype=torch.bool).scatter_(1, drop, False).expand(nkv, n)


class EvictionSimulation:
    def init(self, ctx: PluginContext) -> None:
        from mcp2026.bench.kv import token_sequences

        self.context = int(ctx.param("context_tokens", "2048"))
        self.sparsity = float(ctx.param("sparsity", "0.7"))
        self.defer_prompt = ctx.param("defer_prompt", "0") == "1"  # evict from the prompt's end on
        self.value_norm = ctx.param("value_norm", "0") == "1"  # split variants: scores x |v| (VATP)
        global SINK, MIN_RECENT  # module-level, read by every variant's helper
        SINK = int(ctx.param("sinks", str(DEFAULT_SINK)))
        MIN_RECENT = int(ctx.param("recent", str(DEFAULT_RECENT)))
        self.futures: dict[int, list[torch.Tensor]] = {}  # per text: its full-attention run's recorded mass
        self.scorer = ctx.param("scorer", "attention")  # or "expected" (Expected Attention)
        self.horizon = int(ctx.param("horizon", "512"))
        self.summary = ctx.param("summary", "none")
        self.summary_value = ctx.param("summary_value", "0") == "1"
        self.layer_budgets = ctx.param("layer_budget", "uniform").split(";")  # one run per spec
        self.ctx_stats = int(ctx.param("stats_window", str(WINDOW)))
        if self.summary not in ("none", "mean", "diag", "full"):
            raise ValueError(f"summary must be none, mean, diag or full, got {self.summary!r}")
        if self.scorer not in ("attention", "expected"):
            raise ValueError(f"scorer must be attention or expected, got {self.scorer!r}")
        self.variants = [v for v in ctx.param("variants", ",".join(VARIANTS)).split(",") if v]
        unknown = sorted(set(self.variants) - set(VARIANTS))
        if unknown or not 0.0 < self.sparsity < 1.0:
            raise ValueError(
                f"variants must be among {', '.join(VARIANTS)} (got {unknown}); 0 < sparsity < 1"
            )
        loaded = ctx.pipeline.loaded
        self.model = loaded.model
        self.num_layers = loaded.config.num_layers
        self.config = loaded.config
        for spec in self.layer_budgets:  # a malformed spec fails here, not mid-run
            if not spec.startswith("sensitivity:"):
                _layer_budgets(spec, 10, 100, self.num_layers)
        if self.layer_budgets != ["uniform"] and set(self.variants) & {*ADAS, *ORACLES}:
            raise ValueError("layer_budget applies to per-layer variants, not to the oracles or Ada-KV")
        # which of the kv bench's --num-sequences texts (0: its first); "0+2": each in turn
        self.texts = [int(t) for t in ctx.param("text", "0").split("+")]
        calibration = [_calibration_texts(spec) for spec in self.layer_budgets]
        wanted = sorted({*self.texts, *(t for ts in calibration for t in ts)})
        sequences = token_sequences(
            "sharegpt", loaded.tokenizer, loaded.config.vocab_size, wanted[-1] + 1, self.context, 0
        )
        self.sequences = {t: sequences[t] for t in wanted}
        self._refs: dict[int, torch.Tensor] = {}
        self._probes: dict[tuple[str, int], list[float]] = {}

    def _nll(self, variant: str | None, text: int, layer_budget: str = "uniform") -> torch.Tensor:
        from mcp2026.models import llama

        tokens = self.sequences[text]
        n, prompt = len(tokens), len(tokens) // 2
        chunks = [(s, min(s + 256, prompt)) for s in range(0, prompt, 256)]
        chunks += [(s, min(s + 32, n)) for s in range(prompt, n, 32)]
        oracle = variant if variant in ORACLES else None
        record = n if variant is None and any(v in FUTURES for v in self.variants) else 0
        attention = _MaskedAttention(self.num_layers, oracle, self.futures.get(text), record)
        attention.value_norm = self.value_norm
        attention.layer_budget = layer_budget
        if variant is not None and variant not in ORACLES:
            attention.summary, attention.summary_value = self.summary, self.summary_value
        if self.scorer == "expected" and variant is not None:
            from mcp2026.models.layers import rope_inv_freq

            cfg = self.config
            attention.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
            attention.horizon = self.horizon
            attention.stats_window = int(self.ctx_stats)
        original = llama.attention
        llama.attention = attention
        nll = []
        try:
            with torch.inference_mode():
                for a, b in chunks:
                    logits = self.model.compute_logits(
                        self.model(torch.tensor(tokens[a:b]), torch.arange(a, b))
                    )
                    target = torch.tensor(tokens[a + 1 : b + 1])
                    logprobs = torch.log_softmax(logits.float()[: len(target)], -1)
                    nll.append(-logprobs.gather(1, target[:, None]).squeeze(1))
                    if b == prompt:  # the prompt's last queries replace the decayed scores (as the engine)
                        for st in attention.layers:
                            st["recent"] = st["last"].clone()
                    if variant is not None and (b >= prompt or not self.defer_prompt):
                        attention.evict(b, self.sparsity, variant)
        finally:
            llama.attention = original
        if record:
            self.futures[text] = attention.recorded
        return torch.cat(nll)

    def _ref(self, text: int) -> torch.Tensor:
        if text not in self._refs:
            self._refs[text] = self._nll(None, text)
        return self._refs[text]

    def _sensitivity(self, variant: str, text: int) -> list[float]:
        """ΔPPL (%) of text ``text`` when layer L alone evicts, for every L (the ``only:L`` probe)."""
        if (variant, text) not in self._probes:
            ref = self._ref(text)
            self._probes[variant, text] = [
                100.0 * math.expm1(float(self._nll(variant, text, f"only:{layer}").mean() - ref.mean()))
                for layer in range(self.num_layers)
            ]
        return self._probes[variant, text]

    def _resolve(self, variant: str, spec: str) -> str:
        """``sensitivity:T1+T2``: weights from the ``only:L`` probes on the kv bench's texts T1, T2: each
        text's positive ΔPPLs as shares of their sum, added over the texts, floored at 0.005 per text, square
        root (so a layer that matters gets more, not all)."""
        texts = _calibration_texts(spec)
        if not texts:
            return spec
        share = [0.0] * self.num_layers
        for text in texts:
            probe = [max(d, 0.0) for d in self._sensitivity(variant, text)]
            total = sum(probe) or 1.0
            share = [s + d / total for s, d in zip(share, probe, strict=True)]
        return "weights:" + "/".join(f"{max(s, 0.005 * len(texts)) ** 0.5:.6g}" for s in share)

    def run(self, ctx: PluginContext) -> dict[str, float]:
        out: dict[str, float] = {}
        for text in self.texts:
            suffix = f"_t{text}" if len(self.texts) > 1 else ""
            ref = self._ref(text)
            out[f"ppl_ref{suffix}"] = math.exp(float(ref.mean()))
            after = len(self.sequences[text]) // 2  # nll[i] scores token i + 1: after the prompt
            for variant in self.variants:
                for spec in self.layer_budgets:
                    nll = self._nll(variant, text, self._resolve(variant, spec))
                    name = (variant if spec == "uniform" else f"{variant}@{spec}") + suffix
                    out[f"delta_ppl_pct_{name}"] = 100.0 * math.expm1(float(nll.mean() - ref.mean()))
                    out[f"delta_ppl_after_prompt_pct_{name}"] = 100.0 * math.expm1(
                        float(nll[after:].mean() - ref[after:].mean())
                    )
        for (variant, text), probe in self._probes.items():
            for layer, delta in enumerate(probe):
                out[f"only_layer_{layer}_delta_ppl_pct_{variant}_t{text}"] = delta
        return out


def _calibration_texts(spec: str) -> list[int]:
    kind, _, arg = spec.partition(":")
    if kind != "sensitivity":
        return []
    try:
        return [int(t) for t in arg.split("+")]
    except ValueError:
        raise ValueError(f"layer_budget sensitivity:T1+T2... takes text numbers, got {spec!r}") from None
