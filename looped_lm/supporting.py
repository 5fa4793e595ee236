"""`looped_lm eval` and `looped_lm generate` for the supporting modules (vit, dit, mdm).

The verbs load the checkpoint as for a language model and hand it here when it is not one; what
runs depends on the capability the model offers (models/contract.py):

    eval      Classifier (vit)      top-1 accuracy on the held-out images, K steps      -> JSON on stdout
              ImageGenerator (dit)  Frechet distance of samples to the training images in the features of
                                    a vit checkpoint (--features; NOT FID: no Inception network), beside
                                    the held-out images' own distance (the floor)      -> JSON on stdout
              TextDiffusion (mdm)   bits per character from the negative ELBO (an upper bound), with
                                    each block's t-interval's share                      -> JSON on stdout
    generate  ImageGenerator (dit)  a PNG grid of class-conditional samples (--out), guidance per call
              TextDiffusion (mdm)   samples printed one per line

K (`--num-iterations`) is the number of inference steps, split across the blocks; fewer than one per
block is refused (exit 2). It is resolved once per command by `looped_lm.settings.resolve_steps` (the
flag, else the config's default: diffusion.sample_steps for dit / mdm, else 50 / the sample's length;
diffusion.num_iterations for vit, else B) and passed down as an int. Data defaults to what the
checkpoint trained on (its manifest's source).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from looped_lm.checkpoint import load_checkpoint, resolve_checkpoint
from looped_lm.data.batches import load_module_data
from looped_lm.data.images import write_png_grid
from looped_lm.data.latents import decode_latents, load_vae
from looped_lm.data.text8 import decode
from looped_lm.kinds import kind_of
from looped_lm.errors import UserError
from looped_lm.models.contract import Classifier, ImageGenerator, TextDiffusion
from looped_lm.models.dit import frechet_distance


@dataclass(frozen=True)
class ModuleRequest:
    """What `looped_lm eval` / `generate` ask of a vit / dit / mdm checkpoint: their flags, typed (the verbs
    build it from their parsed flags with `of`; library code never takes the argparse namespace)."""

    device: str = "cpu"
    seed: int = 0
    num_iterations: int | str | None = None  # K: generate parses it, eval passes the text (single_k checks it)
    cfg_scale: float | None = None
    # eval
    data: str | None = None
    split: str = "val"
    max_tokens: int = 0
    draws: int = 1
    batch_size: int = 1
    features: str | None = None
    no_verify: bool = False
    json: str | None = None
    # generate
    prompt: str | None = None
    num_samples: int | None = None
    out: str | None = None
    vae: str | None = None
    labels: str | None = None
    length: int | None = None

    @classmethod
    def of(cls, flags) -> "ModuleRequest":
        """From a verb's parsed flags: the fields it has (eval and generate share some)."""
        return cls(**{f.name: getattr(flags, f.name) for f in fields(cls) if hasattr(flags, f.name)})


def module_data(cfg, manifest: dict, source: str | None):
    """The data of `source` (default: the checkpoint's own), which must be one the model's kind reads."""
    source = source or manifest.get("data", {}).get("dir")
    if not source:
        raise UserError("the checkpoint does not record its data source: pass --data SOURCE")
    kind = source.partition(":")[0]
    readers = kind_of(cfg).data_sources
    if kind not in readers:
        raise UserError(f"--data {source}: model.kind {cfg.model.kind} reads {' / '.join(readers)} "
                        f"(as digits, cifar10:PATH, text8:PATH, ...)")
    if kind in ("cifar10", "cifar100", "text8", "latents"):
        path = source.partition(":")[2]
        if not path:
            raise UserError(f"--data {source}: give the path, as {kind}:PATH")
        source = f"{kind}:{Path(path).resolve()}"
    return load_module_data(source), source


def single_k(text: str | None) -> int | None:
    """eval's --num-iterations for a module: one integer (or absent: the model's default)."""
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise UserError(f"--num-iterations for a vit / dit / mdm checkpoint is one integer K, "
                        f"got '{text}'") from None


def evaluate(model, cfg, manifest: dict, args: ModuleRequest) -> int:
    """`looped_lm eval` of a module checkpoint."""
    if args.max_tokens < 0:
        raise UserError(f"--max-tokens must be >= 0 (got {args.max_tokens})")
    if args.draws < 1 or args.batch_size < 1:
        raise UserError(f"--draws and --batch-size must be >= 1 (got {args.draws} and {args.batch_size})")
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    if isinstance(model, Classifier):
        data, source = module_data(cfg, manifest, args.data)
        n = args.max_tokens or len(data.test_y)
        images, labels = data.test_x[:n], data.test_y[:n]
        # K resolved once, by the model (the request's, else diffusion.num_iterations, else B)
        rep = model.accuracy(images.to(args.device), labels.to(args.device), single_k(args.num_iterations),
                             generator=gen)
        rep = {"model_kind": cfg.model.kind, **rep, "data": source, "split": "test (held out)"}
        summary = f"top-1 accuracy {rep['accuracy']:.4f} on {rep['examples']} held-out images, K = " \
                  f"{rep['num_iterations']}"
    elif isinstance(model, TextDiffusion):
        if args.num_iterations is not None:
            raise UserError("--num-iterations does not apply to mdm's eval: the ELBO integrates over every "
                            "masking time (each routed to its block); pass it to generate")
        data, source = module_data(cfg, manifest, args.data)
        limit = args.max_tokens // model.seq_len if args.max_tokens else None
        if args.max_tokens and not limit:
            raise UserError(f"--max-tokens {args.max_tokens} is less than one window of {model.seq_len} characters")
        windows = data.windows(model.seq_len, args.split, limit)
        parts = []
        for i in range(0, len(windows), args.batch_size):
            part = model.elbo_bpc(windows[i:i + args.batch_size].to(args.device), args.draws, gen)
            parts.append((part, len(windows[i:i + args.batch_size])))
        n = len(windows)
        per_block = [sum(p["per_block"][b] * k for p, k in parts) / n for b in range(len(parts[0][0]["per_block"]))]
        bpc, edges = sum(per_block), parts[0][0]["t_edges"]  # per_block: block 0 (the highest t) first
        rep = {"model_kind": cfg.model.kind, "bpc": bpc, "upper_bound": True,
               "bound": "negative ELBO: an upper bound on the bits per character",
               "per_block": per_block, "share": [b / bpc if bpc else 0.0 for b in per_block],
               "t_intervals": [[edges[-2 - b], edges[-1 - b]] for b in range(len(per_block))],  # of per_block
               "characters": n * model.seq_len, "windows": n,
               "samples_per_block": args.draws, "data": source, "split": args.split}
        shares = " + ".join(f"{b:.3f} ({s:.0%})" for b, s in zip(per_block, rep["share"]))
        summary = f"bits per character <= {bpc:.4f} (negative ELBO, an upper bound) on {n * model.seq_len:,} " \
                  f"{args.split} characters; by t-interval, high t first: {shares}"
    elif isinstance(model, ImageGenerator):
        rep = frechet_report(model, cfg, manifest, args, gen)
        summary = f"Frechet distance {rep['frechet_distance']:.3f} of {rep['samples']} samples to the training images " \
                  f"in the features of {rep['features']} (NOT FID); held-out real images: {rep['floor']:.3f} (the floor)"
    else:
        raise UserError(f"looped_lm eval scores language models, vit, dit and mdm; not {cfg.model.kind}")
    print(json.dumps(rep))
    print(summary, file=sys.stderr)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rep, indent=2))
    return 0


def frechet_report(model, cfg, manifest: dict, args: ModuleRequest, gen) -> dict:
    """A dit's samples (one per held-out image, with its label) against the training images, in the
    feature space of a vit checkpoint trained on the same data (`--features`): Frechet distance, FID's
    formula in another network's features, so NOT comparable with FID. The floor: the held-out images'
    distance to the training images (real images of the same classes, never seen in training)."""
    if not args.features:
        raise UserError("a dit checkpoint is scored by the Frechet distance of its samples in a classifier's "
                        "features: pass --features VIT_CHECKPOINT (a vit trained on the same data)")
    path = resolve_checkpoint(args.features)
    classifier, clf_cfg, _ = load_checkpoint(path, args.device, verify=not args.no_verify)
    if not isinstance(classifier, Classifier):
        raise UserError(f"--features {args.features} is a {clf_cfg.model.kind} checkpoint, not a classifier (vit)")
    shape, clf_shape = (cfg.model.channels, cfg.model.image_size), (clf_cfg.model.channels, clf_cfg.model.image_size)
    if shape != clf_shape or cfg.data.source == "latents":
        raise UserError(f"--features: the vit reads {clf_shape[1]}x{clf_shape[1]} images with {clf_shape[0]} channels, "
                        f"this dit makes {shape[1]}x{shape[1]} {'latents' if cfg.data.source == 'latents' else 'images'} "
                        f"with {shape[0]}")
    data, source = module_data(cfg, manifest, args.data)
    n = min(args.max_tokens or len(data.test_y), len(data.test_y), len(data.train_y))
    steps = model.resolve_steps(single_k(args.num_iterations))
    cfg_scale = cfg.diffusion.cfg_scale if args.cfg_scale is None else args.cfg_scale
    batch = 256
    labels = data.test_y[:n].to(args.device)
    samples = torch.cat([model.sample(labels[i:i + batch], steps, cfg_scale, gen) for i in range(0, n, batch)])

    def features(images):
        g = torch.Generator(device=args.device).manual_seed(args.seed)  # the same chains for every set
        return torch.cat([classifier.features(images[i:i + batch].to(args.device), generator=g).float().cpu()
                          for i in range(0, len(images), batch)])

    reference = features(data.train_x)  # pixels only: latents were refused above
    return {"model_kind": cfg.model.kind, "frechet_distance": frechet_distance(features(samples), reference),
            "metric": "Frechet distance in the features of the project's own classifier (NOT FID)",
            "features": str(path), "floor": frechet_distance(features(data.test_x[:n]), reference),
            "samples": n, "reference_images": len(data.train_x), "num_iterations": steps,
            "steps_per_block": model.steps_per_block(steps), "cfg_scale": cfg_scale, "data": source,
            "reference": "the training images; floor: the held-out images against them"}


def parse_labels(text: str | None, num_classes: int, n: int | None) -> list[int]:
    """--labels "3,3,7" (class ids), or by default n samples cycling through the classes."""
    if text is None:
        count = n or 4 * max(num_classes, 4)
        return [i % num_classes if num_classes else 0 for i in range(count)]
    try:
        labels = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"--labels must be comma-separated class ids, got '{text}'") from None
    if not labels:
        raise UserError("--labels is empty")
    if not num_classes:
        raise UserError("this dit is unconditional (model.num_classes 0): drop --labels, use --num-samples")
    bad = [v for v in labels if not 0 <= v < num_classes]
    if bad:
        raise UserError(f"--labels has class id {bad[0]}, outside 0 .. {num_classes - 1}")
    return labels


def generate(model, cfg, manifest: dict, args: ModuleRequest) -> int:
    """`looped_lm generate` of a module checkpoint."""
    if not isinstance(model, (ImageGenerator, TextDiffusion)):
        raise UserError(f"looped_lm generate continues prompts (language models) and samples dit / mdm; a "
                        f"{cfg.model.kind} checkpoint does neither (looped_lm eval reports its accuracy)")
    if args.prompt is not None:
        raise UserError(f"--prompt is for language models; a {cfg.model.kind} checkpoint samples from noise "
                        f"({'--labels, --num-samples' if isinstance(model, ImageGenerator) else '--num-samples, --length'})")
    if args.num_samples is not None and args.num_samples < 1:
        raise UserError(f"--num-samples must be >= 1 (got {args.num_samples})")
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    d = cfg.diffusion  # the defaults the model was built with
    if isinstance(model, ImageGenerator):
        out = Path(args.out) if args.out else None
        if out is None or out.suffix.lower() != ".png":
            raise UserError("dit writes a PNG grid of samples: pass --out FILE.png")
        if out.exists() and not out.is_file():
            raise UserError(f"--out {out} exists and is not a file")
        vae = scale = None
        if cfg.data.source == "latents":
            if not args.vae:
                raise UserError("this dit was trained on VAE latents: pass --vae DIR (the AutoencoderKL that encoded "
                                "them) to decode its samples into pixels")

            vae = load_vae(args.vae, args.device)
            data, _ = module_data(cfg, manifest, None)
            scale = float(data.meta.get("scaling_factor", 0.18215))
        labels = torch.tensor(parse_labels(args.labels, model.num_classes, args.num_samples), device=args.device)
        steps = model.resolve_steps(args.num_iterations)
        cfg_scale = d.cfg_scale if args.cfg_scale is None else args.cfg_scale
        images = model.sample(labels, steps, cfg_scale, generator=gen)
        if vae is not None:
            images = decode_latents(vae, images, scale)

        nrow = min(len(labels), model.num_classes or 8, 10) if args.labels is None else min(len(labels), 10)
        write_png_grid(images, out, nrow=nrow, scale=max(1, 32 // images.shape[-1]))
        print(f"wrote {len(labels)} samples to {out} ({steps} steps, per block {model.steps_per_block(steps)}, "
              f"cfg scale {cfg_scale})", file=sys.stderr)
        return 0

    if args.cfg_scale is not None or args.labels is not None or args.out is not None:
        raise UserError("--cfg-scale, --labels and --out are for dit; mdm prints its samples")
    length = model.seq_len if args.length is None else args.length
    steps = model.resolve_steps(args.num_iterations, length)
    ids = model.sample(args.num_samples or 4, length, steps, generator=gen, device=args.device)
    for row in ids:
        print(decode(row))
    print(f"{len(ids)} samples of {length} characters, {steps} unmasking steps (per block "
          f"{model.steps_per_block(steps)})", file=sys.stderr)
    return 0
