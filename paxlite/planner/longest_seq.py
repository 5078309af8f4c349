"""The planner's other re-plan: the longest sequence that fits, found by compiling variants of the
run at other MAX_SEQ_LEN (paxlite/planner/search.py). The search stops after
MAX_SEQ_SEARCH_COMPILES compiles, saying where it stopped.
"""

from __future__ import annotations

import math

from paxlite.parallel.compile_targets import CompileTarget
from paxlite.planner.results import CompiledLength, LongestSeqFound, SeqFit, StepMeasurement
from paxlite.planner.search import compile_variants

# Lengths are multiples of this (and of what the seq axis needs), and the search stops after
# this many compiles beyond the plan's own, reporting the bracket it reached.
DEFAULT_SEQ_STEP = 128
MAX_SEQ_SEARCH_COMPILES = 8


def find_longest_seq(experiment, base: StepMeasurement, *, num_devices: int, device_bytes: int,
                     step: int = DEFAULT_SEQ_STEP, max_compiles: int = MAX_SEQ_SEARCH_COMPILES,
                     target: CompileTarget = CompileTarget.CPU) -> LongestSeqFound:
    """The longest MAX_SEQ_LEN, a multiple of `step`, whose train step fits `device_bytes` per
    device, at the run's mesh and rows per device.

    The method, named in the result: the peak per device is fitted as a + b*T + c*T^2 (activations
    grow with T, attention logits with T^2) through three compiles, at the planned T and at two
    lengths towards the answer (2T and 4T if T fits, else T/2 and T/4); the fit's root, rounded down
    to a multiple of `step`, is compiled with the next multiple up, and the fit is redone through
    the three compiles nearest the root until a compiled T fits and T + step does not. The answer
    is exact by that definition (both ends compiled); memory is not always monotone in T under
    XLA's buffer assignment, so a longer T beyond a failing one is not looked for. After
    `max_compiles` compiles the search stops and reports the bracket it reached.
    """
    seq = base.mesh.seq
    chunks = seq * (2 if seq > 1 and experiment.CONTEXT_PARALLEL_LOAD_BALANCE else 1)
    step = math.lcm(step, chunks)
    peaks: dict[int, int | str] = {base.seq_len: base.memory.peak_bytes}
    # cpu is compile_variants' default (and a stand-in compiler taking no target stays usable)
    on_target = {"target": target} if target.compile_only else {}
    first: list[int] = []
    compiles = 0

    def fits(t: int) -> bool:
        return isinstance(peaks[t], int) and peaks[t] <= device_bytes

    def probe(lengths: list[int]) -> int:
        """Compile the lengths not compiled yet (within the budget); how many that was."""
        nonlocal compiles
        todo = sorted({t for t in lengths
                       if t >= step and t not in peaks})[:max_compiles - compiles]
        results = compile_variants(experiment, [{"MAX_SEQ_LEN": t} for t in todo],
                                   num_devices=num_devices, **on_target)
        compiles += len(todo)
        for t, result in zip(todo, results):
            peaks[t] = (f"refused: {result}" if isinstance(result, Exception)
                        else result.memory.peak_bytes)
        return len(todo)

    start = max(step, base.seq_len // step * step)
    first = [2 * start, 4 * start] if fits(base.seq_len) else [
        max(step, start // 2 // step * step), max(step, start // 4 // step * step)]
    if start != base.seq_len:
        first.append(start)
    probe(first)
    fit: SeqFit | None = None
    root: float | None = None  # where the latest fit reaches device_bytes
    while True:
        on_grid = sorted(t for t in peaks if t % step == 0)
        hi = next((t for t in on_grid if not fits(t)), None)
        lo = max((t for t in on_grid if fits(t) and (hi is None or t < hi)), default=None)
        if lo is not None and hi is not None and hi - lo == step:
            break
        if lo is None and step in peaks:  # not even the shortest step fits
            break
        if compiles >= max_compiles:
            break
        numeric = [t for t in peaks if isinstance(peaks[t], int)]
        aim = root if root else (lo or hi or start)
        nearest = sorted(numeric, key=lambda t: abs(t - aim))[:3]
        fit = _fit(nearest, [peaks[t] for t in nearest])
        root = fit.rising_root(device_bytes)
        if not probe(_next_lengths(root, lo=lo, hi=hi, step=step, known=peaks)):
            break
    pinned = lo is not None and hi is not None and hi - lo == step
    return LongestSeqFound(
        seq_len=lo if pinned else None,
        tokens_per_shard=lo // seq if pinned else None,
        seq=seq,
        rows_per_device=base.global_batch_size // base.mesh.batch_ways,
        step=step,
        pinned=pinned,
        bracket=(lo, hi),
        peak_bytes=peaks[lo] if lo is not None else None,
        next_peak_bytes=peaks[lo + step] if pinned else None,
        method=(f"peak(T) = a + b*T + c*T^2 fitted to compiles at T = "
                f"{', '.join(str(t) for t in sorted({base.seq_len, *first}))}, then the "
                f"fit's root compiled until T fits and T + {step} does not"),
        fit=fit,
        compiled=tuple(CompiledLength(seq_len=t, peak_bytes=p, fits=fits(t))
                       if isinstance(p, int) else CompiledLength(seq_len=t, peak_bytes=None,
                                                                 refused=p)
                       for t, p in sorted(peaks.items())),
        compiles=compiles,
    )


def _next_lengths(root: float | None, *, lo: int | None, hi: int | None, step: int,
                  known: dict[int, int | str]) -> list[int]:
    """What to compile next: the fit's root rounded down to the grid and the next step up, kept
    inside the bracket (lo, hi); without a usable root, or when those are compiled already, the
    bracket's midpoint (or twice the longest fitting length, half the shortest failing one)."""
    low = (lo or 0) + step
    if root is not None:
        guess = max(low, int(root) // step * step)
        if hi is not None:
            guess = min(guess, hi - step)
        pair = [t for t in (guess, guess + step) if hi is None or t < hi]
        if any(t not in known for t in pair):
            return pair
    if lo is not None and hi is not None:
        middle = (lo + hi) // 2 // step * step
        return [middle] if lo < middle < hi else []
    if hi is None:
        return [2 * (lo or step)]
    return [max(step, hi // 2 // step * step)]


def _fit(lengths: list[int], peaks: list[int]) -> SeqFit:
    """a + b*T + c*T^2 through the points (a line through two)."""
    import numpy as np

    degree = min(2, len(lengths) - 1)
    coefficients = np.polyfit(np.asarray(lengths, float), np.asarray(peaks, float), degree)
    c, b, a = ([0.0] * (2 - degree) + list(coefficients))
    return SeqFit(a=a, b=b, c=c, through=tuple(sorted(lengths)))
