"""Typed config: defaults, YAML round trips, --set overrides, and one named error per bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from looped_lm import cli
from looped_lm.config import Config, config_from_dict, describe_fields, load_config
from looped_lm.errors import UserError
from looped_lm.kinds.builtin import BUILTIN

REPO = Path(__file__).resolve().parents[1]

# A valid value for every field, each different from its default: a YAML round trip of this dict
# proves every field is read back, typed, and kept.
NON_DEFAULT = {
    "model": {
        "kind": "db_ar", "n_layers": 6, "d_model": 96, "n_heads": 3, "seq_len": 64, "vocab_size": 300,
        "ffn_hidden": 200, "rope_theta": 500000.0, "norm_eps": 1.0e-6, "init_std": 0.01, "n_prelude": 2,
        "n_coda": 2, "loss_chunk": 64, "max_iterations": 32, "init_from": "hf_dir", "activation_checkpointing": True,
        "max_positions": 128, "head_dim": 64, "qkv_bias": True, "qk_norm": True, "tie_embeddings": False,
        "attn_scalar": 48.0, "sandwich_norm": True, "mlp_activation": "gelu_tanh", "embed_scale": True,
        "layer_types": ["sliding_attention"] * 9 + ["full_attention"], "sliding_window": 16, "rope_local_theta": 1.0e4,
    },
    "diffusion": {
        "num_blocks": 3, "layers_per_block": [3, 2, 1], "partition": "uniform", "overlap": 0.25, "p_mean": -0.5, "p_std": 1.5,
        "sigma_min": 0.01, "sigma_max": 40.0, "sigma_data": 1.0, "loss_weight": "edm",
        "target_scale": "sigma_data", "target_fraction": 0.5, "blocks_to_train": [0, 2],
        "block_sampling": "round_robin", "bridge": "soft", "num_iterations": 6,
        "curve_every": 50, "curve_until": 500, "noisy_input": "noise", "posterior_input": "topk",
        "posterior_topk": 16, "head": "cosine", "stack_order": "low_noise_first",
        "clean_lm_weight": 0.3, "denoise_weight": 0.5, "top_share": 0.25, "sample_top_quantile": 0.99, "parameterization": "edm", "last_call": "edge", "extra_calls": "spread",
        "noisy_self": True,
    },
    "data": {"source": "files", "path": "corpus.txt", "tokenizer": "byte", "val_fraction": 0.1, "test_fraction": 0.05, "split_seed": 3,
             "cache_dir": "cache", "augment": False},
    "train": {
        "max_steps": 50, "batch_size": 3, "grad_accum": 4, "lr": 0.003, "min_lr": 0.0003, "warmup_steps": 7,
        "weight_decay": 0.05, "beta1": 0.8, "beta2": 0.99, "grad_clip": 0.5, "seed": 7, "out_dir": "runs/x",
        "save_every": 10, "keep_last": 3, "eval_every": 5, "eval_batches": 2, "log_every": 2,
        "resume": "never", "resume_changes": "allow", "progress": False, "skip_nonfinite": 3, "compile": "on", "peak_tflops": 312.0,
        "lora_rank": 4, "lora_alpha": 8.0, "lora_dropout": 0.1, "lora_targets": ["qkv"], "lora_ada": "lora",
    },
    "deepspeed": {"zero_stage": 2, "bf16": True},
    "eval": {"block_size": 32},
}


# Fields whose non-default value cannot go with the table's others, each with its own round trip below
# (train.mode block_parallel needs deepspeed.zero_stage 0).
APART = {"train": {"mode": ("block_parallel", {"deepspeed": {"zero_stage": 0}})},
         # context stacked trains no independent block jobs; activation checkpointing is gpt's
         "diffusion": {"context": ("stacked", {"diffusion": {"blocks_to_train": [], "context": "stacked"}}),
                       "block_weights": ([3.0, 1.0, 1.0], {"diffusion": {"block_sampling": "fixed",
                                                                      "block_weights": [3.0, 1.0, 1.0]}})}}
# Fields of the other kinds' model sections (the table's is db_ar's), each round-tripped on its own kind
# below with the other sections it needs.
MODULE = {"model": {"kind": "vit"}, "diffusion": {"num_blocks": 2, "block_sampling": "uniform"},
          "data": {"source": "digits"}}
DIT = {**MODULE, "model": {"kind": "dit"}}
MDM = {"model": {"kind": "mdm"}, "diffusion": {"num_blocks": 2}}
ALONE = {"model": {
    "init_core_start": (3, {"model": {"kind": "looped_db"}, "diffusion": {"num_blocks": 1}}),
    "mean_recurrence": (16, {"model": {"kind": "huginn"}}),
    "backprop_depth": (20, {"model": {"kind": "huginn", "allow_full_backprop": True}}),
    "allow_full_backprop": (True, {"model": {"kind": "huginn"}}),
    "num_iterations": (5, {"model": {"kind": "huginn"}}),
    "end_to_end": (True, MODULE), "image_size": (16, MODULE), "channels": (1, MODULE), "patch": (2, MODULE),
    "num_classes": (5, MODULE), "label_table": ("learned", MODULE),
}, "diffusion": {  # the module kinds' own diffusion fields (the table's section is db_ar's)
    "label_dropout": (0.2, DIT), "cfg_scale": (1.5, DIT), "sample_steps": (10, DIT), "schedule": ("cosine", MDM),
}}


def write(tmp_path: Path, raw, name="run.yaml") -> str:
    path = tmp_path / name
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw, sort_keys=False))
    return str(path)


def test_defaults_load_and_validate():
    cfg = load_config(None)
    assert cfg == Config()
    assert (cfg.model.kind, cfg.model.d_model, cfg.model.n_layers, cfg.model.seq_len) == ("gpt", 128, 4, 256)
    assert (cfg.train.lr, cfg.train.max_steps, cfg.train.resume) == (1e-3, 1000, "auto")
    assert (cfg.deepspeed.zero_stage, cfg.data.source, cfg.diffusion.model_dump()) == (0, "bible", {})  # gpt: none
    # list defaults are not shared between instances
    a, b = (config_from_dict({"model": {"kind": "db_ar"}}) for _ in range(2))
    a.diffusion.blocks_to_train.append(1)
    assert b.diffusion.blocks_to_train == []


def test_calls_beyond_b_run_in_block_0_for_the_language_models_and_spread_for_the_image_ones():
    """diffusion.extra_calls' default is each kind's: measured for the language models (docs/method.md §5)."""
    images = {"data": {"source": "digits"}}
    defaults = {kind: config_from_dict({"model": {"kind": kind}, **extra}).diffusion.extra_calls
                for kind, extra in (("db_ar", {}), ("looped_db", {"diffusion": {"num_blocks": 1}}), ("vit", images),
                                    ("dit", images))}
    assert defaults == {"db_ar": "block0", "looped_db": "block0", "vit": "spread", "dit": "spread"}


def test_non_default_table_covers_every_field():
    cfg = Config()
    for section, values in NON_DEFAULT.items():
        names = set(type(getattr(cfg, section)).model_fields) if section not in ("model", "diffusion") else \
            {name for kind in BUILTIN for name in getattr(kind, "section" if section == "model" else section).model_fields}
        assert set(values) | set(APART.get(section, {})) | set(ALONE.get(section, {})) == names, \
            f"NON_DEFAULT.{section} must list every field"
        defaults = getattr(cfg if section not in ("model", "diffusion") else config_from_dict({"model": {"kind": "db_ar"}}),
                           section)
        for key, value in values.items():
            assert key == "kind" or getattr(defaults, key) != value, f"{section}.{key} equals its default"
    assert set(NON_DEFAULT) == set(Config.model_fields)


def test_yaml_round_trip_of_every_field(tmp_path):
    cfg = load_config(write(tmp_path, NON_DEFAULT))
    assert {s: {k: v for k, v in values.items() if k not in APART.get(s, {}) and k not in ALONE.get(s, {})}
            for s, values in cfg.to_dict().items()} == NON_DEFAULT
    assert isinstance(cfg.model.rope_theta, float) and isinstance(cfg.model.n_layers, int)
    # dump what was loaded, load again: the same config (this is also what a checkpoint manifest does)
    again = load_config(write(tmp_path, cfg.to_dict(), "again.yaml"))
    assert again == cfg
    assert config_from_dict(cfg.to_dict()) == cfg
    # and the defaults survive the same trip
    assert load_config(write(tmp_path, Config().to_dict(), "defaults.yaml")) == Config()


def test_round_trip_of_the_fields_kept_apart(tmp_path):
    for section, fields in APART.items():
        for key, (value, needs) in fields.items():
            raw = {**NON_DEFAULT, section: {**NON_DEFAULT[section], key: value}}
            raw.update({s: {**NON_DEFAULT[s], **v} for s, v in needs.items()})
            cfg = load_config(write(tmp_path, raw))
            default = getattr(config_from_dict({"model": {"kind": "db_ar"}}), section)
            assert getattr(getattr(cfg, section), key) == value != getattr(default, key)
            assert config_from_dict(cfg.to_dict()) == cfg


def test_round_trip_of_the_fields_of_one_kind(tmp_path):
    for section, fields in ALONE.items():
        for key, (value, needs) in fields.items():
            raw = {**needs, section: {**needs.get(section, {}), key: value}}
            cfg = load_config(write(tmp_path, raw))
            default = type(getattr(cfg, section))().model_dump()[key]
            assert getattr(getattr(cfg, section), key) == value != default
            assert config_from_dict(cfg.to_dict()) == cfg


def test_a_field_of_another_kind_is_refused_naming_its_owner(tmp_path):
    with pytest.raises(UserError, match="model.max_iterations is a field of model.kind db_ar / looped_db / huginn, "
                                        "not of gpt"):
        load_config(write(tmp_path, {"model": {"kind": "gpt", "max_iterations": 8}}))
    with pytest.raises(UserError, match="model.image_size is a field of model.kind vit / dit, not of gpt"):
        load_config(None, ["model.image_size=16"])
    # at its default, too, in a user's YAML: a key that does nothing is not silently accepted
    with pytest.raises(UserError, match="model.mean_recurrence is a field of model.kind huginn, not of db_ar"):
        load_config(write(tmp_path, {"model": {"kind": "db_ar", "mean_recurrence": 32}}))
    with pytest.raises(UserError, match="unknown config key 'model.n_layer' for model.kind gpt .did you mean 'n_layers'"):
        load_config(None, ["model.n_layer=3"])


def test_a_config_of_the_flat_era_loads():
    """Manifests written before kinds owned their sections hold every kind's model fields at their
    defaults: they load (as checkpoints must), and a field set away from its default is still refused."""
    flat = {"kind": "db_ar", "n_layers": 4, "mean_recurrence": 32, "backprop_depth": 8, "allow_full_backprop": False,
            "activation_checkpointing": False, "end_to_end": False, "image_size": 32, "channels": 3, "patch": 4,
            "num_classes": 10, "init_core_start": -1, "n_prelude": 0, "max_iterations": 64}
    cfg = config_from_dict({"model": flat, "diffusion": {"num_blocks": 2}})
    assert cfg.model.kind == "db_ar" and "mean_recurrence" not in cfg.to_dict()["model"]
    with pytest.raises(UserError, match="model.mean_recurrence is a field of model.kind huginn"):
        config_from_dict({"model": {**flat, "mean_recurrence": 8}, "diffusion": {"num_blocks": 2}})
    with pytest.raises(UserError, match="model.mean_recurrence is a field of model.kind huginn"):
        config_from_dict({"model": flat, "diffusion": {"num_blocks": 2}}, flat_era=False)


# what a manifest of the one-diffusion-section era holds for a gpt run: every kind's diffusion fields and
# eval fields that were never read
SHARED_ERA = {"model": {"kind": "gpt", "n_layers": 2}, "eval": {"block_size": 0, "stride": 0, "max_tokens": 0, "draws": 4},
              "diffusion": {"num_blocks": 4, "bridge": "sample", "cfg_scale": 2.0, "schedule": "linear", "context":
                            "independent", "num_iterations": 0}}


def test_a_manifest_with_the_shared_diffusion_section_loads():
    cfg = config_from_dict(SHARED_ERA)
    assert cfg.to_dict()["diffusion"] == {} and cfg.to_dict()["eval"] == {"block_size": 0}
    db = config_from_dict({**SHARED_ERA, "model": {"kind": "db_ar", "n_layers": 4}})
    assert db.diffusion.num_blocks == 4 and "cfg_scale" not in db.to_dict()["diffusion"]
    with pytest.raises(UserError, match="diffusion.num_blocks is a field of model.kind .*, not of gpt"):
        config_from_dict(SHARED_ERA, flat_era=False)  # a user's YAML is not a manifest
    with pytest.raises(UserError, match="eval.stride was removed: it was never read; pass `looped_lm eval --stride`"):
        config_from_dict({"eval": {"stride": 4}}, flat_era=False)


def test_empty_file_and_empty_section_mean_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == Config()
    assert load_config(write(tmp_path, "model:\ntrain:\n", "sections.yaml")) == Config()


def test_set_override_types(tmp_path):
    path = write(tmp_path, {"train": {"lr": 0.1, "max_steps": 3}})
    cfg = load_config(path, ["train.max_steps=7", "train.lr=0.25", "train.progress=false", "model.kind=db_ar",
                             "diffusion.blocks_to_train=[0, 2]", "train.out_dir=runs/a b", "train.min_lr=0"])
    assert cfg.train.max_steps == 7 and type(cfg.train.max_steps) is int
    assert cfg.train.lr == 0.25 and type(cfg.train.lr) is float
    assert cfg.train.progress is False
    assert cfg.diffusion.blocks_to_train == [0, 2]
    assert cfg.train.out_dir == "runs/a b"
    assert cfg.train.min_lr == 0.0 and type(cfg.train.min_lr) is float  # an int where a float is expected
    # later --set wins over earlier ones and over the file
    assert load_config(path, ["train.max_steps=4", "train.max_steps=9"]).train.max_steps == 9
    assert load_config(path).train.max_steps == 3


def test_exponent_floats_are_numbers(tmp_path):
    """`lr: 3e-4` is how everyone writes a learning rate. PyYAML (YAML 1.1) reads a float without a dot
    as a *string*, so the config rejects it with 'train.lr must be a number, got '3e-4''."""
    assert load_config(None, ["train.lr=1e-3"]).train.lr == pytest.approx(1e-3)
    assert load_config(write(tmp_path, "train:\n  lr: 3e-4\n  min_lr: 1E-5\n")).train.lr == pytest.approx(3e-4)


# ------------------------------------------------------------------------------------------------
# bad input: one UserError naming the key, and through the CLI exit 2, one line, nothing built

BAD = {
    "unknown key": ({"train": {"lrr": 0.1}}, ["train.lrr", "did you mean 'lr'"]),
    "unknown section": ({"trian": {"lr": 0.1}}, ["'trian'", "did you mean 'train'"]),
    "string for int": ({"train": {"max_steps": "ten"}}, ["train.max_steps", "integer", "'ten'"]),
    "bool for int": ({"train": {"batch_size": True}}, ["train.batch_size", "integer", "True"]),
    "float for int": ({"model": {"d_model": 32.5}}, ["model.d_model", "integer"]),
    "string for float": ({"train": {"lr": "fast"}}, ["train.lr", "number"]),
    "string for bool": ({"train": {"progress": "yes please"}}, ["train.progress", "true or false"]),
    "not a list": ({"model": {"kind": "db_ar"}, "diffusion": {"blocks_to_train": 1}},
                   ["diffusion.blocks_to_train", "list"]),
    "bad choice": ({"model": {"kind": "gpt3"}}, ["model.kind", "gpt", "db_ar"]),
    "negative lr": ({"train": {"lr": -0.001}}, ["train.lr", "> 0"]),
    "blocks do not divide layers": ({"model": {"kind": "db_ar", "n_layers": 4}, "diffusion": {"num_blocks": 3}},
                                    ["diffusion.num_blocks", "model.n_layers"]),
    "overlap above 0.5": ({"model": {"kind": "db_ar"}, "diffusion": {"overlap": 0.6}}, ["diffusion.overlap", "[0, 0.5]"]),
    "overlap below 0": ({"model": {"kind": "db_ar"}, "diffusion": {"overlap": -0.1}}, ["diffusion.overlap", "[0, 0.5]"]),
    "sigma_min above sigma_max": ({"model": {"kind": "db_ar"}, "diffusion": {"sigma_min": 90.0, "sigma_max": 80.0}},
                                  ["diffusion.sigma_min", "diffusion.sigma_max"]),
    "sigma_min equals sigma_max": ({"model": {"kind": "db_ar"}, "diffusion": {"sigma_min": 5.0, "sigma_max": 5.0}},
                                   ["diffusion.sigma_min", "below"]),
    "blocks_to_train out of range": ({"model": {"kind": "db_ar"}, "diffusion": {"blocks_to_train": [0, 4]}},
                                     ["diffusion.blocks_to_train", "4", "0..3"]),
    "blocks_to_train negative": ({"model": {"kind": "db_ar"}, "diffusion": {"blocks_to_train": [-1]}},
                                 ["diffusion.blocks_to_train", "-1"]),
    "blocks_to_train duplicated": ({"model": {"kind": "db_ar"}, "diffusion": {"blocks_to_train": [1, 1]}},
                                   ["diffusion.blocks_to_train", "duplicates"]),
    "zero stage 3": ({"deepspeed": {"zero_stage": 3}}, ["deepspeed.zero_stage", "0, 1 or 2"]),
    "layer split of another sum": ({"model": {"kind": "db_ar", "n_layers": 4}, "diffusion": {"layers_per_block": [3, 2]}},
                                   ["diffusion.layers_per_block", "[3, 2]", "sums to 5", "model.n_layers is 4"]),
    "layers per block not dividing": ({"model": {"kind": "db_ar", "n_layers": 4}, "diffusion": {"layers_per_block": 3}},
                                      ["diffusion.layers_per_block", "divide", "model.n_layers"]),
    "layer split against num_blocks": ({"model": {"kind": "db_ar", "n_layers": 4},
                                        "diffusion": {"num_blocks": 4, "layers_per_block": [3, 1]}},
                                       ["diffusion.num_blocks (4)", "[3, 1]", "2 blocks"]),
    "empty block in the split": ({"model": {"kind": "db_ar", "n_layers": 4}, "diffusion": {"layers_per_block": [4, 0]}},
                                 ["diffusion.layers_per_block", ">= 1"]),
    "layer split not a list": ({"model": {"kind": "db_ar"}, "diffusion": {"layers_per_block": "3,1"}},
                               ["diffusion.layers_per_block", "integer or a list of integers"]),
    "layer split on gpt": ({"diffusion": {"layers_per_block": 2}}, ["diffusion.layers_per_block", "db_ar", "not of gpt"]),
    "fixed without weights": ({"model": {"kind": "db_ar"}, "diffusion": {"num_blocks": 2, "block_sampling": "fixed"}},
                              ["diffusion.block_sampling fixed needs diffusion.block_weights: 2 weights"]),
    "weights of the wrong count": ({"model": {"kind": "db_ar"}, "diffusion": {"num_blocks": 2, "block_sampling": "fixed",
                                                                            "block_weights": [1, 1, 1]}},
                                   ["2 weights > 0", "got [1.0, 1.0, 1.0]"]),
    "weights without fixed": ({"model": {"kind": "db_ar"}, "diffusion": {"num_blocks": 2, "block_weights": [2, 1]}},
                              ["diffusion.block_weights applies to block_sampling fixed"]),
    "block parallel on gpt": ({"train": {"mode": "block_parallel"}}, ["train.mode block_parallel", "model.kind gpt does not offer block_parallel"]),
    "block parallel with ZeRO": ({"model": {"kind": "db_ar"}, "diffusion": {"block_sampling": "uniform"},
                                 "train": {"mode": "block_parallel"}, "deepspeed": {"zero_stage": 1}},
                                ["train.mode block_parallel", "deepspeed.zero_stage 0", "got 1"]),
    "unknown mode": ({"train": {"mode": "pipeline"}}, ["train.mode", "data_parallel", "block_parallel"]),
    "heads do not divide width": ({"model": {"d_model": 30, "n_heads": 4}}, ["model.d_model", "model.n_heads"]),
    "files without a path": ({"data": {"source": "files"}}, ["data.path"]),
    "section not a mapping": ({"train": 5}, ["'train'", "mapping"]),
    "non-finite float": ({"train": {"lr": float("inf")}}, ["train.lr", "finite"]),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_values_name_the_key(tmp_path, case):
    raw, needles = BAD[case]
    with pytest.raises(UserError) as err:
        load_config(write(tmp_path, raw))
    for needle in needles:
        assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(UserError, match="config file not found: .*nope.yaml"):
        load_config(str(tmp_path / "nope.yaml"))


def test_yaml_syntax_error_reports_the_line(tmp_path):
    path = write(tmp_path, "model:\n  d_model: 32\n  n_heads: 2\ntrain:\n  lr: 0.1\n    max_steps: 3\n")
    with pytest.raises(UserError) as err:
        load_config(path)
    assert "not valid YAML" in str(err.value) and "line 6" in str(err.value)


def test_top_level_must_be_a_mapping(tmp_path):
    with pytest.raises(UserError, match="must hold a mapping of sections, got list"):
        load_config(write(tmp_path, "- a\n- b\n"))


@pytest.mark.parametrize("item, needle", [
    ("train.lr", "--set expects section.key=value"),
    ("lr=0.1", "--set key must look like section.key"),
    ("train.opt.lr=0.1", "--set key must look like section.key"),
    ("train.bogus=1", "unknown config key 'train.bogus'"),
    ("train.max_steps=abc", "train.max_steps must be an integer"),
])
def test_bad_set_overrides(item, needle):
    with pytest.raises(UserError) as err:
        load_config(None, [item])
    assert needle in str(err.value)


def _cli_cases():
    yield from ((name, raw, needles) for name, (raw, needles) in sorted(BAD.items()))
    yield "yaml syntax", "train:\n  lr: 0.1\n    max_steps: 3\n", ["not valid YAML", "line 3"]


@pytest.mark.parametrize("name, raw, needles", list(_cli_cases()), ids=[c[0] for c in _cli_cases()])
def test_cli_train_rejects_bad_config_before_building_anything(tmp_path, capsys, one_line_error, name, raw, needles):
    out_dir, cache = tmp_path / "out", tmp_path / "cache"
    if isinstance(raw, dict):  # point out_dir and cache_dir into tmp_path (unless the case breaks a section)
        for section, key, value in (("train", "out_dir", out_dir), ("data", "cache_dir", cache)):
            if isinstance(raw.get(section, {}), dict):
                raw = {**raw, section: {**raw.get(section, {}), key: str(value)}}
    path = write(tmp_path, raw)
    assert cli.main(["train", "--config", path]) == 2
    captured = capsys.readouterr()
    one_line_error(captured, *needles)
    assert captured.err.strip().count("\n") == 0 and captured.out == ""
    assert not out_dir.exists() and not cache.exists()


def test_cli_train_missing_config_and_bad_set(tmp_path, capsys, one_line_error):
    assert cli.main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2
    one_line_error(capsys.readouterr(), "config file not found", "missing.yaml")
    assert cli.main(["train", "--set", "train.lr"]) == 2
    one_line_error(capsys.readouterr(), "--set expects section.key=value", "'train.lr'")
    assert cli.main(["train"]) == 2
    one_line_error(capsys.readouterr(), "--config")
    assert list(tmp_path.iterdir()) == []


def test_every_shipped_config_loads():
    paths = sorted((REPO / "configs").glob("*.yaml")) + sorted((REPO / "configs").glob("*.yml"))
    assert paths, "configs/ holds no YAML recipe"
    for path in paths:
        cfg = load_config(str(path))
        assert isinstance(cfg, Config), path


def test_help_config_lists_every_field():
    text = describe_fields()
    for section in NON_DEFAULT:
        assert f"{section}:" in text
        for key in NON_DEFAULT[section]:
            assert f"  {key} (" in text, f"{section}.{key} missing from --help-config"


@pytest.mark.parametrize("text, needle", [
    ("train:\n  lr: 0.1\n  max_steps: 3\n  lr: 0.2\n", "key 'train.lr' appears twice (lines 2 and 4)"),
    ("train:\n  lr: 0.1\nmodel:\n  d_model: 32\ntrain:\n  max_steps: 3\n", "key 'train' appears twice (lines 1 and 5)"),
])
def test_duplicate_yaml_keys_are_refused(tmp_path, capsys, one_line_error, text, needle):
    """YAML would silently keep the last value; a run config names the key and both lines instead."""
    path = write(tmp_path, text)
    with pytest.raises(UserError) as err:
        load_config(path)
    assert needle in str(err.value) and path in str(err.value)
    assert cli.main(["train", "--config", path]) == 2
    one_line_error(capsys.readouterr(), needle)
