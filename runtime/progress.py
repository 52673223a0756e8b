"""Progress of long model preparation steps (download, GGUF conversion, load), as callbacks.

Library code reports through a ``Progress`` callable and never prints; the CLI turns the reports
into a tqdm bar, a host may log them or show its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

Progress = Callable[[str, int, int], None]
"""``progress(stage, done, total)``: ``stage`` names the step ("download smollm2-135m-instruct",
"convert", "load"); ``done`` of ``total`` units (bytes or tensors) are finished. ``total`` 0:
unknown. A stage reports ``done == total`` once when it ends."""


def no_progress(stage: str, done: int, total: int) -> None:
    """The default: report nothing."""


@contextmanager
def tqdm_progress(*, disable: bool = False) -> Iterator[Progress]:
    """A ``Progress`` that draws one tqdm bar per stage on stderr (``disable``: draws nothing)."""
    from tqdm import tqdm

    bars: dict[str, Any] = {}

    def report(stage: str, done: int, total: int) -> None:
        bar = bars.get(stage)
        if bar is None:
            for old in bars.values():  # a new stage begins: earlier bars are finished
                old.close()
            bars.clear()
            bar = bars[stage] = tqdm(
                total=total or None, desc=stage, disable=disable, unit_scale=True, leave=True
            )
        bar.update(done - bar.n)  # update, not refresh: tqdm then redraws at most ~10 times/s
        if total and done >= total:  # the stage ended: its bar shows the stage's own time
            bars.pop(stage).close()

    try:
        yield report
    finally:
        for bar in bars.values():
            bar.close()
