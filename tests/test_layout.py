"""The package's layout as the README promises it: every path and name in the one-hop table exists, the package
root holds only what serves every room, and no module imports a module that imports it back."""

import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trl_ext"


def _one_hop_table() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("| question | one hop |")
    return readme[start : readme.index("\n\n", start)]


def test_every_path_and_name_in_the_readmes_one_hop_table_exists():
    table = _one_hop_table()
    paths = re.findall(r"`((?:trl_ext|recipes|benchmarks|tests|notebooks)/[\w/.]*)(?:::([\w.]+))?", table)
    assert len(paths) > 30
    for path, name in paths:
        assert (ROOT / path).exists(), path
        if name:
            source = (ROOT / path).read_text()
            head = name.split(".")[0]
            assert re.search(rf"^\s*(def|class) {head}\b|^{head} = ", source, re.M), f"{path}::{name}"
    # the names the table gives after a file, e.g. `scorer.py::RewardScorer`, resolve inside its folder
    for folder, file, name in re.findall(r"`(trl_ext/[\w/]+/)`:.*?`(\w+\.py)::(\w+)`", table):
        assert re.search(rf"^(class|def) {name}\b", (ROOT / folder / file).read_text(), re.M), (folder, file, name)


def test_the_package_root_holds_only_what_every_room_shares():
    """Everything else lives in a folder named for its role (trainer, models, rewards, monitoring, tools, data,
    scripts, core)."""
    root_modules = {p.name for p in PACKAGE.glob("*.py")}
    assert root_modules == {"__init__.py", "config.py", "config_grpo.py", "compat.py", "_trl.py", "ppo_base.py",
                            "testing.py", "embedded.py"}
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == {"core", "trainer", "models", "rewards", "monitoring", "tools", "data", "scripts"}


def _module_imports() -> dict[str, set[str]]:
    """{module: modules of trl_ext it imports at module level (not inside functions)}."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        package = module.split(".") if is_package else module.split(".")[:-1]
        edges = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                edges.add(target)
                edges.update(f"{target}.{a.name}" for a in node.names)
        graph[module] = edges
    return {m: {e for e in edges if e in graph} for m, edges in graph.items()}


def test_no_module_imports_one_that_imports_it_back():
    graph = _module_imports()
    assert "trl_ext.trainer.backend" in graph["trl_ext.trainer.update"]  # the graph sees relative imports
    state: dict[str, int] = {}

    def visit(module, path):
        state[module] = 1
        for target in graph[module]:
            if target == module or (module.startswith(target + ".") and target in graph):
                continue  # a package's own __init__ runs first anyway
            assert state.get(target) != 1, " -> ".join(path + [target])
            if target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_tools_monitoring_and_seeds_load_without_trl():
    code = ("import sys, trl_ext.tools.cli, trl_ext.tools.memory, trl_ext.monitoring.report, trl_ext.trainer.seeds, "
            "trl_ext.monitoring.phases; assert 'trl' not in sys.modules, sorted(m for m in sys.modules if "
            "m.startswith('trl'))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# The package's layers, lowest first: a module imports only from its own layer or those below it (anywhere in the
# module, imports inside functions too). Pure math and the types the phases pass each other at the bottom; the
# trainer that orchestrates them near the top; the entry points that build trainers above it.
LAYERS = [{"core"}, {"models", "data", "compat", "embedded"}, {"rewards", "monitoring"}, {"tools", "ppo_base"},
          {"_trl"}, {"config_grpo"}, {"config"}, {"trainer"}, {"scripts", "testing", "__init__"}]


def _every_import() -> set[tuple[str, str]]:
    """{(module, trl_ext module it imports)}: every import statement of the package, relative or absolute."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = module.split(".") if parts[-1] == "__init__" else module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                found.add((module, ".".join(package[: len(package) - node.level + 1] + [node.module or ""])))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trl_ext"):
                found.add((module, node.module))
            elif isinstance(node, ast.Import):
                found.update((module, a.name) for a in node.names if a.name.startswith("trl_ext"))
    return found


def test_no_import_points_up_the_layers():
    def layer(module: str) -> int:
        room = module.split(".")[1] if "." in module.strip(".") else "__init__"
        return next(i for i, rooms in enumerate(LAYERS) if room in rooms)

    imports = _every_import()
    assert ("trl_ext.trainer.update", "trl_ext.core.types") in imports  # the walk sees relative imports
    upward = sorted(f"{a} -> {b}" for a, b in imports if layer(b.rstrip(".")) > layer(a))
    assert not upward, upward


def test_the_trainer_keeps_the_trl_facing_api_and_the_iteration():
    """Set-up lives in builders.py, saving and resuming in checkpoint.py, each phase in its own file."""
    lines = len((PACKAGE / "trainer" / "ppo_trainer.py").read_text().splitlines())
    assert lines <= 600, f"trainer/ppo_trainer.py has {lines} lines: move what is not the TRL API or the iteration"


# Each optional feature: how code asks for it, and its own room (where branching on it is the point).
FEATURES = {
    "shared base": (r"\bshared\b", {"trainer/backend.py", "models/shared_base.py"}),
    "padding-free": (r"padding_free|packing is (not )?None", {"models/packing.py"}),
    "async rollouts": (r"async_rollouts|async_engine", {"trainer/async_rollouts.py"}),
    "multi-turn": (r"multi_turn", {"trainer/multi_turn.py"}),
    "vLLM": (r"use_vllm|vllm_mode|\.vllm\b", {"trainer/generators.py", "models/vllm_sampler.py",
                                             "models/vllm_server.py"}),
    "engine": (r"\.deepspeed\b|\.fsdp\b|params_sharded", {"trainer/backend.py"}),
}
# where features are chosen once: the config's checks, the builders, and any __init__ or _setup* method
CHOSEN_ONCE = {"config.py", "trainer/builders.py"}


@functools.cache
def _conditions() -> list[tuple[str, int, str]]:
    """(file, line, condition) of every if/elif/while and conditional expression on the training path (the planner in
    tools/ and the recipes' scripts/ model every layout by design), outside set-up."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name in CHOSEN_ONCE or name.split("/")[0] in ("tools", "scripts"):
            continue
        tree = ast.parse(path.read_text())
        setup = [(f.lineno, f.end_lineno) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                 and (f.name == "__init__" or f.name.startswith("_setup"))]
        found += [(name, node.lineno, ast.unparse(node.test)) for node in ast.walk(tree)
                  if isinstance(node, (ast.If, ast.While, ast.IfExp))
                  and not any(a <= node.lineno <= b for a, b in setup)]
    return found


def _branches(pattern: str) -> dict[str, list[int]]:
    """{file: lines} where a condition on the training path asks for `pattern`, outside set-up."""
    found = {}
    for name, line, test in _conditions():
        if re.search(pattern, test):
            found.setdefault(name, []).append(line)
    return found


def test_each_optional_feature_is_branched_on_in_at_most_two_files_outside_its_room():
    assert "trainer/rollout.py" in _branches(FEATURES["multi-turn"][0])  # the scan sees a real branch
    for feature, (pattern, room) in FEATURES.items():
        outside = {f: lines for f, lines in _branches(pattern).items() if f not in room}
        assert len(outside) <= 2, f"{feature} is branched on in {len(outside)} files outside {room}: {outside}"
