"""bench/ holds experiments: every script still imports and answers --help (one that imports a removed
module or name fails here), every file the bench READMEs and the docs cite exists, a bench script a doc names
exists or the doc names the commit that holds it, and the cost model's table (bench/cost_model.py) states its
ratios."""

import importlib.util
import json
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "bench").glob("*.py"))
DOCS = ["bench/README.md", "bench/README_looped.md", "bench/README_serve.md", "docs/export.md", "docs/method.md",
        "docs/pretrained.md", "docs/results.md"]


def test_bench_has_its_scripts():
    assert len(SCRIPTS) >= 10 and (ROOT / "bench" / "common.py") in SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_every_bench_script_answers_help(path, monkeypatch, capsys):
    """A script's --help exits 0 (its imports resolve); a shared module (no __main__ block) imports."""
    script = 'if __name__ == "__main__"' in path.read_text()
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put bench/ on it
    if not script:
        runpy.run_path(str(path), run_name="bench_module")
        return
    with pytest.raises(SystemExit) as stop:
        runpy.run_path(str(path), run_name="__main__")
    assert stop.value.code in (0, None), capsys.readouterr().err[-2000:]
    assert "usage:" in capsys.readouterr().out


# a cited file: a backticked path with a directory (`bench/results/x.json`) or a bare script or module
# name (`decode.py`), or a markdown link's target. Files a command writes elsewhere (an export folder's
# `config.json`) and URL paths (`/v1/...`) have no directory of the repository and are not citations.
CITED = re.compile(r"`([\w.*{},-]+(?:/[\w.*{},-]+)*\.(?:py|json|md|png|sh|ya?ml|toml|jsonl|txt))`|\]\(([^)\s#]+)\)")


def cited_paths(text: str) -> list[str]:
    out = []
    for m in CITED.finditer(text):
        path = m.group(1) or m.group(2)
        if path.startswith(("http:", "https:", "mailto:")):
            continue
        if m.group(1) and "/" not in path and not path.endswith(".py"):
            continue
        out.append(path)
    return out


def expand(path: str) -> list[str]:
    """`looped_quality.{json,png}` -> both names."""
    m = re.search(r"\{([^}]*)\}", path)
    return [p for alt in m.group(1).split(",") for p in expand(path[:m.start()] + alt + path[m.end():])] if m else [path]


def exists(path: str, doc: Path, tracked: set[str]) -> bool:
    bases = [ROOT, doc.parent, ROOT / "bench"]
    if any(list(base.glob(path)) if "*" in path else (base / path).exists() for base in bases):
        return True
    # a bare module name (`engine.py`, of looped_lm/engine/): some tracked file has it
    return "/" not in path and path.endswith(".py") and any(Path(t).match(path) for t in tracked)


def test_the_path_check_sees_a_missing_file():
    tracked = {"bench/decode.py", "looped_lm/models/db/model.py"}
    doc = ROOT / "bench" / "README.md"
    paths = [p for c in cited_paths("`decode.py` and `dblm.py`, `bench/results/nothing_here.json`, "
                                       "[x](README_serve.md), `config.json`, `results/{decode,serve}.json`")
             for p in expand(c)]
    assert paths == ["decode.py", "dblm.py", "bench/results/nothing_here.json", "README_serve.md",
                     "results/decode.json", "results/serve.json"]
    assert [p for p in paths if not exists(p, doc, tracked)] == ["dblm.py", "bench/results/nothing_here.json"]


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_file_exists(doc):
    tracked = set(subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split())
    path = ROOT / doc
    missing = [f"{doc}:{n}: {p}" for n, line in enumerate(path.read_text().splitlines(), 1)
               for c in cited_paths(line) for p in expand(c) if not exists(p, path, tracked)]
    assert not missing, "cited files that do not exist:\n" + "\n".join(missing)


def test_a_bench_script_a_doc_names_exists_or_its_commit_is_named():
    """A script removed from bench/ stays reproducible through the commit that holds it: wherever README.md,
    docs/ or a bench README or study report names bench/<script>, the script exists, or a commit hash stands
    within two lines of the name."""
    docs = [ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("bench/**/*.md")]
    missing = []
    for doc in docs:
        lines = doc.read_text().splitlines()
        for n, line in enumerate(lines):
            for m in re.finditer(r"\bbench/(\w+\.(?:py|sh))\b", line):
                near = " ".join(lines[max(0, n - 2):n + 3])
                if not (ROOT / "bench" / m[1]).exists() and not re.search(r"\b[0-9a-f]{7,40}\b", near):
                    missing.append(f"{doc.relative_to(ROOT)}:{n + 1}: {m[0]}")
    assert not missing, "bench scripts named without a file or a commit:\n" + "\n".join(missing)


def test_the_cost_table_states_its_ratios(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_cost_model", ROOT / "bench" / "cost_model.py")
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    out = tmp_path / "cost.json"
    assert table.main(["table", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    shipped = [r for r in data["train"] if r["layout"].startswith("shipped") and r["shape"].startswith("d256")]
    assert {(r["target_fraction"], r["loss_chunk"]) for r in shipped} == {(1.0, 0), (1.0, 128), (0.25, 0), (0.25, 128)}
    # B one-block steps cost more than one gpt step, and the layers alone cost less than twice as much
    assert all(r["ratio"] > 1 and r["layers_ratio"] < 2.2 for r in shipped)
    assert {r["batch"] for r in data["decode"]} == {1, 8}


def test_the_copying_task_oracle_matches_monte_carlo():
    """bench/depth_synthetic.py's Bayes-optimal copy NLL (ln(25 - L) at the first repeat, 0 elsewhere) against
    a plain Monte-Carlo of the real generator: the empirical chance that a segment ends after L distinct
    symbols, given it has not ended before, on fresh sequences; and its parts of a copy NLL add up."""
    import math

    import torch

    spec = importlib.util.spec_from_file_location("bench_depth_synthetic", ROOT / "bench" / "depth_synthetic.py")
    ds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ds)
    L = ds.lengths(20000, 99)
    for length in (8, 12, 20, 24):
        at_least = (L >= length).sum().item()
        hazard = (L == length).sum().item() / at_least
        assert abs(math.log(1 / hazard) - math.log(ds.SEG[1] - length)) < 4 / math.sqrt(at_least * hazard) + 0.02
    at_least, exactly = (L[None] >= L[:, None]).sum(1).double(), (L[None] == L[:, None]).sum(1).double()
    mc = float(torch.log(at_least / exactly).sum()) / float(ds.copy_mask(20000, 99).sum())
    assert abs(mc - ds.oracle_copy_nll(20000, 99)) < 0.002  # the empirical hazard's cost per copy token
    nll = torch.rand(64, ds.T)
    parts = ds.copy_parts(nll, 64, 5)
    mask = ds.copy_mask(64, 5)
    assert abs(parts["copy_nll_first_repeat_part"] + parts["copy_nll_later_part"] - float(nll[mask].mean())) < 1e-6
    assert int(ds.first_repeat(64, 5).sum()) == 64 and not (ds.first_repeat(64, 5) & ~mask).any()


def _depth_synthetic():
    spec = importlib.util.spec_from_file_location("bench_depth_synthetic", ROOT / "bench" / "depth_synthetic.py")
    ds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ds)
    return ds


def test_the_copying_bench_charges_each_huginn_step_its_own_recurrence():
    """Equal FLOPs for huginn: a step costs what its drawn recurrence r costs (more r, more FLOPs), the same
    r the training step draws, not step 0's cost for every step."""
    import torch

    from looped_lm.models import build_model
    from looped_lm.models.huginn import sample_recurrence

    ds = _depth_synthetic()
    model = build_model(ds.config("huginn"), ds.V)
    seq = ds.sequences(2, 0)
    cost_at, by_r = ds.huginn_costs(model, seq[:, :-1], seq[:, 1:], seed=3)
    rs = [sample_recurrence(8, torch.Generator().manual_seed(3 * 1_000_003 + step)) for step in range(40)]
    costs = [cost_at(step) for step in range(40)]
    assert len(set(rs)) >= 3 and sorted(by_r) == sorted(set(rs))
    assert all(costs[i] == by_r[r] for i, r in enumerate(rs))
    ordered = [by_r[r] for r in sorted(by_r)]
    assert all(a < b for a, b in zip(ordered, ordered[1:]))


def test_the_copying_bench_picks_a_looped_models_k_on_dev_not_test(monkeypatch):
    """looped rows are reported at the K their dev copy NLL picks; test must not choose it."""
    import torch

    ds = _depth_synthetic()

    def fake(model, ks, split_seed, smoke):  # dev prefers K = 2, test would prefer K = 4
        best = 2 if split_seed == ds.DEV_SEED else 4
        return {k: torch.full((64, ds.T), 0.5 if k == best else 1.0) for k in ks}

    monkeypatch.setattr(ds, "score_looped", fake)
    out = ds.looped_scores(None, "huginn", smoke=True)
    assert out["dev"]["K"] == out["test"]["K"] == 2
    assert out["test"]["copy_nll"] == 1.0 and out["test"]["copy_nll_at_K4"] == 0.5


def test_the_median_ratio_interval_covers_the_median_as_often_as_it_claims():
    """plan.md item 13's sign-test interval: with 10 pairs it is [2nd, 9th] of the sorted ratios (97.9 %), it
    covers the true median of a skewed law that often in simulation, and one wild pair cannot move it past
    the next order statistic (the t-interval on logs, by contrast, widens without bound)."""
    import numpy as np

    ds = _depth_synthetic()
    ones = {s: {"v": 1.0} for s in range(10)}
    pairs = {s: {"v": float(v)} for s, v in enumerate([5, 1, 3, 9, 2, 8, 4, 7, 6, 10])}
    n, med, lo, hi, cover = ds.median_ratio(pairs, ones, lambda r: r["v"])
    assert (n, med, lo, hi) == (10, 5.5, 2.0, 9.0) and abs(cover - (1 - 2 * 11 / 1024)) < 1e-12
    assert np.isnan(ds.median_ratio({s: pairs[s] for s in range(5)}, ones, lambda r: r["v"])[3])  # 5 pairs: none
    wild = {**pairs, 3: {"v": 1e9}}
    assert ds.median_ratio(wild, ones, lambda r: r["v"])[2:4] == (2.0, 10.0)
    rng = np.random.default_rng(0)
    hits = 0
    for _ in range(4000):  # lognormal: median 1
        draws = {s: {"v": float(v)} for s, v in enumerate(rng.lognormal(0.0, 1.0, 10))}
        _, _, lo, hi, _ = ds.median_ratio(draws, ones, lambda r: r["v"])
        hits += lo <= 1.0 <= hi
    assert abs(hits / 4000 - cover) < 0.015


def test_the_copying_bench_picks_the_db_recipe_at_seed_0_not_by_a_mean_over_unequal_seeds():
    """The recipe is chosen as the plan says (dev at seed 0): a row with ten seeds, one of them bad, must not
    lose to a one-seed row that is worse at seed 0."""
    ds = _depth_synthetic()
    run = lambda v: {"dev": {"copy_nll": v}}  # noqa: E731
    by = {"many": {0.01: {0: run(0.085), **{s: run(0.085) for s in range(1, 9)}, 9: run(0.5)}},
          "one": {0.003: {0: run(0.086)}}}
    assert ds.best_recipe(by, {"many": 0.01, "one": 0.003}, ["many", "one"]) == "many"


def test_the_clean_lm_report_chooses_the_weight_on_dev_and_pairs_it_by_seed(tmp_path):
    """The weight is the lowest seed-0 DEV ppl@0 (a weight better on test must not win), ratios pair the same
    seed, and the plan's rule needs the ppl@0 interval's upper bound below 1 at equal steps AND against the
    equal-FLOPs control (weight 0 given more steps)."""
    spec = importlib.util.spec_from_file_location("bench_allocation", ROOT / "bench" / "allocation.py")
    al = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(al)

    def put(folder, seed, dev, test, chain, steps=1000):
        folder.mkdir(parents=True, exist_ok=True)
        run = {"seed": seed, "steps": steps, "dev": {"ppl0": dev}, "test": {"ppl0": test},
               "logged_block_share": [0.9, 0.1], "test_chain": {"ppl": chain, "se": 0.001, "tilt_gate": True}}
        (folder / f"{al.protocol_name(2, 'network_gain', 1e-3, seed)}.json").write_text(json.dumps(run))

    protocol = tmp_path / "protocol"
    for seed, base in enumerate([5.0, 5.2, 4.9]):
        put(protocol, seed, 5.0, base, base)
        put(tmp_path / "clean_lm_1.0", seed, 4.0, base * (0.9 + 0.01 * seed), base * 0.95)
        put(tmp_path / "eqflops_w0", seed, 4.8, base * 0.95, base * 0.97, steps=1288)
    put(tmp_path / "clean_lm_2.0", 0, 4.1, 1.0, 1.0)  # best on test, worse on dev
    put(tmp_path / "clean_lm_2.0", 1, 4.1, 1.0, 1.0)
    text = al.clean_lm_report(tmp_path, protocol)
    assert "| 1 (chosen) | 4.000 |" in text and "Chosen weight: 1." in text
    assert "s0 0.900, s1 0.910, s2 0.920" in text  # same steps
    assert "s0 0.947, s1 0.958, s2 0.968" in text  # against the control
    assert "**met: the weight becomes the DB quickstart default**" in text
    put(tmp_path / "eqflops_w0", 2, 4.8, 4.9 * 0.85, 4.9 * 0.97, steps=1288)  # the control wins on one seed
    assert "**not met" in al.clean_lm_report(tmp_path, protocol)
    put(tmp_path / "eqflops_w0", 2, 4.8, 4.9 * 0.95, 4.9 * 0.97, steps=1288)
    put(tmp_path / "clean_lm_1.0", 2, 4.0, 4.9 * 1.2, 4.9 * 0.95)  # one seed worse at equal steps
    assert "**not met" in al.clean_lm_report(tmp_path, protocol)
    import shutil

    shutil.rmtree(tmp_path / "eqflops_w0")  # without the control there is no verdict
    assert "Plan's rule" not in al.clean_lm_report(tmp_path, protocol)


def test_the_gpu_speed_check_runs_its_rows_at_a_toy_shape(tmp_path, one_thread):
    """bench/gpu_speed.py (the first step of gpu_check.sh) on CPU at a toy shape: every row reports tokens/s,
    the cost model's FLOP/s, an MFU against the measured CPU peak and its expectation."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_speed
    finally:
        sys.path.pop(0)
    out = tmp_path / "speed.json"
    assert gpu_speed.main(["--tiny", "--device", "cpu", "--no-compile", "--steps", "2", "--warmup", "2",
                           "--batch", "2", "--json", str(out), "--profile", "gpt"]) == 0
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["gpt", "db_ar B=2", "db_ar B=4"]
    ops = rows["gpt"]["profile"]  # where the step's time goes: matmuls must be among the top operators
    assert len(ops) == 15 and all(o["ms_per_step"] >= 0 for o in ops) and any("mm" in o["op"] for o in ops)
    assert "profile" not in rows["db_ar B=2"]
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and r["flops_per_s"] > 0 and 0 < r["mfu"] < 1 and r["expected_mfu"] > 0
        assert r["met"] == (r["mfu"] >= r["expected_mfu"])
    assert gpu_speed.main(["--tiny", "--device", "cpu", "--no-compile", "--steps", "2", "--warmup", "1", "--batch", "2",
                           "--json", str(out), "--rows", "looped_db", "--compile-vs-eager"]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["row"] == "looped_db" and row["tokens_per_s"] > 0 and row["compiled_vs_eager"] > 0
