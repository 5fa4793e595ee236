"""Unit tests for looped_lm.diffusion against numbers computed by hand (docs/method.md §1, §2, §5)."""

import math

import pytest
import torch

from looped_lm.diffusion import (
    NoiseSchedule,
    block_intervals,
    cdf_range,
    edm_loss_weight_normaliser,
    edm_scalings,
    edm_weight,
    equi_probability_edges,
    euler_step,
    inference_sigmas,
    lognormal_cdf,
    lognormal_icdf,
    make_edges,
    route_sigma,
    route_steps,
    sample_sigma,
    uniform_edges,
    widen,
)
from looped_lm.errors import UserError

SCHED = NoiseSchedule()


def close(a, b, tol=1e-9):
    return all(abs(x - y) <= tol for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------------------------------
# §1 noise and preconditioning


def test_edm_scalings_by_hand_sigma_equals_sigma_data():
    # σ = σd = 0.5: σ²+σd² = 0.5, √0.5 = 0.70710678
    c_skip, c_out, c_in, c_noise = edm_scalings(0.5, 0.5)
    assert c_skip.item() == pytest.approx(0.5)  # 0.25 / 0.5
    assert c_out.item() == pytest.approx(0.35355339059)  # 0.25 / 0.70710678
    assert c_in.item() == pytest.approx(1.41421356237)  # 1 / 0.70710678
    assert c_noise.item() == pytest.approx(-0.17328679514)  # ln(0.5) / 4


def test_edm_scalings_by_hand_sigma_one():
    # σ = 1, σd = 0.5: σ²+σd² = 1.25, √1.25 = 1.11803399
    c_skip, c_out, c_in, c_noise = edm_scalings(torch.tensor([1.0], dtype=torch.float64), 0.5)
    assert c_skip.item() == pytest.approx(0.2)  # 0.25 / 1.25
    assert c_out.item() == pytest.approx(0.44721359550)  # 0.5 / 1.11803399
    assert c_in.item() == pytest.approx(0.89442719100)  # 1 / 1.11803399
    assert c_noise.item() == 0.0  # ln 1 = 0
    assert c_skip.shape == (1,)


def test_edm_weight_by_hand():
    assert edm_weight(0.5, 0.5).item() == pytest.approx(8.0)  # 2/σd² at σ = σd: 0.5 / 0.0625
    assert edm_weight(1.0, 0.5).item() == pytest.approx(5.0)  # 1.25 / 0.25
    assert edm_weight(0.1, 0.5).item() == pytest.approx(104.0)  # 1/σ² + 1/σd² = 100 + 4
    sigma = torch.logspace(-2, 1, 7, dtype=torch.float64)
    _, c_out, _, _ = edm_scalings(sigma, 0.5)
    torch.testing.assert_close(edm_weight(sigma, 0.5), 1 / c_out**2)  # w = 1/c_out²


def test_lognormal_cdf_by_hand_and_inverse():
    assert lognormal_cdf(math.exp(-1.2), -1.2, 1.2) == pytest.approx(0.5)  # ln σ = P_mean
    assert lognormal_cdf(1.0, -1.2, 1.2) == pytest.approx(0.841344746)  # Φ(1)
    assert lognormal_icdf(0.5, -1.2, 1.2) == pytest.approx(0.301194212)  # e^-1.2
    for x in (0.002, 0.05, 0.3, 1.0, 7.0, 80.0):
        assert lognormal_icdf(lognormal_cdf(x, -1.2, 1.2), -1.2, 1.2) == pytest.approx(x, rel=1e-9)
    x = torch.tensor([0.002, 0.05, 0.3, 1.0, 7.0, 80.0], dtype=torch.float64)
    q = lognormal_cdf(x, -1.2, 1.2)
    torch.testing.assert_close(lognormal_icdf(q, -1.2, 1.2), x, rtol=1e-9, atol=0)
    assert q[3].item() == pytest.approx(0.841344746)  # tensor path agrees with the float path


def test_sample_sigma_range_determinism_and_median():
    lo, hi = 0.124, 0.327
    a = sample_sigma(200_000, lo, hi, SCHED, generator=torch.Generator().manual_seed(0))
    b = sample_sigma(200_000, lo, hi, SCHED, generator=torch.Generator().manual_seed(0))
    assert a.dtype == torch.float32 and a.shape == (200_000,)
    assert torch.equal(a, b)
    assert (a >= lo).all() and (a <= hi).all()
    q_lo, q_hi = cdf_range(lo, hi, SCHED)
    median = lognormal_icdf((q_lo + q_hi) / 2, SCHED.p_mean, SCHED.p_std)
    assert a.median().item() == pytest.approx(median, rel=0.02)


def test_sample_sigma_full_range_median():
    s = sample_sigma(200_000, SCHED.sigma_min, SCHED.sigma_max, SCHED, generator=torch.Generator().manual_seed(1))
    assert (s >= SCHED.sigma_min).all() and (s <= SCHED.sigma_max).all()
    # Truncation barely moves the median from e^P_mean: the median B=2 edge is 0.3012.
    assert s.median().item() == pytest.approx(0.30120010, rel=0.02)


def test_edm_loss_weight_normaliser_matches_quadrature():
    for lo, hi in [(0.002, 80.0), (0.002, 0.204), (0.42, 80.0), (0.124, 0.327)]:
        n = 200_000  # midpoint rule in quantile space
        q_lo, q_hi = cdf_range(lo, hi, SCHED)
        frac = (torch.arange(n, dtype=torch.float64) + 0.5) / n
        sigma = lognormal_icdf(q_lo + frac * (q_hi - q_lo), SCHED.p_mean, SCHED.p_std)
        quad = edm_weight(sigma, SCHED.sigma_data).mean().item()
        assert edm_loss_weight_normaliser(lo, hi, SCHED) == pytest.approx(quad, rel=1e-4)
    # A narrow interval around σ = σd: the mean is w(0.5) = 8.
    assert edm_loss_weight_normaliser(0.4999, 0.5001, SCHED) == pytest.approx(8.0, rel=1e-3)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sigma_min=0.5, sigma_max=0.1), r"diffusion\.sigma_min \(0\.5\) must be below diffusion\.sigma_max \(0\.1\)"),
        (dict(sigma_min=0.0), r"diffusion\.sigma_min"),
        (dict(p_std=0.0), r"diffusion\.p_std"),
        (dict(sigma_data=-1.0), r"diffusion\.sigma_data"),
        (dict(p_mean=float("nan")), r"diffusion\.p_mean"),
    ],
)
def test_schedule_validation(kwargs, match):
    with pytest.raises(UserError, match=match):
        NoiseSchedule(**kwargs).validate()


# ---------------------------------------------------------------------------------------------
# §2 partitions, overlap, routing


@pytest.mark.parametrize(
    "num_blocks, expected",
    [
        (2, [0.002, 0.301, 80.0]),
        (3, [0.002, 0.180, 0.505, 80.0]),
        (4, [0.002, 0.134, 0.301, 0.677, 80.0]),
    ],
)
def test_equi_probability_check_values(num_blocks, expected):
    edges = equi_probability_edges(num_blocks, SCHED)
    assert close(edges, expected, tol=5e-4)
    assert edges[0] == SCHED.sigma_min and edges[-1] == SCHED.sigma_max  # exact ends
    assert make_edges("equi_probability", num_blocks, SCHED) == edges


def test_equi_probability_edges_have_equal_mass():
    edges = equi_probability_edges(5, SCHED)
    q = [lognormal_cdf(e, SCHED.p_mean, SCHED.p_std) for e in edges]
    shares = [b - a for a, b in zip(q, q[1:])]
    assert max(shares) - min(shares) < 1e-12


def test_uniform_edges_by_hand():
    # ln(80/0.002) = ln 40000; quarters multiply by 40000^(1/4) = 14.1421356
    edges = uniform_edges(4, SCHED)
    assert close(edges, [0.002, 0.0282842712, 0.4, 5.6568542495, 80.0], tol=1e-9)
    assert make_edges("uniform", 4, SCHED) == edges


def test_widen_check_values():
    intervals = widen(equi_probability_edges(4, SCHED), 0.1)  # by block index, block 0 highest
    expected = [(0.420, 80.0), (0.278, 0.734), (0.124, 0.327), (0.002, 0.204)]
    for (lo, hi), (elo, ehi) in zip(intervals, expected, strict=True):
        assert abs(lo - elo) < 5e-4 and abs(hi - ehi) < 5e-4
    assert intervals[0][1] == 80.0 and intervals[-1][0] == 0.002  # clipped exactly to the range


def test_widen_zero_overlap_is_block_intervals():
    edges = equi_probability_edges(3, SCHED)
    assert widen(edges, 0.0) == block_intervals(edges)
    assert block_intervals(edges) == [(edges[2], edges[3]), (edges[1], edges[2]), (edges[0], edges[1])]


def test_route_sigma_rule():
    edges = [0.002, 0.1, 1.0, 80.0]  # B = 3: block 0 = (1, 80], block 1 = (0.1, 1], block 2 = [.., 0.1]
    assert route_sigma(50.0, edges) == 0
    assert route_sigma(1000.0, edges) == 0  # above σ_max
    assert route_sigma(1.0, edges) == 1  # on an inner edge: the lower-σ block
    assert route_sigma(1.0000001, edges) == 0
    assert route_sigma(0.5, edges) == 1
    assert route_sigma(0.1, edges) == 2
    assert route_sigma(1e-5, edges) == 2  # below σ_min
    sigma = torch.tensor([[1000.0, 50.0, 1.0], [0.5, 0.1, 1e-5]])
    routed = route_sigma(sigma, edges)
    assert routed.dtype == torch.long and routed.tolist() == [[0, 0, 1], [1, 2, 2]]
    assert isinstance(route_sigma(0.5, edges), int)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: make_edges("equi_entropyy", 4, SCHED), r"diffusion\.partition"),
        (lambda: widen(equi_probability_edges(4, SCHED), 0.6), r"diffusion\.overlap"),
        (lambda: widen(equi_probability_edges(4, SCHED), -0.1), r"diffusion\.overlap"),
        (lambda: equi_probability_edges(0, SCHED), r"diffusion\.num_blocks"),
        (lambda: uniform_edges(2, NoiseSchedule(sigma_min=0.5, sigma_max=0.1)), r"diffusion\.sigma_min"),
        (lambda: route_sigma(0.5, [1.0, 0.5]), r"ascending"),
        (lambda: inference_sigmas(0, SCHED), r"num_iterations must be >= 1 \(got 0\)"),
        (lambda: inference_sigmas(2.0, SCHED), r"num_iterations must be an integer"),
        (lambda: inference_sigmas(2, SCHED, lo=1.0, hi=0.5), r"sigma interval"),
        (lambda: sample_sigma(4, 0.0, 1.0, SCHED), r"sigma interval"),
    ],
)
def test_bad_inputs_raise_user_error(call, match):
    with pytest.raises(UserError, match=match):
        call()


# ---------------------------------------------------------------------------------------------
# §5 inference grid, Euler step, routed steps


def test_inference_sigmas_endpoints_and_spacing():
    for K in (1, 2, 5, 16):
        sigmas = inference_sigmas(K, SCHED)
        assert len(sigmas) == K + 1
        assert sigmas[0] == 80.0 and sigmas[-1] == 0.002
        assert all(a > b for a, b in zip(sigmas, sigmas[1:]))
        q = [lognormal_cdf(s, SCHED.p_mean, SCHED.p_std) for s in sigmas]
        gaps = [a - b for a, b in zip(q, q[1:])]
        assert max(gaps) - min(gaps) < 1e-12  # equal CDF steps
    assert inference_sigmas(3, SCHED, lo=0.2, hi=5.0)[::3] == [5.0, 0.2]


def test_inference_grid_with_k_equal_b_is_the_edges():
    for B in (2, 3, 4):
        assert inference_sigmas(B, SCHED) == equi_probability_edges(B, SCHED)[::-1]


def test_euler_step_identities():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(3, 8, generator=g, dtype=torch.float64)
    eps = torch.randn(3, 8, generator=g, dtype=torch.float64)
    sigma, sigma_next = 2.0, 0.5
    z = y + sigma * eps
    # z − D = σε, so z + (σ' − σ)·ε = y + σ'·ε
    torch.testing.assert_close(euler_step(z, y, sigma, sigma_next), y + sigma_next * eps)
    torch.testing.assert_close(euler_step(z, y, sigma, 0.0), y)
    # By hand: z = 3, D = 1, σ = 2 → 1: 3 + (1 − 2)·(3 − 1)/2 = 2
    assert euler_step(torch.tensor(3.0), torch.tensor(1.0), 2.0, 1.0).item() == 2.0
    # Per-sample σ broadcast over [N, D]
    s = torch.tensor([[2.0], [1.0], [0.5]], dtype=torch.float64)
    torch.testing.assert_close(euler_step(y + s * eps, y, s, s / 2), y + s / 2 * eps)


@pytest.mark.parametrize("num_blocks", [2, 3, 4])
def test_route_steps_visits_blocks_in_order(num_blocks):
    edges = equi_probability_edges(num_blocks, SCHED)
    assert route_steps(num_blocks, edges, SCHED) == list(range(num_blocks))
    assert route_steps(1, edges, SCHED) == [0]
    assert route_steps(3 * num_blocks, edges, SCHED) == [b for b in range(num_blocks) for _ in range(3)]
    # Tensor routing agrees, in float32 too.
    grid = torch.tensor(inference_sigmas(num_blocks, SCHED)[:-1], dtype=torch.float32)
    assert route_sigma(grid, edges).tolist() == list(range(num_blocks))


def test_route_steps_fewer_steps_than_blocks_skips():
    edges = equi_probability_edges(4, SCHED)
    assert route_steps(2, edges, SCHED) == [0, 2]  # σ_1 sits on the median edge 0.301
