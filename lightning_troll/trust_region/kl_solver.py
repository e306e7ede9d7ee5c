"""The KL projection on dense (M, C) log-probability arrays: the root finder for eta* and the
implicit gradient through it. Shared by the dense :func:`~lightning_troll.trust_region.projection.kl_projection`
and the sparse :class:`~lightning_troll.trust_region.projection.TrustRegionProjection`.

Notation: M rows (only rows that violate the bound reach the root finder), C categories per row
(V for the dense projection, |U| + 1 for the sparse one). ``a`` is log pi_new, differentiable;
``b`` is log pi_old, constant; ``-inf`` marks a category a distribution does not have.

Reachability. For eta > 0 the interpolation ``pi_eta`` lives on S = supp(pi_new) n supp(pi_old),
and as eta -> inf it tends to pi_old restricted to S and renormalised, whose KL to pi_old is
``kl_floor = -log pi_old(S)``. KL(pi_eta || pi_old) falls monotonically towards that floor
(strictly, unless pi_new is proportional to pi_old on S, when it is constant), so the bound eps
is reached by a finite eta exactly when ``kl_floor < eps``: when pi_new gives zero probability to
tokens that hold ``1 - exp(-eps)`` or more of pi_old's mass, no interpolation reaches it. Such a
row is *infeasible*: it gets the limit (eta* = inf), the closest any interpolation comes.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor

from lightning_troll.trust_region.replay import replayed

_NEG_INF = float("-inf")
# Newton iterations on log(eta) converge in a handful of steps; the bracket halving that
# safeguards them needs at most ~45 steps to reach float64 resolution from a width of 3.
_MAX_SOLVER_STEPS = 100
# Bracket search for eta: start at eta = 1, move log(eta) by this step, at most this many times.
_BRACKET_STEP = 3.0
_BRACKET_STEPS = 28
# Both loops ask the device whether every row is done only every this many steps: each question
# is a host synchronisation, which on a GPU stalls the queue of kernels. Steps after a row is
# done leave it unchanged (its updates are masked), so the result does not depend on this.
_CHECK_EVERY = 4


def log_interpolate(a: Tensor, b: Tensor, eta: Tensor) -> Tensor:
    """log pi_eta = normalise((a + eta b) / (1 + eta)).  a, b: (M, C); eta: (M,) -> (M, C)."""
    eta = eta.unsqueeze(-1)
    z = (a + eta * b) / (1 + eta)  # (M, C); -inf where a is -inf
    return z - torch.logsumexp(z, dim=-1, keepdim=True)


def kl_terms(logp: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """p, u = log p - b (0 where p has no mass) and KL(p || exp(b)) for rows of (M, C)."""
    p = logp.exp()  # (M, C)
    u = torch.where(logp > _NEG_INF, logp - b, 0.0)  # (M, C)
    return p, u, (p * u).sum(-1)


def kl_and_var(logp: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """KL(p || exp(b)) and Var_p[log p - b], rows of (M, C) -> (M,), (M,)."""
    p, u, kl = kl_terms(logp, b)
    var = (p * (u - kl.unsqueeze(-1)).square()).sum(-1)
    return kl, var


def _evaluate(a: Tensor, b: Tensor, t: Tensor, log_eps: Tensor) -> tuple[Tensor, Tensor]:
    """f(t) = log KL(pi_eta || pi_old) - log eps at eta = exp(t), and df/dt; (M,) each."""
    tiny = torch.finfo(a.dtype).tiny
    eta = t.exp()
    kl, var = kl_and_var(log_interpolate(a, b, eta), b)
    f = kl.clamp_min(tiny).log() - log_eps
    # d log KL / dt = eta * dKL/deta / KL, with dKL/deta = -Var / (1 + eta)
    slope = -eta / (1 + eta) * var / kl.clamp_min(tiny)
    return f, slope


def _bracket_step(a, b, log_eps, up, pending, probe, t_lo, t_hi, t, f, slope):
    """One step of the bracket search: every pending row moves its probe by ``_BRACKET_STEP``
    (up where ``up``, else down) and narrows its bracket; a row stays pending while its probe
    keeps the sign it started with."""
    probe = torch.where(pending, probe + torch.where(up, _BRACKET_STEP, -_BRACKET_STEP), probe)
    fp, sp = _evaluate(a, b, probe, log_eps)
    violated = fp > 0
    t_lo = torch.where(pending & violated, probe, t_lo)
    t_hi = torch.where(pending & ~violated, probe, t_hi)
    # Newton starts from the last probe, which lies next to the root.
    t, f, slope = (torch.where(pending, x, y) for x, y in ((probe, t), (fp, f), (sp, slope)))
    pending = pending & (violated == up)
    return pending, probe, t_lo, t_hi, t, f, slope


def _newton_step(a, b, log_eps, done, t, f, slope, t_lo, t_hi, ftol: float, ttol: float):
    """One safeguarded Newton step on every row not yet ``done`` (a step that leaves the bracket
    is replaced by bisection); rows done are left unchanged."""
    step = t - f / slope
    inside = (step > t_lo) & (step < t_hi) & step.isfinite()
    t_new = torch.where(inside, step, 0.5 * (t_lo + t_hi))
    f_new, s_new = _evaluate(a, b, t_new, log_eps)
    live = ~done
    t_lo = torch.where(live & (f_new > 0), t_new, t_lo)
    t_hi = torch.where(live & (f_new <= 0), t_new, t_hi)
    t, f, slope = (torch.where(live, x, y) for x, y in ((t_new, t), (f_new, f), (s_new, slope)))
    done = done | (f.abs() <= ftol) | (t_hi - t_lo <= ttol * t_hi.abs().clamp_min(1.0))
    return done, t, f, slope, t_lo, t_hi


_STEPS = (_evaluate, _bracket_step, _newton_step)


@functools.cache
def _compiled_steps() -> tuple:
    """The solver's three steps compiled with ``torch.compile`` (dynamic shapes: one compile
    serves every number of rows and categories), each fused into a few kernels: eagerly a step
    is some forty small kernels, and on a GPU at TROLL's shapes the host launching them, not the
    device, paces the projection."""
    return tuple(torch.compile(step, dynamic=True, fullgraph=True) for step in _STEPS)


_compile_failure: list[str] = []
"""Why ``compiled='auto'`` fell back to the eager steps in this process (empty: it has not)."""


def compiles_on(compiled: bool | str, device: torch.device) -> bool:
    """Whether the solver's steps run compiled: ``compiled`` itself, or with 'auto' (the
    default, :data:`~lightning_troll.trust_region.defaults.COMPILE_SOLVER`) on a CUDA device,
    unless a compile has already failed in this process."""
    if compiled == "auto":
        return device.type == "cuda" and not _compile_failure
    return bool(compiled)


@torch.no_grad()
def solve_eta(a: Tensor, b: Tensor, eps: Tensor, compiled: bool | str = False) -> Tensor:
    """Root eta* of KL(pi_eta || pi_old) = eps for rows that violate the bound and can reach it.

    a, b: (M, C) log-probs, eps: (M,); every row must have ``kl_floor(a, b) < eps`` (see the
    module docstring). Works on t = log(eta) and f(t) = log KL(t) - log eps, which is close to
    linear in t (KL - kl_floor ~ 1 / (1 + eta)^2 for large eta), so Newton steps converge in a
    few iterations; a bracket [t_lo, t_hi] with f(t_lo) > 0 >= f(t_hi) is kept and a step that
    leaves it is replaced by bisection. Stops on a relative tolerance on KL (|f| <= ftol) or on
    the bracket width, never on a fixed step count; a row that stops on the width returns t_hi:
    a probe whose KL met the bound, or, if none did, the bracket's end t = 84 (eta ~ 3e36), where
    the KL equals kl_floor < eps up to float rounding.

    ``compiled`` runs the steps through :func:`torch.compile` (the first call compiles them):
    the same iteration, its floating-point rounding that of fused kernels, so eta* agrees with
    the eager solver's to the tolerances above, not bit for bit. With 'auto' they are compiled
    on a GPU only (:func:`compiles_on`), and a compile that fails there warns once and leaves
    this process's solver eager: the default never stops a run. True raises the failure.
    """
    if not compiles_on(compiled, a.device):
        return _solve(a, b, eps, _STEPS)
    if compiled is True:
        return _solve(a, b, eps, _compiled_steps())
    try:
        return _solve(a, b, eps, _compiled_steps())
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as error:  # the compiler's: the steps are pure, so the eager solve redoes it
        _compile_failure.append(f"{type(error).__name__}: {error}")
        warnings.warn(
            "trust_region.compile_solver 'auto' could not compile the projection's root finder "
            f"({_compile_failure[0][:300]}); it runs eagerly in this process. Set "
            "model.trust_region.compile_solver to false to silence this, or true to raise.",
            RuntimeWarning,
            stacklevel=2,
        )
        return _solve(a, b, eps, _STEPS)


def _solve(a: Tensor, b: Tensor, eps: Tensor, steps: tuple) -> Tensor:
    """:func:`solve_eta`'s iteration with the given (evaluate, bracket_step, newton_step)."""
    evaluate, bracket_step, newton_step = steps
    dtype = a.dtype
    ftol = 1e-12 if dtype == torch.float64 else 1e-6
    # In float32 the rounding of KL (a sum over C categories) is about ftol, so near the root
    # Newton's steps land on one side of it and the bracket closes only by creeping: a width of
    # 1e-7 (about one ulp of t) took a row 100 steps, where 1e-6 stops it within 10.
    ttol = 1e-13 if dtype == torch.float64 else 1e-6
    log_eps = eps.log()

    # Bracket: from t = 0 step up (rows still violating) or down (rows already inside).
    t = torch.zeros_like(eps)
    f, slope = evaluate(a, b, t, log_eps)
    t_lo = torch.full_like(t, -_BRACKET_STEP * _BRACKET_STEPS)
    t_hi = torch.full_like(t, _BRACKET_STEP * _BRACKET_STEPS)
    up = f > 0
    t_lo = torch.where(up, t, t_lo)
    t_hi = torch.where(up, t_hi, t)
    probe = t.clone()
    pending = torch.ones_like(up)
    for step_count in range(1, _BRACKET_STEPS + 1):
        pending, probe, t_lo, t_hi, t, f, slope = bracket_step(
            a, b, log_eps, up, pending, probe, t_lo, t_hi, t, f, slope
        )
        if step_count % _CHECK_EVERY == 0 and not pending.any():
            break

    # No check before the first Newton step: the bracket search leaves hardly a row on its root,
    # and a check that always fails is one more wait on the device. Steps on finished rows
    # change nothing (``newton_step`` holds them), so where the checks fall changes no result.
    done = f.abs() <= ftol
    for step_count in range(_MAX_SOLVER_STEPS):
        if step_count and step_count % _CHECK_EVERY == 0 and done.all():
            break
        done, t, f, slope, t_lo, t_hi = newton_step(
            a, b, log_eps, done, t, f, slope, t_lo, t_hi, ftol, ttol
        )
    t = torch.where(f <= ftol, t, t_hi)
    return t.exp()


def kl_floor(a: Tensor, b: Tensor) -> Tensor:
    """(M,) the infimum over eta of KL(pi_eta || pi_old): -log pi_old(supp(pi_new)).

    a, b: (M, C) log-probs. +inf when the two supports share no category.
    """
    return -torch.logsumexp(torch.where(a > _NEG_INF, b, _NEG_INF), dim=-1)


def limit_log_probs(a: Tensor, b: Tensor) -> Tensor:
    """log pi_eta as eta -> inf: pi_old restricted to supp(pi_new) and renormalised, (M, C).

    Rows whose supports share no category have no limit; they are returned as ``a``.
    """
    z = torch.where(a > _NEG_INF, b, _NEG_INF)  # (M, C)
    logz = torch.logsumexp(z, dim=-1, keepdim=True)  # (M, 1)
    return torch.where(logz > _NEG_INF, z - logz, a)


def regression_kl(a: Tensor, logp: Tensor, eta: Tensor) -> Tensor:
    """KL(pi_new || sg(pi_proj)) per row (M,), differentiable in ``a`` (M, C), from the projected
    log-probs ``logp`` (M, C) and eta* (M,) of :func:`project_log_probs`.

    Exactly zero, with no gradient, on rows the projection leaves unchanged (eta* = 0, where
    pi_proj is pi_new itself). Computed there it would be zero only up to rounding, and so would
    its gradient; Adam scales a gradient that small into a full step while its second-moment
    estimate is still empty, so a minibatch with no advantage signal would move the weights.
    """
    p_new = a.exp()  # (M, C)
    gap = torch.where(p_new > 0, a - logp.detach(), 0.0)  # (M, C)
    kl = (p_new * gap).sum(-1)  # (M,)
    return torch.where(eta > 0, kl, torch.zeros_like(kl))


def project_log_probs(
    a: Tensor, b: Tensor, eps: Tensor, compiled: bool | str = False
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Projects rows of a onto {pi : KL(pi || exp(b)) <= eps}.

    a: (M, C) log-probs of the new policy (differentiable), -inf where it has no category;
    b: (M, C) log-probs of the old policy (constant); eps: (M,); ``compiled``: the root finder's
    steps through ``torch.compile`` (:func:`solve_eta`).
    Returns log pi_proj (M, C) with the exact implicit gradient, eta* (M,), KL before and after.

    A row over the bound whose :func:`kl_floor` is >= eps (infeasible: no finite eta reaches the
    bound) gets the limit :func:`limit_log_probs` as a constant (no gradient flows through it),
    eta* = inf and KL after = its floor, which is >= eps.
    """
    b = b.detach()
    with torch.no_grad():
        kl_before = kl_terms(a.detach(), b)[2]  # (M,)
        active = kl_before > eps  # (M,)
        infeasible = active & (kl_floor(a.detach(), b) >= eps)  # (M,)
        feasible = active & ~infeasible  # (M,)
        # Both counts in one scalar read, one wait on the device: with them known, the rows are
        # found without another (nonzero_static), and a batch with no infeasible row skips them.
        # A recomputation of this chunk for the backward pass takes them, and eta*, from the
        # forward pass instead (replayed), with no wait at all.
        base = feasible.numel() + 1
        m, r = replayed(lambda: divmod(int(feasible.sum() * base + infeasible.sum()), base))
        rows = torch.nonzero_static(feasible, size=m).squeeze(-1)  # (m,)
    eta = torch.zeros_like(kl_before)
    logp_out, kl_after = a, kl_before
    if r:
        with torch.no_grad():
            bad = torch.nonzero_static(infeasible, size=r).squeeze(-1)  # (r,)
            limit = limit_log_probs(a[bad].detach(), b[bad])  # (r, C)
            kl_limit = kl_terms(limit, b[bad])[2]  # (r,) the floor
        logp_out = a.index_put((bad,), limit)
        eta = eta.index_put((bad,), torch.full_like(kl_limit, float("inf")))
        kl_after = kl_after.index_put((bad,), kl_limit)
    if rows.numel() == 0:
        return logp_out, eta, kl_before, kl_after

    a_act, b_act = a[rows], b[rows]  # (m, C)
    eta_act = replayed(lambda: solve_eta(a_act.detach(), b_act, eps[rows], compiled))  # (m,)
    # log pi at eta*, differentiable in a with eta held fixed ...
    logp = log_interpolate(a_act, b_act, eta_act)  # (m, C)
    p, u, kl = kl_terms(logp, b_act)  # kl depends on a through p and u
    with torch.no_grad():
        s = 1.0 / (1.0 + eta_act)  # (m,)
        var = (p * (u - kl.unsqueeze(-1)).square()).sum(-1)  # (m,)
        dlogp_deta = -s.unsqueeze(-1) * (u - kl.unsqueeze(-1))  # (m, C)
    # ... plus the path through eta*: d eta*/d a_k = -(dKL/da_k) / (dKL/deta)
    #     = pi_k (u_k - KL) / Var, since dKL/da_k = s pi_k (u_k - KL) and dKL/deta = -s Var.
    # eta_dot has value 0 and exactly that gradient, so the value of logp is unchanged.
    eta_dot = (kl - kl.detach()) / (s * var).clamp_min(torch.finfo(var.dtype).tiny)  # (m,)
    logp = logp + dlogp_deta * eta_dot.unsqueeze(-1)
    logp_out = logp_out.index_put((rows,), logp)  # (M, C)
    eta = eta.index_put((rows,), eta_act)
    kl_after = kl_after.index_put((rows,), kl.detach())
    return logp_out, eta, kl_before, kl_after
