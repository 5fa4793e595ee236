"""DiffusionBlocks maths: noise schedule and EDM preconditioning, block partitions, inference grid."""

from looped_lm.diffusion.noise import (
    NoiseSchedule,
    cdf_range,
    check_interval,
    edm_loss_weight_normaliser,
    edm_scalings,
    edm_weight,
    lognormal_cdf,
    lognormal_icdf,
    sample_sigma,
    sigma_at_fraction,
)
from looped_lm.diffusion.partition import (
    PARTITION_KINDS,
    block_intervals,
    check_edges,
    equi_probability_edges,
    make_edges,
    route_sigma,
    uniform_edges,
    widen,
)
from looped_lm.diffusion.sampler import euler_step, inference_sigmas, route_steps

__all__ = [
    "NoiseSchedule",
    "cdf_range",
    "check_interval",
    "edm_loss_weight_normaliser",
    "edm_scalings",
    "edm_weight",
    "lognormal_cdf",
    "lognormal_icdf",
    "sample_sigma",
    "sigma_at_fraction",
    "PARTITION_KINDS",
    "block_intervals",
    "check_edges",
    "equi_probability_edges",
    "make_edges",
    "route_sigma",
    "uniform_edges",
    "widen",
    "euler_step",
    "inference_sigmas",
    "route_steps",
]
