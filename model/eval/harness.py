"""Standard benchmarks through lm-evaluation-harness (its Python API) on a stage's exported Hugging Face model,
run by the evaluation step of each stage in `eval.harness_stages`.

The demo's held-out items are a local task, `gptforge_demo`: a task YAML over a JSONL of the items (the prompt
in the model's chat template, greedy answers of `eval.max_new_tokens` tokens at most, cut at the model's stop
tokens, whitespace-trimmed, exact match to the known answer: the evaluation step's own exact match). Both files
are written into the evaluation output's `harness/`, so that the task runs offline and a reader can rerun it:

    lm_eval --model hf --model_args pretrained=<stage>/model --include_path <eval output>/harness \\
        --tasks gptforge_demo --apply_chat_template

A hub task (hellaswag, arc_easy, ...) reads its dataset through `datasets`: offline, from the Hugging Face cache.
The user's own task YAMLs are found in the folders of `eval.harness_include`.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

import yaml

from gptforge.core.errors import UserError

DEMO_TASK = "gptforge_demo"


def task_manager(include: list[str], defaults: bool = True):
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=[str(Path(p).resolve()) for p in include] or None, include_defaults=defaults)


def check_tasks(eval_cfg):
    """A UserError for each task name the harness does not know, naming the closest ones it does. Returns the task
    manager it indexed the tasks with (for `run_harness`: the index takes seconds), or None if only the demo task
    is named."""
    wanted = [t for t in eval_cfg.harness_tasks if t != DEMO_TASK]
    for folder in eval_cfg.harness_include:
        if not Path(folder).is_dir():
            raise UserError(f"eval.harness_include: {folder} is not a folder")
    if not wanted:
        return None
    manager = task_manager(eval_cfg.harness_include)
    known = set(manager.all_tasks) | {DEMO_TASK}
    for task in wanted:
        if task not in known:
            closest = difflib.get_close_matches(task, known, n=5, cutoff=0.6)
            raise UserError(f"eval.harness_tasks: lm-evaluation-harness has no task {task!r}"
                            + (f"; closest: {', '.join(closest)}" if closest else ""))
    return manager


def write_demo_task(items: list[dict], stop_strings: list[str], max_new_tokens: int, folder: Path) -> Path:
    """The demo's held-out items as a local harness task (gptforge_demo.yaml over gptforge_demo.jsonl)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{DEMO_TASK}.jsonl"
    with open(data, "w") as f:
        for it in items:
            if len(it["prompt"]) != 1 or it["prompt"][0]["role"] != "user":
                raise ValueError("the demo task holds single-turn prompts")
            f.write(json.dumps({"question": it["prompt"][0]["content"], "answer": it["answer"]}) + "\n")
    task = {
        "task": DEMO_TASK,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data.resolve())}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": "{{question}}",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": stop_strings, "do_sample": False, "max_gen_toks": max_new_tokens},
        "filter_list": [{"name": "strip", "filter": [{"function": "remove_whitespace"}, {"function": "take_first"}]}],
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1},
    }
    (folder / f"{DEMO_TASK}.yaml").write_text(yaml.safe_dump(task, sort_keys=False))
    return folder


def scores(results: dict) -> dict[str, float]:
    """The harness's results as flat metric names: harness/<task>/<metric>, the filter appended where a task names
    one (harness/gptforge_demo/exact_match/strip); standard errors and sample counts left out."""
    out = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if metric.endswith("_stderr") or metric == "sample_len" or not isinstance(value, (int, float)) or \
                    isinstance(value, bool):
                continue
            out["/".join(["harness", task, metric] + ([filt] if filt and filt != "none" else []))] = float(value)
    return out


def run_harness(model_dir: Path, eval_cfg, device: str, dtype: str, folder: Path, seed: int,
                demo_items: list[dict] | None = None, stop_strings: list[str] | None = None,
                manager=None) -> dict[str, float]:
    """Run eval.harness_tasks on the model in `model_dir` (its chat template applied, as the stages prompt it);
    write the harness's results to folder/results.json and each example to folder/samples/<task>.jsonl; return
    the scores (`scores`). `manager`: the task manager `check_tasks` returned, if any (else one is indexed)."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    tasks = list(eval_cfg.harness_tasks)
    if DEMO_TASK in tasks:
        if demo_items is None:
            raise UserError(f"eval.harness_tasks: {DEMO_TASK} is the demo's held-out items, and this run's "
                            "evaluation data is not the demo")
        demo = write_demo_task(demo_items, stop_strings or [], eval_cfg.max_new_tokens, folder)
        tasks[tasks.index(DEMO_TASK)] = str((demo / f"{DEMO_TASK}.yaml").resolve())  # loaded by path: no index
    if manager is None:
        manager = task_manager(eval_cfg.harness_include, defaults=any(t != DEMO_TASK for t in tasks))
    lm = HFLM(pretrained=str(model_dir), device=device, dtype=dtype, batch_size=eval_cfg.batch_size)
    # The harness bounds generation by max_length (its max_gen_toks); the export's max_new_tokens would override it
    lm.model.generation_config.max_new_tokens = None
    results = simple_evaluate(
        model=lm, tasks=tasks, num_fewshot=eval_cfg.harness_num_fewshot, limit=eval_cfg.harness_limit,
        apply_chat_template=True, task_manager=manager, log_samples=True, random_seed=seed, numpy_random_seed=seed,
        torch_random_seed=seed, fewshot_random_seed=seed, bootstrap_iters=0)
    (folder / "samples").mkdir(parents=True, exist_ok=True)
    for task, samples in results.get("samples", {}).items():  # each example's prompt, response and score
        with open(folder / "samples" / f"{task}.jsonl", "w") as f:
            for sample in samples:
                f.write(json.dumps(sample, default=str) + "\n")
    (folder / "results.json").write_text(json.dumps({k: results[k] for k in ("results", "versions", "n-shot",
                                                                              "config") if k in results},
                                                    indent=2, default=str))
    return scores(results)


def task_documents(eval_cfg) -> dict[str, list[str]]:
    """{harness:<task>: the text of each of its evaluation documents (the prompt and its target)} for
    eval.harness_tasks but the demo task (its items are the demo's held-out ones), read as the harness reads them:
    a hub task's dataset from the local cache, a user's task from eval.harness_include. For the curate stage's
    decontamination."""
    from lm_eval.tasks import get_task_dict

    names = [t for t in eval_cfg.harness_tasks if t != DEMO_TASK]
    if not names:
        return {}
    out = {}
    for name, task in _leaves(get_task_dict(names, task_manager(eval_cfg.harness_include))):
        texts = []
        for doc in task.eval_docs:
            target = task.doc_to_target(doc)
            if isinstance(target, int) and task.config.doc_to_choice is not None:
                target = task.doc_to_choice(doc)[target]
            texts.append(f"{task.doc_to_text(doc)} {target}")
        out[f"harness:{name}"] = texts
    return out


def _leaves(tasks: dict):
    """(name, task) of every task in a harness task dict, groups opened."""
    for key, value in tasks.items():
        if isinstance(value, dict):
            yield from _leaves(value)
        else:
            yield getattr(key, "group_name", key), value
