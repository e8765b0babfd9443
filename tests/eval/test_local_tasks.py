"""The local lm-eval tasks (configs/lm_eval): each choice follows its context after exactly one
space, and the recall task's answer is the far context's sentence."""

import json
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TASKS = sorted(p.stem for p in (ROOT / "configs" / "lm_eval").glob("*.yaml"))


@pytest.mark.parametrize("name", TASKS)
def test_each_choice_follows_its_context_after_one_space(name, monkeypatch):
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(ROOT)  # the tasks' data paths are relative to the repository root
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from lm_eval.tasks import get_task_dict

        task = get_task_dict([name], TaskManager(include_path="configs/lm_eval", include_defaults=False))[name]
    doc = next(iter(task.test_docs()))
    ctx = task.doc_to_text(doc)
    conts = [r.args[1] for r in task.construct_requests(doc, ctx, metadata=(name, 0, 1))]
    assert len(conts) == len(doc["choices"]) >= 3
    assert all(c.startswith(" ") and not c.startswith("  ") and not ctx.endswith(" ") for c in conts)


def test_recall_items_need_the_far_context():
    from orthros.experiments.cpt_data import recall_items

    items = recall_items(20, gap_chars=4000, seed=1)
    assert items == recall_items(20, gap_chars=4000, seed=1)
    for it in items:
        ctx, choices = it["context"], it["choices"]
        head = ctx[ctx.rindex("\n\n") + 2 :]
        first = ctx.index(head)
        assert first < len(ctx) - len(head) - 4000  # its first occurrence is >= gap_chars back
        assert ctx[first:].startswith(head + choices[it["answer"]])  # ... followed there by the answer
        assert len(set(choices)) == 4 and all(not ctx[first:].startswith(head + c) for i, c in enumerate(choices)
                                              if i != it["answer"])
    lines = (ROOT / "configs" / "lm_eval" / "python_docs_recall.jsonl").read_text().splitlines()
    shipped = [json.loads(x) for x in lines]
    assert len(shipped) == 200 and shipped[0].keys() == {"context", "choices", "answer"}
