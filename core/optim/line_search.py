"""The strong Wolfe line search LBFGS uses (`line_search_fn="strong_wolfe"`): a bracketing
phase that grows the step by cubic interpolation until the sufficient-decrease or curvature
condition brackets a minimiser, then a zoom phase that shrinks the bracket (Nocedal and
Wright, Numerical Optimization, algorithms 3.5 and 3.6), with torch's constants and safeguards
so that a run takes torch's steps."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

__all__ = ["cubic_interpolate", "strong_wolfe"]


def cubic_interpolate(x1: float, f1: float, g1: float, x2: float, f2: float, g2: float,
                      bounds: tuple[float, float] | None = None) -> float:
    """The minimiser of the cubic through (x1, f1, g1) and (x2, f2, g2), clamped to bounds
    (default: the interval between x1 and x2); the bounds' midpoint where it has none."""
    low, high = bounds if bounds is not None else (min(x1, x2), max(x1, x2))
    d1 = g1 + g2 - 3 * (f1 - f2) / (x1 - x2)
    d2_square = d1 * d1 - g1 * g2
    if d2_square < 0:
        return (low + high) / 2.0
    d2 = float(np.sqrt(d2_square))
    if x1 <= x2:
        at = x2 - (x2 - x1) * ((g2 + d2 - d1) / (g2 - g1 + 2 * d2))
    else:
        at = x1 - (x1 - x2) * ((g1 + d2 - d1) / (g1 - g2 + 2 * d2))
    return min(max(at, low), high)


class _Bracket:
    """Two trial steps with their losses, gradients and directional derivatives."""

    def __init__(self, points: list) -> None:
        self.t = [p[0] for p in points]
        self.f = [p[1] for p in points]
        self.g = [p[2] for p in points]
        self.gtd = [p[3] for p in points]

    def set(self, i: int, t: float, f: float, g: Any, gtd: float) -> None:
        self.t[i], self.f[i], self.g[i], self.gtd[i] = t, f, g, gtd

    def low_high(self) -> tuple[int, int]:
        return (0, 1) if self.f[0] <= self.f[-1] else (1, 0)


def strong_wolfe(evaluate: Callable[[float], tuple[float, Any]], t: float, d: Any, f: float,
                 g: Any, gtd: float, c1: float = 1e-4, c2: float = 0.9,
                 tolerance_change: float = 1e-9, max_ls: int = 25) -> tuple[float, Any, float, int]:
    """(loss, flat gradient, step, evaluations) at a step along d meeting the strong Wolfe
    conditions; `evaluate(t)` gives the loss and flat gradient at x + t d."""
    d_norm = float(abs(d).max())  # d is numpy or cupy
    f_new, g_new = evaluate(t)
    evals, gtd_new = 1, float(g_new @ d)
    t_prev, f_prev, g_prev, gtd_prev = 0.0, f, g, gtd
    done, ls_iter, bracket = False, 0, None
    while ls_iter < max_ls:
        if f_new > f + c1 * t * gtd or (ls_iter > 1 and f_new >= f_prev):
            bracket = _Bracket([(t_prev, f_prev, g_prev, gtd_prev), (t, f_new, g_new, gtd_new)])
            break
        if abs(gtd_new) <= -c2 * gtd:  # checked before the sign: the order decides ties
            bracket, done = _Bracket([(t, f_new, g_new, gtd_new)]), True
            break
        if gtd_new >= 0:
            bracket = _Bracket([(t_prev, f_prev, g_prev, gtd_prev), (t, f_new, g_new, gtd_new)])
            break
        grown = cubic_interpolate(t_prev, f_prev, gtd_prev, t, f_new, gtd_new,
                                  bounds=(t + 0.01 * (t - t_prev), t * 10))
        t_prev, f_prev, g_prev, gtd_prev = t, f_new, g_new, gtd_new
        t = grown
        f_new, g_new = evaluate(t)
        evals, gtd_new, ls_iter = evals + 1, float(g_new @ d), ls_iter + 1
    if bracket is None:  # the search ran out of evaluations while growing
        bracket = _Bracket([(0.0, f, g, gtd), (t, f_new, g_new, gtd_new)])
    low, high = bracket.low_high()
    insufficient_progress = False
    while not done and ls_iter < max_ls:
        if abs(bracket.t[1] - bracket.t[0]) * d_norm < tolerance_change:
            break
        t = cubic_interpolate(bracket.t[0], bracket.f[0], bracket.gtd[0],
                              bracket.t[1], bracket.f[1], bracket.gtd[1])
        t, insufficient_progress = _keep_inside(t, bracket.t, insufficient_progress)
        f_new, g_new = evaluate(t)
        evals, gtd_new, ls_iter = evals + 1, float(g_new @ d), ls_iter + 1
        if f_new > f + c1 * t * gtd or f_new >= bracket.f[low]:
            bracket.set(high, t, f_new, g_new, gtd_new)
            low, high = bracket.low_high()
        else:
            if abs(gtd_new) <= -c2 * gtd:
                done = True
            elif gtd_new * (bracket.t[high] - bracket.t[low]) >= 0:
                bracket.set(high, bracket.t[low], bracket.f[low], bracket.g[low],
                            bracket.gtd[low])
            bracket.set(low, t, f_new, g_new, gtd_new)
    return bracket.f[low], bracket.g[low], bracket.t[low], evals


def _keep_inside(t: float, ends: list, insufficient_progress: bool) -> tuple[float, bool]:
    """A zoom step too near an end of the bracket is moved a tenth of its width inside, the
    second time in a row (or at once when it left the bracket)."""
    top, bottom = max(ends), min(ends)
    eps = 0.1 * (top - bottom)
    if min(top - t, t - bottom) >= eps:
        return t, False
    if insufficient_progress or t >= top or t <= bottom:
        return (top - eps if abs(t - top) < abs(t - bottom) else bottom + eps), False
    return t, True
