"""The step time of a run as it actually ran: predicted at the padded shapes its batches had.

The collator pads each micro-batch to its longest example, so a run planned at ``micro_batch × seq_len``
trains on ``rows × padded length`` (demo: 8 × 82–86 of 8 × 128). The planner's estimate is for the
planned shape; the summary's step figure predicts each timed optimizer step at the shapes it trained
and takes the median, like the measured median step. Per step, not one average length: attention is
quadratic in the length, so a mean length under-predicts a mix of short and long batches.

An optimizer step of ``k`` micro-batches is ``k`` forward/backward passes plus one optimizer step
(and, with several processes, one gradient exchange), which is how the estimator builds a step of
``grad_accum = k``. Its time at mixed shapes is the mean over its micro-batches of the estimate at
``(rows, length)`` with ``grad_accum = k``: ``mean_j (k·micro(j) + rest) = Σ_j micro(j) + rest``.
With several processes a step waits for the slowest rank: the step's prediction is the largest over
the ranks' batches.

Memory stays predicted at the planned shape: the peak comes from the longest batch, and the planned
``seq_len`` bounds every batch (longer examples are cut), so the planned figure is the safe upper bound
that the planner checked against capacity.

Plain Python (the estimator through :func:`memfit.resolve.predict`), no torch.
"""

from __future__ import annotations

from statistics import median
from typing import Optional, Sequence

from memfit.errors import MemfitError

# one optimizer step: the (rows, padded length) of each of its micro-batches
Step = Sequence[tuple[int, int]]


def timed(steps: Sequence) -> list:
    """The steps the measured median covers (the first, warm-up, left out when there are more than two;
    :meth:`memfit.train.callbacks.StepStats.median_step_time`)."""
    return list(steps[1:]) if len(steps) > 2 else list(steps)


def padded_stats(steps: Sequence[Step], seq_len: int) -> dict:
    """Lengths and tokens of the timed steps' micro-batches (every step when none is timed yet)."""
    micro = [mb for step in timed(steps) for mb in step]
    if not micro:
        return {}
    lengths = sorted(w for _, w in micro)
    tokens = [sum(r * w for r, w in step) for step in timed(steps) if step]
    return {
        "steps": len(tokens), "micro_batches": len(micro), "planned_seq_len": seq_len,
        "median_len": median(lengths), "min_len": lengths[0], "max_len": lengths[-1],
        "token_weighted_mean_len": sum(r * w * w for r, w in micro) / sum(r * w for r, w in micro),
        "median_padded_tokens_per_step": median(tokens),
    }


class ShapePredictor:
    """``memfit.resolve.predict`` of ``run`` at another micro-batch shape, cached by shape."""

    def __init__(self, run) -> None:
        self.run = run
        self.cache: dict[tuple[int, int, int], float] = {}

    def __call__(self, rows: int, length: int, accum: int) -> float:
        key = (rows, length, accum)
        if key not in self.cache:
            from memfit.resolve import predict

            st = self.run.strategy.model_copy(update={"micro_batch_size": rows, "seq_len": length,
                                                      "grad_accum": accum})
            self.cache[key] = predict(self.run.model_copy(update={"strategy": st})).time["step_seconds"]
        return self.cache[key]

    def step(self, step: Step) -> float:
        return sum(self(r, w, len(step)) for r, w in step) / len(step)


def predict_as_ran(run, ranks: Sequence[Sequence[Step]], planned: Optional[dict]) -> Optional[dict]:
    """The step time predicted at the shapes the run trained (``ranks``: each process's steps, in order),
    beside the planned one; None without a planned estimate or recorded shapes."""
    if not planned or not ranks or not any(ranks[0]):
        return None
    s = run.strategy
    planned_s = float(planned["time"]["step_seconds"])
    shape = f"{s.micro_batch_size} × {s.seq_len}"
    stats = padded_stats(ranks[0], s.seq_len)
    per_rank = [timed(steps) for steps in ranks]
    n = min(len(x) for x in per_rank)
    f = ShapePredictor(run)
    try:
        per_step = [max(f.step(steps[i]) for steps in per_rank if steps[i]) for i in range(n)
                    if any(steps[i] for steps in per_rank)]
    except MemfitError:
        return None
    if not per_step:
        return None
    full = all((r, w) == (s.micro_batch_size, s.seq_len) for steps in per_rank for st in steps for r, w in st)
    where = "rank 0's batches" if len(ranks) == 1 else f"the slowest of {len(ranks)} ranks per step"
    basis = (f"at the planned shape {shape} (every batch was full)" if full else
             f"at the data's padded lengths (median {stats['median_len']:g}, max {stats['max_len']} of "
             f"planned {s.seq_len}; median over {len(per_step)} timed steps, each predicted at its own "
             f"batches{'' if len(ranks) == 1 else ', ' + where})")
    return {
        "step_seconds": median(per_step), "basis": basis, "shape": "planned" if full else "padded",
        "planned_step_seconds": planned_s, "planned_shape": shape, "padded": stats,
        "shapes_predicted": len(f.cache),
        "memory_basis": f"at the planned shape {shape} (the longest batch sets the peak; seq_len={s.seq_len} "
                        "bounds every batch, so this is the upper bound)",
    }
