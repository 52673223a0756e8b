"""Why reused != cold on Gemma 3 with ``exact_reuse``: pass boundaries, and the cell layout a copy
leaves (docs/models.md, the llama.cpp backend's exact reuse). ``Context`` directly, one thread;
each line is the max difference of the last token's logits against the reference.

    python scripts/llamacpp_gemma_exactness.py [gemma3-270m]

(1) a 300-token prompt in one pass against calls ending at the cuts listed, and the same with
each call padded to 8 rows by throwaway rows (removed after, as ``exact_reuse`` pads a lone row);
(2) a state of P tokens copied through host bytes (as ``copy_state`` and a batch join copy), both
continued by the same pass, for P below and past the 512-token window.
"""

from __future__ import annotations

import sys

import numpy as np

from runtime.backends.llamacpp.binding import Context
from runtime.backends.llamacpp.passes import Row
from runtime.backends.model_store import fetch_model
from tests.test_real_model_reuse import CORPUS

CUTS = (
    [298], [292], [281], [256], [100], [16, 20], [32, 36], [64, 67],  # 2 or 8+ rows, or at 16k
    [296], [293], [290, 294], [100, 104], [200, 205], [8, 12], [2, 6],  # 3-7 rows elsewhere
)  # fmt: skip
COPIED_AT = (200, 510, 516, 520, 528, 544, 600, 640, 700, 768)


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "gemma3-270m"
    ctx = Context(
        fetch_model(name), context_length=1024, n_batch=512, n_seq_max=4, n_threads=1,
        exact_reuse=True,
    )  # fmt: skip
    ids = ctx.tokenize("\n\n".join(CORPUS))

    def prefill(seq: int, start: int, cuts: list[int], n: int, pad: int = 0) -> np.ndarray:
        """ids[start:n] on ``seq`` in calls ending at each cut (and every 512), each padded to
        ``pad`` rows; the last logits."""
        pos, out = start, None
        for cut in [*cuts, n]:
            while pos < cut:
                upto = min(cut, pos + 512)
                rows = [Row(seq, p, ids[p], p == n - 1) for p in range(pos, upto)]
                rows += [Row(seq, upto + i, ids[0], False) for i in range(pad - len(rows))]
                got = ctx.decode(rows)
                ctx.seq_rm(seq, upto, -1)  # the throwaway rows' cells
                out, pos = (np.array(got[-1]) if got else out), upto
        assert out is not None
        return out

    try:
        ctx.seq_rm(0, 0, -1)
        whole = prefill(0, 0, [], 300)
        for cuts in CUTS:
            ctx.seq_rm(1, 0, -1)
            diff = np.abs(prefill(1, 0, cuts, 300) - whole).max()
            ctx.seq_rm(1, 0, -1)
            padded = np.abs(prefill(1, 0, cuts, 300, pad=8) - whole).max()
            print(f"(1) calls ending at {cuts} against one pass: {diff:.4g}, padded {padded:.4g}")
        for at in COPIED_AT:
            for seq in (0, 1):
                ctx.seq_rm(seq, 0, -1)
            prefill(0, 0, [], at)
            assert ctx.copy_seq(0, 1)
            n = min(at + 26, len(ids))
            diff = np.abs(prefill(0, at, [], n) - prefill(1, at, [], n)).max()
            print(f"(2) copied at P={at} (shift {max(0, at - 512)} cells), continued: {diff:.4g}")
    finally:
        ctx.close()


if __name__ == "__main__":
    main()
