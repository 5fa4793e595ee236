"""The `model:` and `diffusion:` sections of the kinds that ship with looped_lm (looped_lm/kinds/builtin.py).

A kind's section lists only the fields that mean something for it: a config that sets another kind's
field is refused in one line naming the kinds that have it. The shared parts sit in base classes
(looped_lm/kinds/base.py: ModelSection, BlockDiffusion, NoiseDiffusion), so `--help-config` lists a
shared field once.
"""

from __future__ import annotations

from typing import Literal

from looped_lm.fields import Bridge, Float, field
from looped_lm.kinds.base import (BlockDiffusion, LanguageModelSection, ModelSection, NoiseDiffusion, SequenceSection,
                                  ensure)


# --- model: sections ----------------------------------------------------------------------------------------
class GptSection(LanguageModelSection):
    kind: Literal["gpt"] = field("gpt", "gpt: end-to-end next-token CE")
    activation_checkpointing: bool = field(False, "recompute each layer in backward instead of storing its "
                                                  "activations (the end-to-end alternative to DiffusionBlocks' "
                                                  "memory)")


class DbArSection(LanguageModelSection):
    kind: Literal["db_ar"] = field("db_ar", "db_ar: DiffusionBlocks AR LM, one block trained per step")
    activation_checkpointing: bool = field(False, "recompute each layer of the trained block (both streams; huginn: "
                                                  "each layer of the iterations with gradient) in backward instead "
                                                  "of storing its activations")
    n_prelude: int = field(0, "shared clean-stream layers before the blocks (looped: the core; the paper: 2)")
    n_coda: int = field(0, "shared layers after the blocks (looped: the core; the paper: 2)")
    max_iterations: int = field(64, "the largest K accepted at inference")


class LoopedDbSection(DbArSection):
    kind: Literal["looped_db"] = field("looped_db", "looped_db: prelude -> weight-tied two-stream core -> coda")
    init_core_start: int = field(-1, "init_from: the first source layer of the core; -1 = right after the prelude")


class HuginnSection(LoopedDbSection):
    kind: Literal["huginn"] = field("huginn", "huginn: recurrent depth trained with truncated BPTT")
    mean_recurrence: int = field(32, "mean of the Poisson-log-normal iteration count r (training), and the "
                                     "default K at inference unless num_iterations is set")
    backprop_depth: int = field(8, "gradients flow through the last k iterations only")
    allow_full_backprop: bool = field(False, "allow backprop_depth > mean_recurrence")
    num_iterations: int = field(0, "default K (core iterations) at inference; 0 = mean_recurrence")


class ImageSection(ModelSection):
    end_to_end: bool = field(False, "the same network trained end-to-end over the whole noise range (the "
                                    "baseline), instead of diffusion.num_blocks blocks")
    image_size: int = field(32, "side of the (square) images or latents; must match the data")
    channels: int = field(3, "image (or latent) channels; must match the data")
    patch: int = field(4, "patch side; image_size must divide by it (the paper: vit 4, dit 2)")


class VitSection(ImageSection):
    kind: Literal["vit"] = field("vit", "vit: a ViT classifier whose noisy label is denoised block by block")
    num_classes: int = field(10, "classes; must match the data")
    label_table: Literal["fixed", "learned"] = field(
        "fixed", "the clean label points: fixed random unit vectors, or learned (normalised to unit norm at every "
        "use, trained with the shared parts: the official code's)")


class DitSection(ImageSection):
    kind: Literal["dit"] = field("dit", "dit: a DiT image (or latent) denoiser")
    num_classes: int = field(10, "classes it is conditioned on (0 = unconditional); must match the data")


class MdmSection(SequenceSection):
    kind: Literal["mdm"] = field("mdm", "mdm: MD4 masked diffusion over text8's characters")
    end_to_end: bool = field(False, "the same network trained end-to-end over the whole masking range (the "
                                    "baseline), instead of diffusion.num_blocks blocks")


# --- diffusion: sections ---------------------------------------------------------------------------------
class TokenDiffusion(NoiseDiffusion):
    """The DiffusionBlocks language models (db_ar, looped_db): a noisy next-token slot beside a clean stream."""

    block_sampling: Literal["uniform", "round_robin", "loss_share", "network_gain", "fixed"] = field(
        "network_gain", "which block a step trains: uniform (paper), round_robin, network_gain (in proportion to what "
        "the network adds to z's own likelihood in each block's interval: block 0 learns the whole context prior; "
        "uniform until the first curve), loss_share (to each block's share of the CE drop, which counts what z gives "
        "for free) or fixed (diffusion.block_weights); train.mode block_parallel: which of its own blocks a rank "
        "trains (uniform, round_robin or fixed)")
    extra_calls: Literal["spread", "block0"] = field(
        "block0", "where a chain's calls beyond B run: block0 (the K = B grid, the extra K - B calls inside block 0's "
        "interval: K > B held K = B's quality where spread lost it, on SmolLM2 and on the quickstart; "
        "docs/method.md §5) or spread (all K equally in the noise CDF, about K / B per block)")
    curve_every: int = field(200, "block_sampling loss_share / network_gain: re-measure held-out CE(sigma) every N steps")
    curve_until: int = field(0, "stop re-measuring (freeze the block shares) after this step; 0 = never")
    parameterization: Literal["edm", "likelihood"] = field(
        "likelihood", "how a noisy slot reads z: edm (paper: c_in*z in, c_skip*z skip) or likelihood (z's exact token "
        "log-likelihood <z,y_v>/sigma^2 added to the logits, and its posterior-mean embedding as input: the network "
        "models only what context adds)")
    noisy_self: bool = field(False, "a noisy slot attends its own key besides the clean keys (paper); false: clean "
                                    "keys only, plain causal attention (flash), and servable by vLLM's paged attention")
    noisy_input: Literal["noise", "prev_token", "clean_state"] = field(
        "prev_token", "noisy slot input: what it reads of z alone (noise), or that + E[previous token] (prev_token), "
        "or that minus the embedding table's mean row + the block's clean input state at the previous token "
        "(clean_state: the slot continues the clean stream's depth, so a converted model's block that owns a "
        "source's last layers reads them out as the source does: docs/pretrained.md)")
    posterior_input: Literal["full", "detached", "topk"] = field(
        "full", "likelihood: the slot's input embedding softmax(<z,y>/sigma^2) @ E with a gradient into E (full), "
        "without one (detached: one V-sized product less in backward), or from its top posterior_topk tokens plus "
        "the rest's mass on the other rows' mean (topk, also forward-only)")
    posterior_topk: int = field(64, "posterior_input topk: tokens whose embeddings enter exactly")
    head: Literal["tied", "cosine"] = field(
        "tied", "output head: tied (RMSNorm then the embedding table) or cosine (a learned scale times the cosine to "
        "the unit-norm targets; with the likelihood layout its log-likelihood term is folded into the same product)")
    clean_lm_weight: Float = field(0.0, "weight of a next-token CE on each block's clean stream, added to the loss")
    denoise_weight: Float = field(1.0, "weight of the denoising loss (the noisy slots' CE); 0 = off, the control arm "
                                       "that says what denoising adds: each block trains on the clean_lm_weight "
                                       "loss alone, the blocks before it (context stacked) frozen and detached; such "
                                       "a model is read through its clean stream (eval's ppl_clean) and cannot "
                                       "sample")
    loss_weight: Literal["none", "edm", "batch_mean"] = field(
        "none", "CE weight per sample: none, edm (normalised w(sigma)) or batch_mean")
    top_share: Float = field(
        0.0, "share of block 0's training samples taken at exactly sigma_max, where z carries nothing, as at a "
        "chain's first call (sigma_top, a high quantile of block 0's law, where z carries as little: all that "
        "ppl@0 reads); the rest are drawn from block 0's interval as usual, where the network learns to read z")
    target_scale: Literal["unit", "sigma_data"] = field(
        "unit", "noisy targets are unit-norm embeddings (unit) or per-dim RMS sigma_data")
    target_fraction: Float = field(1.0, "share of noisy slots trained per sequence (clean stream stays whole)")
    bridge: Bridge = field(
        "sample", "logits -> denoised embedding between steps: soft (expectation), hard (argmax), or sample (a token "
        "drawn from the logits)")
    num_iterations: int = field(0, "default K denoising steps per token of every verb (generate, eval, serve, export); "
                                   "0 = num_blocks")

    def check(self) -> None:
        super().check()
        ensure(0 < self.target_fraction <= 1, f"diffusion.target_fraction must be in (0, 1] (got "
                                              f"{self.target_fraction})")
        ensure(self.curve_every >= 1 and self.curve_until >= 0,
               "diffusion.curve_every must be >= 1 and curve_until >= 0")
        ensure(self.clean_lm_weight >= 0, f"diffusion.clean_lm_weight must be >= 0 (got {self.clean_lm_weight})")
        ensure(self.denoise_weight >= 0, f"diffusion.denoise_weight must be >= 0 (got {self.denoise_weight})")
        if self.denoise_weight == 0:  # the control arm: the clean next-token loss alone
          ensure(self.clean_lm_weight > 0, "diffusion.denoise_weight 0 leaves no loss: set diffusion.clean_lm_weight "
                                             "> 0 (each block then trains on the clean next-token loss alone)")
          ensure(self.block_sampling in ("uniform", "round_robin", "fixed"),
                   f"diffusion.denoise_weight 0: block_sampling {self.block_sampling} reads the denoiser's CE "
                   "curve, which is not trained; use uniform, round_robin or fixed")
        ensure(0 <= self.top_share <= 1, f"diffusion.top_share must be in [0, 1] (got {self.top_share})")
        ensure(self.posterior_topk >= 1, f"diffusion.posterior_topk must be >= 1 (got {self.posterior_topk})")
        ensure(self.num_iterations >= 0, f"diffusion.num_iterations must be >= 1, or 0 for num_blocks (got "
                                         f"{self.num_iterations})")


class DbArDiffusion(TokenDiffusion):
    layers_per_block: int | list[int] = field(
        0, "the layers of each block, instead of num_blocks: N (every block N deep, num_blocks = n_layers / N) or one "
        "count per block from block 0 (highest noise) down, e.g. [3, 1]; 0 = n_layers / num_blocks each")
    context: Literal["independent", "stacked"] = field(
        "independent", "where block b's clean stream starts: the embedding (independent, the paper: a prediction has "
        "the context depth of one block) or the clean states of blocks < b, run forward without gradient (stacked: "
        "the depth of every block up to b; a step still backpropagates through one block; no independent block jobs)")
    stack_order: Literal["high_noise_first", "low_noise_first"] = field(
        "high_noise_first", "context stacked: the order the clean stream runs through the blocks: block 0 (highest "
        "noise, the first call of every chain) first and so shallowest, or the lowest-noise block first, so block 0 "
        "has the depth of all")


class VitDiffusion(NoiseDiffusion):
    """vit: the label is the noisy variable, denoised block by block."""

    parameterization: Literal["edm", "likelihood"] = field(
        "likelihood", "how the noisy label reads z: edm (paper: c_in*z in, c_skip*z skip) or likelihood (z's exact "
        "label log-likelihood <z,y_v>/sigma^2 added to the logits)")
    loss_weight: Literal["none", "edm", "batch_mean"] = field(
        "none", "CE weight per sample: none, edm (normalised w(sigma)) or batch_mean (the official code's)")
    bridge: Bridge = field(
        "sample", "logits -> denoised label embedding between steps: soft (expectation), hard (argmax), or sample")
    num_iterations: int = field(0, "default K denoising steps of eval; 0 = num_blocks (at least one per block)")

    def check(self) -> None:
        super().check()
        ensure(self.num_iterations >= 0, f"diffusion.num_iterations must be >= 1, or 0 for num_blocks (got "
                                         f"{self.num_iterations})")


class DitDiffusion(NoiseDiffusion):
    """dit: images (or latents) denoised block by block, with classifier-free guidance."""

    label_dropout: Float = field(0.1, "share of training labels replaced by the null class (classifier-free guidance)")
    cfg_scale: Float = field(2.0, "default classifier-free guidance scale of generate and eval (1 = none)")
    sample_steps: int = field(0, "default Euler steps of generate / eval (0 = 50, the paper's)")

    def check(self) -> None:
        super().check()
        ensure(0 <= self.label_dropout < 1, f"diffusion.label_dropout must be in [0, 1) (got {self.label_dropout})")
        ensure(self.cfg_scale >= 0, f"diffusion.cfg_scale must be >= 0 (got {self.cfg_scale})")
        ensure(self.sample_steps >= 0, f"diffusion.sample_steps must be >= 0 (got {self.sample_steps})")


class MdmDiffusion(BlockDiffusion):
    """mdm: characters masked by a schedule alpha(t); blocks own intervals of t."""

    schedule: Literal["linear", "cosine"] = field(
        "linear", "the masking schedule alpha(t) (linear: 1 - t; cosine); its partition is t_b = alpha^-1(1 - b/B)")
    sample_steps: int = field(0, "default unmasking steps of generate (0 = model.seq_len)")

    def check(self) -> None:
        super().check()
        ensure(self.sample_steps >= 0, f"diffusion.sample_steps must be >= 0 (got {self.sample_steps})")
