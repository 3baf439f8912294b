"""All of gptforge's use of TRL's private API is in model/trainers (the hooks into TRL's trainers), and each private
method it overrides or calls is named here with the parameters TRL 1.16 gives it: a TRL upgrade that renames,
removes or changes one fails this test before a stage fails in a run."""

import ast
import inspect
from pathlib import Path

import transformers
import trl

ROOT = Path(__file__).resolve().parents[2]
ROOMS = ("gptforge", "data", "model", "pipeline", "stages")
CLASSES = {"GRPOTrainer": trl.GRPOTrainer, "RLOOTrainer": trl.RLOOTrainer, "DPOTrainer": trl.DPOTrainer}
LOGPS = ["self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
         "compute_aux_loss", "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
         "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids"]
# (TRL's class, its private method): the parameters gptforge's overrides and calls are written against
HOOKS = {
    **{(c, "_calculate_rewards"): ["self", "inputs", "prompts", "completions", "completion_ids_list"]
       for c in ("GRPOTrainer", "RLOOTrainer")},
    **{(c, "_compute_loss"): ["self", "model", "inputs"] for c in ("GRPOTrainer", "RLOOTrainer")},
    **{(c, "_generate"): ["self", "prompts"] for c in ("GRPOTrainer", "RLOOTrainer")},
    **{(c, "_generate_and_score_completions"): ["self", "inputs"] for c in ("GRPOTrainer", "RLOOTrainer")},
    **{(c, "_get_per_token_logps_and_entropies"): LOGPS for c in ("GRPOTrainer", "RLOOTrainer")},
    **{(c, "_tokenize_prompts"): ["self", "prompts"] for c in ("GRPOTrainer", "RLOOTrainer")},
    **{(c, "_prepare_inputs"): ["self", "generation_batch"] for c in ("GRPOTrainer", "RLOOTrainer")},
    **{(c, "_get_train_sampler"): ["self", "dataset"] for c in ("GRPOTrainer", "RLOOTrainer")},
    ("RLOOTrainer", "_generate_single_turn"): ["self", "prompt_ids", "images", "multimodal_fields"],
    ("DPOTrainer", "_prepare_inputs"): ["self", "inputs"],  # (transformers' Trainer's, which DPO keeps)
    ("DPOTrainer", "_get_train_sampler"): ["self", "train_dataset"],
}


def test_each_private_method_gptforge_hooks_is_trls_with_the_same_parameters():
    changed = {}
    for (cls, name), params in HOOKS.items():
        method = getattr(CLASSES[cls], name, None)
        got = None if method is None else list(inspect.signature(method).parameters)
        if got != params:
            changed[f"{cls}.{name}"] = got
    assert not changed, f"TRL {trl.__version__} changed what model/trainers overrides or calls: {changed}"


def private_uses(paths: list[Path]) -> dict[str, set[str]]:
    """{method: the files that define it in a class, or call it on super(), self or a trainer}, for each private
    method of TRL's trainers (and transformers' Trainer under them)."""
    private = {n for c in (*CLASSES.values(), transformers.Trainer) for n in dir(c)
               if n.startswith("_") and not n.startswith("__")}
    uses: dict[str, set[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.FunctionDef) and node.name in private:
                name = node.name
            elif isinstance(node, ast.Attribute) and node.attr in private:
                on = node.value
                if (isinstance(on, ast.Call) and isinstance(on.func, ast.Name) and on.func.id == "super") or \
                        (isinstance(on, ast.Name) and on.id in ("self", "trainer")):
                    name = node.attr
            if name:
                uses.setdefault(name, set()).add(str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else
                                                 path.name)
    return uses


def test_every_private_method_gptforge_uses_is_named_here_and_used_in_model_trainers_alone():
    paths = sorted(p for room in ROOMS for p in (ROOT / room).rglob("*.py")
                   if not any(q.is_symlink() for q in (p, *p.parents)))
    uses = private_uses(paths)
    assert uses.keys() == {name for _, name in HOOKS}, uses  # every one listed above, and none listed in vain
    outside = {n: f for n, files in uses.items() for f in files if not f.startswith("model/trainers/")}
    assert not outside, outside


def test_the_walk_sees_an_override_and_a_call(tmp_path):
    module = tmp_path / "probe.py"
    module.write_text("class T:\n    def _generate(self, prompts):\n        return super()._compute_loss(1, 2)\n")
    assert private_uses([module]) == {"_generate": {"probe.py"}, "_compute_loss": {"probe.py"}}
