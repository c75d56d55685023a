"""Running a step so that a failure fails one request only: when the batch raises, each chunk runs alone, and
the chunks that still raise are the culprits; every other request's logits come back as usual."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from mcp2026.engine.output import ScheduledChunk, SchedulerOutput
from mcp2026.engine.runner import ModelRunner

log = logging.getLogger(__name__)

FaultHook = Callable[[ScheduledChunk], None]


def execute_isolating(
    runner: ModelRunner, out: SchedulerOutput, fault_hook: FaultHook | None = None
) -> tuple[list[str], torch.Tensor, dict[str, str]]:
    """Run ``out``: (request ids sampled, their logits, request id -> error of the requests that failed).
    ``fault_hook`` (tests inject failures through it) is called on every chunk before it runs."""
    try:
        if fault_hook is not None:
            for chunk in out.chunks:
                fault_hook(chunk)
        sample_ids, logits = runner.execute(out)
        return sample_ids, logits, {}
    except Exception as e:  # noqa: BLE001 - any failure of one request must not stop the others
        if len(out.chunks) == 1:  # the culprit is known: fail it without running it again
            log.exception("request %s failed", out.chunks[0].request_id)
            return [], torch.empty(0), {out.chunks[0].request_id: f"{type(e).__name__}: {e}"}
    sample_ids, rows, failed = [], [], {}
    for chunk in out.chunks:
        single = SchedulerOutput([chunk], chunk.num_tokens)
        try:
            if fault_hook is not None:
                fault_hook(chunk)
            ids, logits = runner.execute(single)
        except Exception as e:  # noqa: BLE001 - any failure of one request must not stop the others
            log.exception("request %s failed", chunk.request_id)
            failed[chunk.request_id] = f"{type(e).__name__}: {e}"
            continue
        sample_ids += ids
        rows.append(logits)
    logits = torch.cat(rows) if rows else torch.empty(0)
    return sample_ids, logits, failed


def without_failed(out: SchedulerOutput, failed: dict[str, str]) -> SchedulerOutput:
    """``out`` less the chunks of the requests that failed (what the scheduler updates from)."""
    if not failed:
        return out
    chunks = [c for c in out.chunks if c.request_id not in failed]
    return SchedulerOutput(chunks, sum(c.num_tokens for c in chunks), out.preempted_ids, out.finished_ids)
