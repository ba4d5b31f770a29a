"""Models and prompt sets: the models a run can use and the prompts of each
dataset, as token ids for one model's tokenizer.

Sets:

* ``humaneval``: HumanEval prompts, raw (code to complete);
* ``mtbench``: MT-Bench first turns, in the model's chat template;
* ``template``: one fixed instruction asking for the same JSON object
  (:data:`TEMPLATE_FIELDS`, schema :func:`template_schema`) about many
  different inputs -- HumanEval prompts and MT-Bench questions taken in
  turn -- in the model's chat template: requests that share a long
  instruction and an answer format, where a memory shared across requests
  has something to remember.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATASETS = ("humaneval", "mtbench", "template")
DEFAULT_DATASETS = ("humaneval", "mtbench")
MODEL_NAMES = ("smollm2", "qwen-coder")  # vllm_lookahead.tools.MODELS
DEFAULT_MODEL = "qwen-coder"

#: The JSON fields the ``template`` set asks for, with the JSON schema of
#: each (``--structured`` constrains the output to exactly this object).
#: The string lengths bound a small model's runaway answers (a summary that
#: never ends) so that a constrained answer closes its object.
TEMPLATE_FIELDS: dict[str, dict[str, Any]] = {
    "topic": {"type": "string", "maxLength": 60},
    "kind": {"type": "string", "enum": ["code", "question"]},
    "language": {"type": "string", "maxLength": 30},
    "difficulty": {"type": "string", "enum": ["easy", "medium", "hard"]},
    "summary": {"type": "string", "maxLength": 200},
}

TEMPLATE_INSTRUCTION = (
    "You label inputs for a catalogue. Read the input below and describe it as "
    "one JSON object with exactly these fields, in this order:\n"
    '- "topic": what the input is about, in at most five words;\n'
    '- "kind": "code" if the input is source code to complete, '
    '"question" if it is a question or a task in prose;\n'
    '- "language": the programming language of the code (e.g. "Python"), or the '
    'natural language of the prose (e.g. "English");\n'
    '- "difficulty": "easy", "medium" or "hard";\n'
    '- "summary": one sentence saying what is asked.\n'
    "Answer with the JSON object only, no other text.\n\n"
    "Input:\n<<<\n{input}\n>>>"
)


def template_schema() -> dict[str, Any]:
    """The JSON schema of the ``template`` set's answer (every field
    required, no other)."""
    return {
        "type": "object",
        "properties": {k: dict(v) for k, v in TEMPLATE_FIELDS.items()},
        "required": list(TEMPLATE_FIELDS),
        "additionalProperties": False,
    }


def template_texts(n: int) -> list[str]:
    """The ``template`` set's first ``n`` user messages: the fixed
    instruction around HumanEval prompts and MT-Bench questions, one of each
    in turn (the other set alone once one runs out: 164 + 80 in all)."""
    from vllm_lookahead.tools import load_humaneval, load_mtbench

    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    # HumanEval's first n: enough to fill in past MT-Bench's 80 questions
    inputs = _interleave(load_humaneval(n), load_mtbench((n + 1) // 2), n)
    return [TEMPLATE_INSTRUCTION.format(input=text) for text in inputs]


def _interleave(a: list[str], b: list[str], n: int) -> list[str]:
    """a[0], b[0], a[1], b[1], ... then the rest of the longer list; n items."""
    out: list[str] = []
    ia = ib = 0
    while len(out) < n and (ia < len(a) or ib < len(b)):
        if ia < len(a) and (ia <= ib or ib >= len(b)):
            out.append(a[ia].strip("\n"))
            ia += 1
        else:
            out.append(b[ib].strip("\n"))
            ib += 1
    return out


def _prepare_model(name: str) -> Path:
    from vllm_lookahead.tools import MODELS

    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    return MODELS[name]()


#: The warm-up requests' user messages: outside every set, so that a method
#: that remembers across requests (suffix decoding's global tree,
#: lookahead's shared memory) learns nothing about a set before it is timed.
WARMUP_TEXTS = tuple(f"Warm-up request {k}: list the numbers from {k} to {k + 20}, "
                     "separated by commas." for k in range(1, 65))


def _warmup_prompts(count: int, tokenizer) -> list[list[int]]:
    from vllm_lookahead.tools import chat_prompts

    texts = [WARMUP_TEXTS[k % len(WARMUP_TEXTS)] for k in range(count)]
    try:
        texts = chat_prompts(tokenizer, texts)
    except Exception:  # no chat template: the plain text
        pass
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def _load_prompts(dataset: str, n: int, tokenizer) -> list[list[int]]:
    from vllm_lookahead.tools import chat_prompts, load_humaneval, load_mtbench

    if dataset == "humaneval":
        texts = load_humaneval(n)
    elif dataset == "mtbench":
        texts = chat_prompts(tokenizer, load_mtbench(n))
    elif dataset == "template":
        texts = chat_prompts(tokenizer, template_texts(n))
    else:
        raise ValueError(f"unknown dataset {dataset!r}")
    # Token ids, like the demo: no tokenizer-added BOS, the same ids for
    # every method.
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def template_schema_json() -> str:
    """:func:`template_schema` as compact JSON text (recorded in results)."""
    return json.dumps(template_schema(), separators=(",", ":"))
