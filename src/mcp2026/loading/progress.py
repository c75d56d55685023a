"""A progress bar for loads that take more than a moment (rich, shown only on a terminal)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn


@contextmanager
def load_progress(description: str, total: int) -> Iterator[Callable[[int], None]]:
    if not sys.stderr.isatty() or total < 50:
        yield lambda n: None
        return

    columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n: progress.advance(task, n)
