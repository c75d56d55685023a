"""The quantization quality benchmark (``mcp2026 bench quality``): PPL and KLD against the unquantized model on
held-out ShareGPT windows (``bench.quality.evaluate``, scored as llama.cpp's ``llama-perplexity``) for uniform
int8 / int4 plans, the llama.cpp-style role mixture, the DQG at fixed budgets and a ΔPPL-vs-bits curve.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor, nn

from mcp2026.bench.quality import evaluate, reference_logprobs
from mcp2026.kernels import cpu
from mcp2026.loading.loader import load_model, parameter_count, weight_bytes
from mcp2026.pipeline import native_weights_blocker
from mcp2026.quant import dqg, gptq, learned_scales, recipe
from mcp2026.quant.calibrate import CalibrationSettings, _progress, calibrate, calibration_samples
from mcp2026.quant.cpu_routing import GEMV_MAX_ROWS
from mcp2026.quant.linear import QuantLinear
from mcp2026.quant.perplexity import N_CTX, evaluation_windows
from mcp2026.quant.plan import LayerQuantSpec, QuantPlan, layer_bits, linear_modules
from mcp2026.quant.uniform_plan import fitted_spec, uniform_plan


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's rule (``use_more_bits`` in llama-quant.cpp): the first and last eighth of the layers and
    every third layer in between get the wider type for attn_v and ffn_down."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def role_mixture_plan(model: nn.Module, base, high=None):
    """The llama.cpp-style fixed mixture by tensor role. NOTE: our attention projections are fused, so
    attn_v is the v rows of ``qkv_proj``; a plan is per module, so the whole qkv_proj (q and k rows too)
    takes the wider type there - more bits than llama.cpp spends, counted in the plan's bits/weight."""

    high = high or LayerQuantSpec("int8")
    num_layers = len(model.layers)
    rules = {}
    for i in range(num_layers):
        if use_more_bits(i, num_layers):
            rules[f"layers.{i}.attn.qkv_proj"] = high
            rules[f"layers.{i}.mlp.down_proj"] = high
    return QuantPlan({**rules, **uniform_plan(model, base).to_dict()})


def wide_output_plan(model: nn.Module, body: LayerQuantSpec) -> QuantPlan:
    """``body`` for every linear but the output projection, which is int8 in groups of 32 (Q8_0's form; per
    channel where the block GEMM's tiles do not fit it): the layout of llama.cpp's files, which never store
    the output in 4 bits (Q8_0 when the width is not a multiple of 256, else Q6_K), so the comparison with
    its Q4_1 / Q4_0 at the same bits."""
    head = dict(linear_modules(model)).get("lm_head")
    spec = LayerQuantSpec("int8", 32)
    if isinstance(head, nn.Linear):
        spec = fitted_spec(head, spec)
    return QuantPlan({"lm_head": spec, **uniform_plan(model, body).to_dict()})


@dataclass(frozen=True)
class QualityBenchSettings:
    num_windows: int = 20
    n_ctx: int = N_CTX
    seed: int = 0
    dqg_budgets: tuple[float, ...] = (4.5, 5.0)
    curve_budgets: tuple[float, ...] = (4.25, 4.5, 4.75, 5.0, 5.25, 5.5, 5.75, 6.0)
    # only plans whose name contains one of these ("=NAME": that name exactly; "curve": the curve)
    only: tuple[str, ...] = ()
    out_dir: str | None = None  # where quality.json / quality.md / quality_curve.png go
    # Score quantized plans with their linears fed decode-sized row chunks, i.e. through the int4/int8 GEMV
    # kernels (int8 activations) that generation uses, instead of one prefill-sized matmul (bf16 activations).
    decode_kernels: bool = False
    peers: tuple[str, ...] = ()  # other engines scored on the same windows (bench.quality_peers.PEERS)


@dataclass
class QualityBench:
    rows: list[dict[str, object]]
    markdown: str
    curve_png: str | None = None
    notes: list[str] = field(default_factory=list)  # peers skipped, and why


def _symmetric_family(layers):
    """The DQG's options when int4 must be symmetric: zero points only as pre-compensation of flagged layers."""

    out = {}
    for name, lo in layers.items():
        options = []
        for o in lo.options:
            if o.spec.format == "int4" and not o.spec.symmetric:
                if not lo.flagged:
                    continue
                o = dataclasses.replace(o, variant="+".join(filter(None, ("zero_point", o.variant))))
            options.append(o)
        out[name] = dataclasses.replace(lo, options=options)
    return out


def _fixed_plans(model):
    plans = {
        "int8": uniform_plan(model, LayerQuantSpec("int8")),
        "int8 g32": uniform_plan(model, LayerQuantSpec("int8", 32)),
    }
    for sym in (True, False):
        for g in (32, 64, 128):
            plans[f"int4 {'sym' if sym else 'asym'} g{g}"] = uniform_plan(
                model, LayerQuantSpec("int4", g, sym)
            )
    for g in (32, 64):  # grids in 8 bits: 0.5 (g32) or 0.25 (g64) bits per weight fewer than fp16 grids
        plans[f"int4 asym g{g} 8-bit scales"] = uniform_plan(model, LayerQuantSpec("int4", g, scale_bits=8))
    for sym, peer in ((True, "Q4_0"), (False, "Q4_1")):
        for g in (32, 64):
            name = f"int4 {'sym' if sym else 'asym'} g{g}, lm_head int8" + (
                f" (llama.cpp {peer}'s layout)" if g == 32 else ""
            )
            plans[name] = wide_output_plan(model, LayerQuantSpec("int4", g, sym))
    for sym in (True, False):
        base = LayerQuantSpec("int4", 64, sym)
        plans[f"llama.cpp-style mixture ({'sym' if sym else 'asym'} g64 + int8)"] = role_mixture_plan(
            model, base
        )
    return plans


GPTQ_FAMILIES = {
    "GPTQ": gptq.GPTQSettings(act_order=False),
    "GPTQ act-order": gptq.GPTQSettings(act_order=True),
}
LEARNED_FAMILIES = {"learned": learned_scales.LearnedScaleSettings()}
LEVEL_FAMILIES = (*GPTQ_FAMILIES, *LEARNED_FAMILIES)  # int4 levels from calibration text


def _gptq_plans(fixed: dict[str, QuantPlan]) -> dict[str, tuple[QuantPlan, str]]:
    """The uniform int4 plans again with GPTQ's levels, in column order and in act-order, and with learned
    scales ("GPTQ " / "GPTQ act-order " / "learned " + the name, without the llama.cpp note): same layouts, same
    bits, so each row differs from its round-to-nearest row by the rounding alone. name -> (plan, family)."""
    method = {**dict.fromkeys(GPTQ_FAMILIES, "gptq"), **dict.fromkeys(LEARNED_FAMILIES, "learned")}
    return {
        f"{family} {name.split(' (')[0]}": (gptq.as_gptq(plan, method[family]), family)
        for family in LEVEL_FAMILIES
        for name, plan in fixed.items()
        if name.startswith("int4") and not (family in LEARNED_FAMILIES and "8-bit scales" in name)
    }  # learned scales are fp16 per group: on 8-bit grids they would be round-to-nearest's rows again


def as_decode_steps(model: nn.Module) -> int:
    """Make every quantized linear of ``model`` process its input in decode-sized row chunks, so a
    teacher-forced evaluation measures the kernels generation runs (the GEMVs take <= GEMV_MAX_ROWS rows).
    Returns the number of linears changed."""

    changed = 0
    for _, module in linear_modules(model):
        if isinstance(module, QuantLinear):
            full = module.forward
            module.forward = lambda x, full=full: torch.cat([full(c) for c in x.split(GEMV_MAX_ROWS)])
            changed += 1
    return changed


BF16_PLAN = "bf16 weights and activations"


def bf16_row(
    model_path: str | Path | None, windows: Sequence[Tensor], reference: Sequence[Tensor]
) -> dict[str, Any]:
    """Our model loaded in bf16, weights and activations: what ``dtype="auto"`` runs on CPUs with fast bf16
    (and CUDA), against the fp32 reference on the same windows."""

    model = load_model(model_path, torch.bfloat16).model
    return {"plan": BF16_PLAN, "family": "dtype", "bits": 16.0, "mib": None,
            **evaluate(model, windows, reference).to_dict()}  # fmt: skip


STORED_PLAN = "GGUF as stored (the default path)"


def stored_row(
    model_path: str | Path | None, windows: Sequence[Tensor], reference: Sequence[Tensor]
) -> dict[str, Any] | None:
    """The GGUF run as it is stored (what ``Pipeline()`` runs: its block formats on our block GEMM, activations
    in int8 per 32 values), against the fp32 reference, which is the same file dequantized; None where the
    model is not a GGUF or the kernels are missing."""
    if native_weights_blocker(model_path, "auto", None, "cpu") is not None:
        return None
    loaded = load_model(model_path, torch.float32, native=True)
    bits = 8 * weight_bytes(loaded.model) / parameter_count(loaded.model)
    return {"plan": STORED_PLAN, "family": "stored", "bits": bits, "mib": weight_bytes(loaded.model) / 2**20,
            **evaluate(loaded.model, windows, reference).to_dict()}  # fmt: skip


def _matches(key: str, name: str) -> bool:
    return name == key[1:] if key.startswith("=") else key in name


def run_quality_bench(
    model_path=None,
    settings: QualityBenchSettings = QualityBenchSettings(),
    calibration=None,
    progress: bool = True,
    peer_rows: Callable[[Sequence[Tensor], Sequence[Tensor]], tuple[list[dict], list[str]]] | None = None,
) -> QualityBench:
    """PPL and KLD vs the unquantized model on held-out ShareGPT for uniform int8 / int4 (sym, asym,
    g32/64/128), the llama.cpp-style role mixture, the DQG at fixed budgets and at the mixture's bits,
    and a ΔPPL-vs-bits curve of DQG budgets. Quantized models run the real kernels. ``peer_rows``: given
    the windows and the reference log-probabilities, other engines' rows and lines about peers skipped."""

    loaded = load_model(model_path)
    model, tokenizer = loaded.model, loaded.tokenizer
    formats, dtypes = recipe.hardware_candidates("cpu")
    windows = evaluation_windows(tokenizer, settings.num_windows, settings.n_ctx, settings.seed)
    reference = reference_logprobs(model, windows)
    wanted = lambda name: not settings.only or any(_matches(k, name) for k in settings.only)  # noqa: E731
    fixed = _fixed_plans(model)
    plans = {name: (plan, {}, "fixed") for name, plan in fixed.items() if wanted(name)}
    plans |= {name: (plan, {}, family) for name, (plan, family) in _gptq_plans(fixed).items() if wanted(name)}
    # "DQG 5" selects one DQG plan: calibrate whenever a filter could match a DQG plan's name
    wants_dqg = any(wanted(n) for n in ("DQG", "curve")) or any("DQG" in k for k in settings.only)
    calibration = calibration or CalibrationSettings()
    samples = None  # calibration text (GPTQ and the DQG): the calibration split, never the windows' text
    if wants_dqg or any(family in LEVEL_FAMILIES for *_, family in plans.values()):
        samples = calibration_samples(calibration, tokenizer, model.embed_tokens.num_embeddings)
    if wants_dqg:
        calib = calibrate(model, samples, calibration, progress)
        full = dqg.measure_options(model, calib, formats, dqg.DQGSettings(), progress)
        families = {"DQG": full, "DQG-sym": _symmetric_family(full)}
        numel = sum(lo.numel for lo in full.values())
        budgets = [(f, b) for f in families for b in settings.dqg_budgets]
        mixtures = {n: p for n, p in _fixed_plans(model).items() if n.startswith("llama")}
        budgets += [
            (f"DQG{'-sym' if '(sym' in n else ''}", p.avg_bits_per_weight(model)) for n, p in mixtures.items()
        ]
        if wanted("curve"):
            budgets += [(f, b) for f in families for b in settings.curve_budgets]
        for family, bits in dict.fromkeys(budgets):
            name = f"{family} {bits:.3g} bpw"
            with_gptq = family == "DQG" and bits in settings.dqg_budgets and wanted(f"GPTQ {name}")
            if not (wanted(name) or wanted("curve") or with_gptq):
                continue
            try:
                choices = dqg.allocate(families[family], bits * numel, "bits")
            except dqg.BudgetError:
                continue  # below the cheapest plan of this family
            plan, scales = dqg.plan_from_choices(choices)
            if wanted(name) or wanted("curve"):
                plans[name] = (plan, scales, family)
            if with_gptq:
                # the same plan, its int4 rows (split rows too) with GPTQ's levels
                plans[f"GPTQ {name}"] = (gptq.as_gptq(plan), scales, "GPTQ")
    rows = [{"plan": "fp32 (reference)", "family": "reference", "bits": 32.0, "mib": None,
             **evaluate(model, windows).to_dict()}]  # fmt: skip
    notes: list[str] = []
    if peer_rows is not None:
        more, notes = peer_rows(windows, reference)
        rows += more
    if wanted(BF16_PLAN):
        rows.append(bf16_row(model_path, windows, reference))
    stored = stored_row(model_path, windows, reference) if wanted(STORED_PLAN) else None
    if stored is not None:
        rows.append(stored)
    with _progress(progress) as bar:
        task = bar.add_task("evaluating plans", total=len(plans))
        for name, (plan, scales, family) in plans.items():
            bits, mib = plan.avg_bits_per_weight(model), plan.total_bytes(model) / 2**20
            result = dqg.DQGResult("bench", plan, scales)
            quantized = recipe.apply(
                copy.deepcopy(model),
                result,
                dtypes,
                False,
                samples=samples,
                gptq_settings=GPTQ_FAMILIES.get(family),
                learned_settings=LEARNED_FAMILIES.get(family),
            )
            if settings.decode_kernels:
                as_decode_steps(quantized)
            head = plan.spec_for("lm_head")
            rows.append({"plan": name, "family": family, "bits": bits, "mib": mib,
                         "lm_head": head.describe() if head else "unchanged", "layer_bits": layer_bits(quantized),
                         "notes": result.notes,
                         **evaluate(quantized, windows, reference).to_dict()})  # fmt: skip
            del quantized
            bar.advance(task)
    header = f"{loaded.source.name}, {len(windows)} windows x {settings.n_ctx} tokens (second halves scored)"
    if settings.decode_kernels:
        header += f"; quantized linears in decode-sized chunks (kernels: {_kernel_note()})"
    bench = QualityBench(rows, _markdown(rows, header, notes), notes=notes)
    if settings.out_dir:
        bench.curve_png = _write(bench, settings.out_dir)
    return bench


def _kernel_note() -> str:
    return "our int4/int8 GEMVs" if cpu.load() is not None else f"unavailable, {cpu.unavailable_reason()}"


def _markdown(rows, header: str, notes: Sequence[str] = ()) -> str:
    lines = [f"Quality: {header}", "", "| plan | bits/weight | weights MiB | PPL | ΔPPL | KLD | KLD p99 | top-1 agree |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        delta = (
            ""
            if r.get("delta_ppl") is None
            else f"{100 * r['delta_ppl']:+.2f}% ± {100 * r['delta_ppl_stderr']:.2f}"
        )
        bits = "" if r["bits"] is None else f"{r['bits']:.3f}"
        cells = [r["plan"], bits, "" if r["mib"] is None else f"{r['mib']:.1f}", f"{r['ppl']:.3f}", delta,
                 *("" if r.get(k) is None else f"{r[k]:.4f}" for k in ("kld", "kld_p99", "top1_agreement"))]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    heads = [f"{r['plan']}: {r['lm_head']}" for r in rows if str(r.get("family", "")).startswith("DQG")]
    if heads:
        lines += ["", "lm_head as the DQG stored it: " + "; ".join(heads) + "."]
    gptq_notes = [
        f"{r['plan']}: {r['notes'][0]}" for r in rows if r.get("family") in LEVEL_FAMILIES and r.get("notes")
    ]
    if gptq_notes:
        lines += ["", "GPTQ and learned-scale rows (calibration: the ShareGPT calibration split, never these windows): "
                  + "; ".join(gptq_notes) + "."]  # fmt: skip
    if any(r.get("family") in ("peer", "llama.cpp") for r in rows):
        lines += ["", "Peers (their ΔPPL and KLD are against our fp32 reference on the same windows and token "
                  "ids): HF transformers runs the same weights in fp32; llama.cpp runs the model file as stored; "
                  "\"llama.cpp Q…\" rows run that file re-quantized by llama.cpp's quantizer "
                  "(llama_model_quantize, no importance matrix), their bits/weight over the file's matrices."]  # fmt: skip
    lines += [f"- {note}" for note in notes]
    return "\n".join(lines)


def _write(bench: QualityBench, out_dir: str) -> str:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quality.json").write_text(json.dumps(bench.rows, indent=1))
    (out / "quality.md").write_text(bench.markdown + "\n")
    fig = Figure(figsize=(7, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    for family, style in (("DQG", "o-"), ("DQG-sym", "s-")):
        points = sorted((r["bits"], 100 * r["delta_ppl"]) for r in bench.rows if r["family"] == family)
        if points:
            ax.plot(*zip(*points), style, label=family)
    for r in bench.rows:
        if r["family"] == "fixed" or r["family"] in LEVEL_FAMILIES:
            ax.plot(r["bits"], 100 * r["delta_ppl"], "x" if r["family"] == "fixed" else "+", color="k")
            ax.annotate(r["plan"], (r["bits"], 100 * r["delta_ppl"]), fontsize=7)
    peers = sorted((r["bits"], 100 * r["delta_ppl"], r["plan"].split(" (")[0]) for r in bench.rows
                   if r["family"] == "llama.cpp")  # fmt: skip
    if peers:
        ax.plot(
            [p[0] for p in peers], [p[1] for p in peers], "D", color="tab:red", label="llama.cpp's formats"
        )
        for bits, delta, label in peers:
            ax.annotate(label, (bits, delta), fontsize=7, color="tab:red")
    ax.set_xlabel("bits per weight (scales and zeros included)")
    ax.set_ylabel("ΔPPL vs fp32 (%)")
    ax.set_yscale("symlog", linthresh=1.0)  # linear below 1%, where the good plans crowd; log above
    if ax.get_legend_handles_labels()[0]:  # a run of fixed plans only has no curve to label
        ax.legend()
    ax.grid(alpha=0.3)
    path = out / "quality_curve.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return str(path)
