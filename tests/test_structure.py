"""Project structure rules: who imports what, and docs that must not drift from code."""

import ast
from pathlib import Path

from looped_lm.config import describe_fields

ROOT = Path(__file__).resolve().parents[1]

# Layers, bottom to top: a module may import its own layer or lower ones, never a higher one, and the
# import graph (function-level imports included) has no circle. Prefixes are matched longest first.
LAYERS = [
    ("looped_lm.errors", "looped_lm.console", "looped_lm.cost", "looped_lm.devices", "looped_lm.compile",
     "looped_lm.yaml_file"),
    ("looped_lm.fields",),
    ("looped_lm.kinds",),  # the kind plugins: their builders and data functions are named, not imported
    ("looped_lm.config", "looped_lm.source_fields", "looped_lm.sampling", "looped_lm.mfu"),
    ("looped_lm.settings",),
    ("looped_lm.diffusion",),
    ("looped_lm.models", "looped_lm.data", "looped_lm.lora"),
    ("looped_lm.checkpoint", "looped_lm.manifest", "looped_lm.tensor_files", "looped_lm.engine", "looped_lm.optim", "looped_lm.training", "looped_lm.parallel",
     "looped_lm.pretrained", "looped_lm.source_families"),
    ("looped_lm.eval", "looped_lm.export", "looped_lm.hf", "looped_lm.train", "looped_lm.trainer", "looped_lm.preflight",
     "looped_lm.launch", "looped_lm.dryrun", "looped_lm.merge", "looped_lm.supporting", "looped_lm.generate", "looped_lm.verify"),
    ("looped_lm.serve", "serve"),
    ("looped_lm.cli", "looped_lm.__main__"),  # entry points route to everything
]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "serve":  # installed as looped_lm.serve
        parts = ["looped_lm", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def internal_imports(path: Path, name: str) -> set[str]:
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found |= {f"{mod}.{a.name}" for a in node.names}
    found = {("looped_lm." + m if m == "serve" or m.startswith("serve.") else m) for m in found}
    return {m for m in found if m.startswith("looped_lm")}


def layer_of(name: str) -> int:
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix or name.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (rank, len(prefix))
    assert best is not None, f"{name} belongs to no layer: add it to LAYERS"
    return best[0]


def import_graph() -> dict[str, set[str]]:
    files = [p for p in sorted(ROOT.glob("looped_lm/**/*.py")) + sorted(ROOT.glob("serve/**/*.py"))
             if p.name != "__init__.py" or p.parent.name != "looped_lm"]  # the package root only installs a hook
    modules = {module_name(p): p for p in files}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in internal_imports(path, name):
            while imported and imported not in modules:  # `from a.b import c` names a.b.c or a.b's member c
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def test_imports_only_point_down():
    graph = import_graph()
    assert len(graph) > 40
    upward = [f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a)]
    assert not upward, "imports that point up: " + "; ".join(sorted(upward))


def test_no_import_circles():
    graph = import_graph()
    state, stack, circles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in graph:
        if node not in state:
            visit(node)
    assert not circles, "import circles: " + "; ".join(circles)


def test_models_never_probe_capabilities_by_attribute_name():
    """Callers ask `isinstance(model, Capability)` (models/contract.py), not hasattr/getattr on a model."""
    offenders = []
    for path in sorted(ROOT.glob("looped_lm/**/*.py")) + sorted(ROOT.glob("serve/**/*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if ("hasattr(model" in line or "getattr(model" in line or "hasattr(self.model" in line
                    or "getattr(self.model" in line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}")
    assert not offenders, offenders


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_only_the_trainer_imports_deepspeed_and_nothing_imports_a_server():
    files = sorted((ROOT / "looped_lm").rglob("*.py"))
    assert len(files) > 10
    for path in files:
        mods = imported_modules(path)
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith("looped_lm/trainer/") and rel != "looped_lm/optim.py":  # optim: ZeRO's state through safe_*
            assert "deepspeed" not in mods, f"{rel} imports deepspeed: only the trainer and its optimiser may"
        assert not mods & {"fastapi", "uvicorn", "vllm"}, f"{rel} imports a serving library"


# DeepSpeed internals that have a public replacement: the ZeRO optimiser's partition bookkeeping (read
# through deepspeed.utils.safe_get/set_full_optimizer_state and safe_get/set_full_fp32_param instead)
DEEPSPEED_INTERNALS = {"single_partition_of_fp32_groups", "bit16_groups", "real_dp_process_group",
                       "parallel_partitioned_bit16_groups", "fp32_groups_flat_partition", "bf16_groups",
                       "fp16_groups", "fp32_partitioned_groups_flat", "groups_padding"}


def deepspeed_private_attributes() -> set[str]:
    """DEEPSPEED_INTERNALS and every `_name` attribute DeepSpeed's engine, ZeRO optimisers and
    parameter linkage set (on themselves or on parameters: `_hp_mapping`, `_dp_group`...)."""
    import importlib.util

    root = Path(importlib.util.find_spec("deepspeed").origin).parent
    names = set(DEEPSPEED_INTERNALS)
    for rel in ("runtime/engine.py", "runtime/zero/stage_1_and_2.py", "runtime/zero/stage3.py",
                "runtime/bf16_optimizer.py", "utils/mixed_precision_linkage.py", "utils/tensor_fragment.py"):
        if not (root / rel).is_file():  # another DeepSpeed layout: the caller checks enough names were found
            continue
        for node in ast.walk(ast.parse((root / rel).read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                names.add(node.attr)
    return names


def private_deepspeed_uses(sources: dict[str, str]) -> list[str]:
    """`path:line .name` for each read of a DeepSpeed private attribute that the project does not itself
    define (a name both use, e.g. `_config`, is the project's own)."""
    trees = {path: ast.parse(src) for path, src in sources.items()}
    own = {node.attr for tree in trees.values() for node in ast.walk(tree)
           if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)}
    private = deepspeed_private_attributes() - own
    return [f"{path}:{node.lineno} .{node.attr}" for path, tree in trees.items() for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in private]


def test_no_private_deepspeed_attribute_is_used():
    sources = {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted((ROOT / "looped_lm").rglob("*.py"))}
    assert "looped_lm/optim.py" in sources and len(deepspeed_private_attributes()) > 20
    assert not private_deepspeed_uses(sources), private_deepspeed_uses(sources)
    # the check sees the resharding this package once did through ZeRO's partitions
    old = ("flat = zero.single_partition_of_fp32_groups[i]\n"
           "lp = p._hp_mapping.lp_fragment_address\n")
    assert len(private_deepspeed_uses({"old.py": old})) == 2


def test_model_code_knows_nothing_of_files_or_training_infrastructure():
    for path in sorted((ROOT / "looped_lm" / "models").glob("*.py")):
        mods = imported_modules(path)
        assert not mods & {"deepspeed", "safetensors", "tqdm", "json", "yaml"}, path.name


def test_config_reference_matches_the_code():
    text = (ROOT / "configs" / "README.md").read_text()
    assert describe_fields(builtin_only=True) in text, "configs/README.md is stale: paste `looped_lm train --help-config`"


def kind_name_branches(path: Path) -> list[str]:
    """Comparisons (==, !=, in) and dict keys that name a built-in model kind, as a string constant."""
    from looped_lm.kinds.builtin import BUILTIN

    names = {k.name for k in BUILTIN}

    def named(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(e) for e in node.elts)
        return False

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and (named(node.left) or any(named(c) for c in node.comparators)):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
        elif isinstance(node, ast.Dict) and any(k is not None and named(k) for k in node.keys):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_kind_name_is_branched_on_outside_its_plugin():
    """Callers ask the kind's plugin (looped_lm/kinds: capabilities, layout, data) instead of comparing
    `model.kind` with a name; a kind's own model module is its plugin's implementation."""
    own_modules = {"looped_lm/kinds", "looped_lm/models/gpt.py", "looped_lm/models/huginn.py", "looped_lm/models/vit.py",
                   "looped_lm/models/dit.py", "looped_lm/models/mdm.py", "looped_lm/models/db"}
    offenders = []
    for path in sorted(ROOT.glob("looped_lm/**/*.py")) + sorted(ROOT.glob("serve/**/*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not any(rel == m or rel.startswith(m + "/") for m in own_modules):
            offenders += kind_name_branches(path)
    assert not offenders, "branches on a kind's name (ask its plugin instead): " + ", ".join(offenders)


def test_the_kind_branch_check_sees_a_branch(tmp_path, monkeypatch):
    """The check above is not vacuous: it finds each shape of branch in a file written here."""
    probe = ROOT / "looped_lm" / "_probe_kind_branch.py"
    try:
        probe.write_text('def f(cfg):\n    if cfg.model.kind == "db_ar":\n        pass\n'
                         '    x = cfg.model.kind in ("vit", "dit")\n    y = {"mdm": 1}\n')
        assert len(kind_name_branches(probe)) == 3
    finally:
        probe.unlink()


def test_the_trainer_imports_at_the_top():
    """looped_lm/trainer/ keeps its imports at the top of each file (a missing one is then a load-time error,
    not a NameError in a branch no CPU test takes); an import inside a function is allowed for an optional
    dependency only, said in a comment on its line."""
    for path in sorted((ROOT / "looped_lm" / "trainer").glob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)):
                        line = lines[inner.lineno - 1]
                        assert "# optional" in line, f"{path.name}:{inner.lineno}: {line.strip()}"
    sizes = {p.name: len(p.read_text().splitlines()) for p in (ROOT / "looped_lm" / "trainer").glob("*.py")}
    assert max(sizes.values()) <= 600, sizes


# The one module of looped_lm/models that reads the run config: it builds each network's frozen args
ARGS_MODULES = {"looped_lm/models/args.py"}


def run_config_reads(source: str) -> list[int]:
    """Lines that read the run config: an attribute of a name `cfg` (`cfg.model`) or an attribute `.cfg`
    (`self.cfg`, `net.cfg.diffusion`), read or written."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and (node.attr == "cfg" or isinstance(node.value, ast.Name)
                                                and node.value.id == "cfg"):
            lines.append(node.lineno)
    return sorted(set(lines))


def test_networks_take_their_args_never_the_run_config():
    """A network, the DB objective and the chain are built from frozen args (looped_lm/models/args.py, built
    once by the kind): outside the args module, looped_lm/models imports neither the config nor the kinds,
    and reads no `cfg.` / `.cfg`."""
    files = [p for p in sorted((ROOT / "looped_lm" / "models").rglob("*.py"))
             if p.relative_to(ROOT).as_posix() not in ARGS_MODULES]
    assert len(files) > 10
    offenders = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        for imported in internal_imports(path, module_name(path)):
            if any(imported == m or imported.startswith(m + ".") for m in ("looped_lm.config", "looped_lm.kinds")):
                offenders.append(f"{rel} imports {imported}")
        offenders += [f"{rel}:{n} reads the run config" for n in run_config_reads(path.read_text())]
    assert not offenders, offenders


def test_the_run_config_read_check_sees_a_read():
    """The check above is not vacuous: each shape of read in a snippet written here."""
    probe = ("def f(cfg, net):\n    a = cfg.model.d_model\n    b = net.cfg.diffusion\n    self.cfg = cfg\n"
             "    c = cfg_scale.x\n    return build(cfg)\n")
    assert run_config_reads(probe) == [2, 3, 4]


# ---------------------------------------------------------------------------------------------
# the shape of the house: file sizes, and why an import sits inside a function

MAX_LINES = 600
# the reasons an import may sit inside a function, one of which its comment names: an optional extra that
# is not always installed, a measured start-up cost (torch, deepspeed, transformers: seconds before
# `looped_lm --help` or a verb's --help answers), or an import circle it breaks
IMPORT_REASONS = ("optional", "start-up", "circle")


def long_files(sources: dict[str, str]) -> list[str]:
    return [f"{path}: {n} lines" for path, text in sources.items() if (n := len(text.splitlines())) > MAX_LINES]


def unexplained_imports(path: str, source: str) -> list[str]:
    """`path:line` of each import inside a function whose reason is not said: a comment naming one of
    IMPORT_REASONS on its own line(s) or on the run of import, comment and blank lines just above it."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for inner in ast.walk(node):
            if not isinstance(inner, (ast.Import, ast.ImportFrom)):
                continue
            said = lines[inner.lineno - 1:inner.end_lineno]
            i = inner.lineno - 2
            while i >= 0 and (not lines[i].strip() or lines[i].strip().startswith(("#", "import ", "from "))):
                said.append(lines[i])
                i -= 1
            if not any("#" in line and any(r in line.split("#", 1)[1] for r in IMPORT_REASONS) for line in said):
                found.append(f"{path}:{inner.lineno}")
    return sorted(set(found))


def package_sources() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text()
            for p in sorted(ROOT.glob("looped_lm/**/*.py")) + sorted(ROOT.glob("serve/**/*.py"))}


def test_no_file_is_over_600_lines():
    sources = {path: text for path, text in package_sources().items()
               if path.startswith("looped_lm/")}
    assert not long_files(sources), "split these along a seam: " + ", ".join(long_files(sources))
    assert long_files({"big.py": "x = 1\n" * (MAX_LINES + 1)}) == ["big.py: 601 lines"]  # the check can fail


def test_every_import_inside_a_function_says_why():
    """Imports sit at the top of their file; one inside a function says which reason keeps it there."""
    offenders = [hit for path, text in package_sources().items() for hit in unexplained_imports(path, text)]
    assert not offenders, "move these to the top of their file, or say why not (optional, start-up, circle): " \
        + ", ".join(offenders)
    probe = ('"""doc"""\n\n\ndef f():\n    """doc"""\n    import json\n\n    return json\n\n\n'
             'def g():\n    import torch  # torch: seconds at start-up\n    from x import y\n\n    return y\n\n\n'
             'def h():\n    x = 1  # start-up\n    import numpy\n    return numpy, x\n')
    assert unexplained_imports("probe.py", probe) == ["probe.py:20", "probe.py:6"]  # each rule can fail
