"""Statistics of the SNIS estimator and of the budget, on synthetic attention with fixed seeds.

Tolerances come from the sampling error of the Monte Carlo itself (standard errors over R
replications), not from tuning: a deviation of more than ~4.5 standard errors has probability
below 1e-5 per coordinate under the claim being tested.
"""

import math

import pytest
import torch

from kvpress_prob.samplers.budget import expected_kept, solve_draws
from kvpress_prob.samplers import PoissonSampler, TopKSampler
from kvpress_prob.samplers.poisson import poisson_sample as sample


def draw(pi, ratio, scope, generator, **sampler_fields):
    """The paper's design with these sampler fields."""
    return PoissonSampler(**sampler_fields)(pi, ratio, scope, generator)

N, D = 64, 4


def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    s = 1.5 * torch.randn(N, generator=g, dtype=torch.float64)  # logits at the eviction query
    v = torch.randn(N, D, generator=g, dtype=torch.float64) + 0.5
    p = torch.softmax(s, 0)
    return s, v, p, p @ v


def estimates(pi, m, s, v, reps, seed, correct=True, inclusion_weights=False):
    """(reps, D) SNIS estimates: sum_kept w e^s v / sum_kept w e^s (w = 1 when not corrected)."""
    g = torch.Generator().manual_seed(seed)
    pis = pi.expand(reps, 1, 1, N)
    kept, log_w = sample(pis, torch.tensor(float(m)), g, inclusion_weights=inclusion_weights)
    kept, log_w = kept[:, 0, 0], log_w[:, 0, 0]  # (reps, N)
    logits = s + (log_w if correct else 0.0)
    logits = torch.where(kept, logits, torch.tensor(-math.inf, dtype=torch.float64))
    a = torch.softmax(logits, dim=-1)  # explicit SNIS weights over the kept entries
    return a @ v


def test_snis_unbiased_when_proposal_is_attention():
    s, v, p, truth = problem()
    reps = 4000
    est = estimates(p, 20, s, v, reps, seed=1)
    se = est.std(0) / math.sqrt(reps)
    assert ((est.mean(0) - truth).abs() < 4.5 * se).all()


def test_unbiasedness_check_has_power():
    """The same check rejects the uncorrected estimator under a uniform proposal (biased)."""
    s, v, p, truth = problem()
    reps = 4000
    est = estimates(torch.full((N,), 1.0 / N, dtype=torch.float64), 20, s, v, reps, seed=1, correct=False)
    se = est.std(0) / math.sqrt(reps)
    assert ((est.mean(0) - truth).abs() > 6 * se).any()


def test_mse_falls_as_one_over_m():
    s, v, p, truth = problem(seed=2)
    pi = 0.5 * p + 0.5 / N  # full support, not the optimum
    ms = torch.tensor([16.0, 32.0, 64.0, 128.0, 256.0])
    mse = torch.stack([((estimates(pi, m, s, v, 3000, seed=int(m)) - truth) ** 2).sum(-1).mean() for m in ms])
    slope = torch.linalg.lstsq(torch.stack([ms.log(), torch.ones(5)], 1).double(), mse.log()[:, None]).solution[0]
    assert -1.15 < slope.item() < -0.85, f"log-log slope {slope.item():.3f}"


def paired_z(err_a, err_b):
    """z statistic of mean(err_a - err_b) > 0 over paired replications."""
    diff = err_a - err_b
    return (diff.mean() / (diff.std() / math.sqrt(len(diff)))).item()


def pi_min_problem():
    s, v, p, truth = problem(seed=3)
    pi = p * v.norm(dim=-1)
    return s, v, truth, pi / pi.sum()  # pi_min at the eviction query


def test_correction_beats_renormalisation_at_moderate_m():
    """At m = n / 4 the count-weighted correction beats plain renormalisation over the kept set.

    (At m >= n / 2 it no longer does with pi_min here: kept entries then carry their exact e^s
    while count weights c / (m pi) add Poisson noise; see the next test.)
    """
    s, v, truth, pi = pi_min_problem()
    reps, m = 3000, N / 4
    err_c = ((estimates(pi, m, s, v, reps, seed=7) - truth) ** 2).sum(-1)
    err_u = ((estimates(pi, m, s, v, reps, seed=7, correct=False) - truth) ** 2).sum(-1)
    assert paired_z(err_u, err_c) > 3


@pytest.mark.parametrize("m", [N / 4, N / 2, N])
def test_inclusion_weights_beat_counts_and_renormalisation(m):
    """Horvitz-Thompson weights 1 / q_i = E[c_i / (m pi_i) | c_i > 0] (Rao-Blackwellised counts)."""
    s, v, truth, pi = pi_min_problem()
    reps = 3000
    err_ht = ((estimates(pi, m, s, v, reps, seed=7, inclusion_weights=True) - truth) ** 2).sum(-1)
    err_c = ((estimates(pi, m, s, v, reps, seed=7) - truth) ** 2).sum(-1)
    err_u = ((estimates(pi, m, s, v, reps, seed=7, correct=False) - truth) ** 2).sum(-1)
    assert paired_z(err_c, err_ht) > 3 and paired_z(err_u, err_ht) > 3


def heads(L=4, H=3, n=256, seed=0):
    """Proposals from flat to peaked: (L, 1, H, n)."""
    g = torch.Generator().manual_seed(seed)
    sharp = torch.linspace(0.0, 4.0, L * H).view(L, 1, H, 1)
    return torch.softmax(sharp * torch.randn(L, 1, H, n, generator=g), -1)


@pytest.mark.parametrize("scope", ["global", "layer", "head"])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.9])
def test_realised_ratio_meets_target(scope, ratio):
    pi = heads()
    g = torch.Generator().manual_seed(0)
    realised = [1 - draw(pi, ratio, scope, g).keep.double().mean().item() for _ in range(20)]
    # one draw has sd <= 0.5 / sqrt(L H n) = 0.009; the mean of 20, 0.002
    assert abs(sum(realised) / 20 - ratio) < 0.01


@pytest.mark.parametrize("scope", ["global", "layer", "head"])
def test_expected_kept_solves_the_budget(scope):
    pi = heads()
    target = {"global": torch.tensor(0.5 * 256 * 12), "layer": torch.full((4, 1, 1, 1), 0.5 * 256 * 3),
              "head": torch.full((4, 1, 3, 1), 0.5 * 256)}[scope]
    m = solve_draws(pi, target.view(-1, 1, 1, 1) if scope == "global" else target, scope)
    kept = expected_kept(pi, m.expand(4, 1, 3, 1))  # (L, 1, H)
    total = {"global": kept.sum(), "layer": kept.sum((1, 2)), "head": kept}[scope]
    torch.testing.assert_close(total.double(), target.double().reshape(total.shape), rtol=1e-9, atol=1e-6)


@pytest.mark.parametrize("fields", [{}, {"n_sink": 4, "window": 8}, {"alpha": 0.5}])
def test_draw_reports_its_expected_kept_count_and_the_draws_average_it(fields):
    """stats["expected_kept"] is the budget (1 - r) n L H (the sure entries count against it), and the kept
    count of 400 independent draws averages it: within 4 standard errors, sd^2 = sum q (1 - q) from an
    explicit loop over q_i = 1 - exp(-m pi_i) on the sampled stratum."""
    pi = heads()
    L, _, H, n = pi.shape
    g = torch.Generator().manual_seed(3)
    first = draw(pi, 0.75, "global", g, **fields)
    assert abs(first.stats["expected_kept"] - 0.25 * n * L * H) < 1e-6
    counts = torch.tensor([float(draw(pi, 0.75, "global", g, **fields).keep.sum()) for _ in range(400)],
                          dtype=torch.float64)
    sampled = first.log_weight != 0  # the sampled stratum, where the weight is not the sure entries' 1
    m = first.stats["m"]
    variance = 0.0
    for layer in range(L):
        for head in range(H):
            scale = m if isinstance(m, float) else m[layer][head]
            rest = pi[layer, 0, head].double() * sampled[layer, 0, head]
            rest = rest / rest.sum()
            for p in rest.tolist():
                q = 1.0 - math.exp(-scale * p)
                variance += q * (1.0 - q)
    assert abs(counts.mean().item() - first.stats["expected_kept"]) < 4 * math.sqrt(variance / 400)


def test_global_budget_spends_more_on_flat_heads():
    n = 512
    g = torch.Generator().manual_seed(1)
    flat = torch.full((n,), 1.0 / n)
    peaked = torch.softmax(4 * torch.randn(n, generator=g), 0)
    pi = torch.stack([flat, peaked]).view(1, 1, 2, n)
    kept = draw(pi, 0.5, "global", g).keep.sum(-1).flatten()
    assert kept[0] > kept[1] + 50
    head = draw(pi, 0.5, "head", g).keep.sum(-1).flatten()
    assert (head - n / 2).abs().max() < 4 * math.sqrt(n / 4)  # each head near its own budget


def test_sinks_and_window_are_kept_exactly_with_weight_one():
    pi = heads(L=2, H=2, n=128)
    result = draw(pi, 0.5, "global", torch.Generator().manual_seed(0), n_sink=4, window=8)
    exact = torch.zeros(128, dtype=torch.bool)
    exact[:4] = exact[-8:] = True
    assert result.keep[..., exact].all()
    assert (result.log_weight[..., exact] == 0).all()


def test_topk_sampler_is_deterministic_top_k_under_the_allocation():
    pi = heads(L=2, H=3, n=200)
    a = TopKSampler()(pi, 0.5, "global", torch.Generator().manual_seed(0))
    b = TopKSampler()(pi, 0.5, "global", torch.Generator().manual_seed(99))
    assert torch.equal(a.keep, b.keep) and (a.log_weight[a.keep] == 0).all()
    # per head, the kept entries are the top ones by pi
    for layer in range(2):
        for h in range(3):
            keep, p = a.keep[layer, 0, h], pi[layer, 0, h]
            assert p[keep].min() >= p[~keep].max()
    # and the allocation follows the global budget: flat heads keep more
    counts = a.keep.sum(-1).flatten()
    assert counts[0] > counts[-1]


def test_coordinated_sampling_keeps_marginals_and_aligns_heads():
    pi = torch.full((3, 1, 4, 100), 0.01)
    g = torch.Generator().manual_seed(0)
    runs = [draw(pi, 0.5, "global", g, coordinated=True).keep for _ in range(200)]
    keep = torch.stack(runs).double()  # (R, L, 1, H, n)
    assert abs(keep.mean().item() - 0.5) < 4 * math.sqrt(0.25 / keep[:, 0, 0, 0].numel())
    # every head of every layer keeps the same positions (the same uniform, the same q)
    assert (keep == keep[:, :1, :, :1]).all()
    independent = torch.stack([draw(pi, 0.5, "global", g).keep for _ in range(50)])
    assert not (independent == independent[:, :1, :, :1]).all()


def test_same_seed_same_draw_different_seed_differs():
    pi = heads()
    a = draw(pi, 0.5, "global", torch.Generator().manual_seed(5))
    b = draw(pi, 0.5, "global", torch.Generator().manual_seed(5))
    c = draw(pi, 0.5, "global", torch.Generator().manual_seed(6))
    assert torch.equal(a.keep, b.keep) and torch.equal(a.log_weight, b.log_weight)
    assert not torch.equal(a.keep, c.keep)


def test_weights_are_unbiased_for_one():
    """E[c / (m pi)] = 1 for every entry, so new tokens enter the same softmax with weight 1."""
    pi = heads(L=1, H=1, n=50)
    g = torch.Generator().manual_seed(3)
    reps = 4000
    kept, log_w = sample(pi.expand(reps, 1, 1, 50), torch.tensor(30.0), g)
    w = torch.where(kept, log_w.exp(), torch.zeros_like(log_w))[:, 0, 0]  # (reps, 50)
    se = w.std(0) / math.sqrt(reps)
    assert ((w.mean(0) - 1).abs() < 4.5 * se + 1e-12).all()


# ---------------------------------------------------------------- designs beyond the paper's draws
from kvpress_prob.samplers.priority import PrioritySampler  # noqa: E402
from kvpress_prob.samplers.threshold import ThresholdSampler  # noqa: E402

from kvpress_prob.samplers.block import BlockSampler  # noqa: E402

DESIGNS = [PoissonSampler(), PoissonSampler(inclusion_weights=True), ThresholdSampler(), PrioritySampler(),
           ThresholdSampler(min_keep=0.9), PrioritySampler(min_keep=0.9), BlockSampler(size=3),
           BlockSampler(size=4, inner=PrioritySampler()), BlockSampler(size=5, inner=PoissonSampler()),
           BlockSampler(size=3, inner=PrioritySampler())]  # 14 blocks: a block budget of 5.6, rounded at random


def weighted_totals(sampler, pi, y, reps, ratio=0.6, seed=0):
    """(reps,) sum_kept w_i y_i over ``reps`` independent draws, each a head of one call."""
    n = pi.shape[-1]
    result = sampler(pi.expand(1, 1, reps, n), ratio, "head", torch.Generator().manual_seed(seed))
    w = torch.where(result.keep, result.log_weight.double().exp(), torch.zeros(()).double())[0, 0]  # (reps, n)
    return w @ y, result


@pytest.mark.parametrize("sampler", DESIGNS, ids=repr)
def test_design_weights_are_unbiased_for_the_full_total(sampler):
    """E[sum_kept w_i y_i] = sum_i y_i for every design: z within 4.5 standard errors; and the
    same draws with the weights dropped (plain renormalisation's numerator) are far off."""
    g = torch.Generator().manual_seed(1)
    n, reps = 40, 40000
    pi = torch.softmax(2.0 * torch.randn(n, generator=g, dtype=torch.float64), 0)
    y = torch.rand(n, generator=g, dtype=torch.float64) + 0.5  # any fixed values
    totals, result = weighted_totals(sampler, pi, y, reps)
    z = (totals.mean() - y.sum()) / (totals.std() / math.sqrt(reps))
    assert abs(z) < 4.5, f"bias of {float(totals.mean() - y.sum()):.4f} is {float(z):.1f} standard errors"
    unweighted = torch.where(result.keep[0, 0], 1.0, 0.0).double() @ y
    assert abs(unweighted.mean() - y.sum()) > 10 * unweighted.std() / math.sqrt(reps)  # the test has power


@pytest.mark.parametrize("scope", ["global", "layer", "head"])
def test_threshold_and_priority_meet_the_budget(scope):
    pi = heads(L=3, H=2, n=300)
    for sampler in (ThresholdSampler(), PrioritySampler(), ThresholdSampler(min_keep=0.5)):
        kept = torch.stack([sampler(pi, 0.75, scope, torch.Generator().manual_seed(s)).keep for s in range(10)])
        realised = 1 - kept.double().mean().item()
        # Poisson-binomial size: sd of the mean kept fraction <= sqrt(n_total / 4) / n_total per draw
        assert abs(realised - 0.75) < 4.5 * math.sqrt(1 / (4 * kept[0].numel() * 10)) + 1.0 / 300
    exact = PrioritySampler()(pi, 0.75, "head", torch.Generator().manual_seed(0)).keep.sum(-1)
    assert (exact == int(300 * 0.25)).all()  # priority: exactly the head's count, as kvpress keeps


def test_threshold_keeps_heavy_entries_surely():
    pi = torch.full((1, 1, 1, 100), 0.5 / 98, dtype=torch.float64)
    pi[..., :2] = 0.25  # two heavy entries: 1 / c <= 0.25 at a 50 % budget
    for seed in range(20):
        result = ThresholdSampler()(pi, 0.5, "head", torch.Generator().manual_seed(seed))
        assert result.keep[..., :2].all() and (result.log_weight[..., :2] == 0).all()


def test_allocation_floor_lifts_the_poorest_head():
    flat = torch.full((300,), 1 / 300, dtype=torch.float64)
    peaked = torch.softmax(torch.linspace(0, 30, 300, dtype=torch.float64), 0)
    pi = torch.stack([flat, peaked]).view(1, 1, 2, 300)
    share = 0.5 * 300

    def expected(sampler):
        return torch.stack([sampler(pi, 0.5, "global", torch.Generator().manual_seed(s)).keep.sum(-1)
                            for s in range(200)]).double().mean(0).flatten()

    plain, floored = expected(ThresholdSampler()), expected(ThresholdSampler(min_keep=0.8))
    assert plain[1] < 0.8 * share - 10  # without the floor the peaked head keeps little
    assert floored[1] > 0.8 * share - 5  # with it, at least its floor (200 draws: sd ~ 0.6)
    assert abs(floored.sum() - 2 * share) < 5  # and the total is still the budget


def test_same_seed_same_kept_set_for_every_design():
    pi = heads(L=2, H=2, n=64)
    for sampler in DESIGNS:
        a, b = (sampler(pi, 0.5, "global", torch.Generator().manual_seed(9)) for _ in range(2))
        assert torch.equal(a.keep, b.keep) and torch.equal(a.log_weight, b.log_weight)


def test_block_sampler_keeps_whole_blocks_with_one_weight():
    pi = heads(L=2, H=2, n=100)  # 100 = 12 blocks of 8 and one of 4
    for inner in (ThresholdSampler(), PrioritySampler(), TopKSampler()):
        result = BlockSampler(size=8, inner=inner)(pi, 0.5, "global", torch.Generator().manual_seed(2))
        assert result.keep.shape == pi.shape
        tail = result.keep[..., 96:]
        assert (tail.all(-1) | ~tail.any(-1)).all()  # the short last block too
        keep = result.keep[..., :96].reshape(2, 1, 2, 12, 8)
        assert (keep.all(-1) | ~keep.any(-1)).all(), type(inner).__name__  # all or nothing per block
        w = result.log_weight[..., :96].reshape(2, 1, 2, 12, 8)
        kept_blocks = keep.all(-1)
        assert (w[kept_blocks][:, :1] == w[kept_blocks]).all()  # one weight per block
    assert not BlockSampler(inner=TopKSampler()).random and BlockSampler().random
    with pytest.raises(ValueError, match="size"):
        BlockSampler(size=0)


# ---------------------------------------------------------------- whole counts meet the budget
from kvpress_prob.samplers.stratified import StratifiedSampler  # noqa: E402


@pytest.mark.parametrize("scope", ["global", "layer", "head"])
@pytest.mark.parametrize("sampler", [PrioritySampler(), TopKSampler(), StratifiedSampler(alpha=0.5)], ids=repr)
def test_whole_count_designs_keep_exactly_the_scope_budget(sampler, scope):
    """A design that keeps a whole count per head keeps exactly kvpress's count of the group's entries in each
    group of the scope (2 layers x 4 heads x 50 entries at r = 0.51: int(24.5) = 24 per head, int(98.0) = 98 per
    layer, 196 in all); rounding each head down kept 192 of 196 under "global"."""
    pi = heads(L=2, H=4, n=50, seed=4)
    kept = sampler(pi, 0.51, scope, torch.Generator().manual_seed(0)).keep.sum(-1)[:, 0]  # (L, H)
    totals = {"global": kept.sum().reshape(1), "layer": kept.sum(-1), "head": kept.flatten()}[scope]
    budget = {"global": 196, "layer": 98, "head": 24}[scope]
    assert (totals == budget).all(), totals.tolist()


@pytest.mark.parametrize("scope", ["head", "global"])
@pytest.mark.parametrize("inner", [PrioritySampler(), StratifiedSampler(alpha=0.5)], ids=repr)
def test_block_with_a_whole_count_inner_meets_the_budget_in_expectation(inner, scope):
    """Blocks of 8 over n = 40 at r = 0.55: (1 - r) 5 = 2.25 blocks (18 tokens) per head. The block
    budget of the scope (2.25 blocks a head, 13.5 for 2 x 3 heads) is rounded up with probability
    its fractional part, so the kept tokens per head average 18 (the floor kept 16). The count of
    one call is 8 (floor + Bernoulli(f)) blocks' worth over the group: its exact variance gives
    the standard error of the mean over 400 seeds, tolerance 4.5 of them."""
    L, H = (1, 1) if scope == "head" else (2, 3)
    pi = heads(L=L, H=H, n=40, seed=6)
    sampler = BlockSampler(size=8, inner=inner)
    per_head = torch.stack([sampler(pi, 0.55, scope, torch.Generator().manual_seed(s)).keep.sum(-1).double().mean()
                            for s in range(400)])
    blocks = L * H * 5 * 0.45
    f = blocks - math.floor(blocks)
    se = 8 * math.sqrt(f * (1 - f)) / (L * H) / math.sqrt(400)
    assert abs(float(per_head.mean()) - 18) < 4.5 * se, float(per_head.mean())


def test_block_refuses_an_inner_with_sinks_or_a_window():
    with pytest.raises(ValueError, match="n_sink = window = 0"):
        BlockSampler(size=8, inner=PoissonSampler(n_sink=4))
