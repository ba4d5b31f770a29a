"""How good are the drafts, with no clock: lookahead's lookups against
suffix decoding's, replayed on the same sampled text.

Timed rows at n = 16 move by +-5-10% from run to run on these shared VMs,
more than the drafts' quality differs. This script takes the clock out:

1. vanilla vLLM samples ``--n`` outputs of every prompt (temperature,
   top-p, engine seed as given; cached in ``--samples``, reused when the
   file exists);
2. the samples of each prompt are replayed in lockstep, one token a tick,
   as a batch of siblings decodes (a prompt's samples after the earlier
   prompts' have ended); before every tick each method drafts up to ``K``
   tokens for every sample from what it has seen so far. With
   ``--repeat`` the samples are requests of their own instead, asked one
   at a time in passes over the set (pass k: every prompt, answered by its
   k-th sample): a question asked again;
3. a draft scores the length of its prefix that matches the sample's
   actual next tokens. For a one-token-per-position draft (what every
   method here hands vLLM) this is distributed as the rejection sampler's
   accepted length: a draft token ``x`` is accepted with probability
   ``p(x)``, the probability that the sample drew ``x``.

Methods:

* ``lookahead``: :func:`vllm_lookahead.algo.drafting.lookup`, the unchecked
  lookup the planner drafts from (the request's own text: prompt lookup of
  2-4 tokens and the n-gram pool; the engine's shared memory: keys of 12, 6,
  3 and 2 tokens in other requests' text, newest place first), its own
  n-grams added as ``StepDrafter`` adds them; ``K`` = N = 4;
* ``lookahead-own``: the same without the shared memory;
* ``lookahead:16``, ``lookahead:24``: with ``lookup_len`` 16 or 24
  (unchecked drafts up to 16 or 24 tokens, as far as their match is
  long, the request's own text matched up to 24 tokens). Replayed
  positions overlap: every position of a long copied span drafts it
  again, so long drafts score higher here than a decoding run gains;
* ``suffix:K``: Arctic Inference's ``SuffixDecodingCache`` as vLLM's
  ``suffix`` method drives it (``start_request`` with the prompt,
  ``add_active_response`` every token, ``speculate`` on the last 24 tokens,
  vLLM's defaults: tree depth 24, spec factor 1.0, min token prob 0.1,
  10000 cached requests), at ``K`` = 4 (lookahead's longest draft) and 24
  (vLLM's default for ``suffix``). Skipped with a line where
  ``arctic_inference`` is not installed (``scripts/setup_suffix.sh``).

Per method: draft tokens per position, accepted tokens per position (the
tokens a step would gain if every position drafted), and their ratio.
With ``--steps`` the samples are *decoded* instead: every tick each live
sample drafts once and moves on by its accepted prefix plus one token (the
verifier's own), as a decoding run moves, so a long copied span is drafted
once, not at each of its positions; ``S`` is then tokens per step (every
method drafting at every step, whatever a draft costs).
What a draft costs is left out: that is the planner's side (and the timed
benchmarks'). With ``--by-kind``, lookahead's drafts (``lookahead``,
``lookahead:16``) by lookup kind as the planner learns them apart
(``acceptance.LOOKUP_KINDS``: source, key length, the places' agreement
on the first token): the share whose first token matched, accepted and
drafted tokens per draft.

    .venv/bin/python benchmarks/replay_drafts.py [--n 16] [--prompts 8] \\
        [--samples benchmarks/results/replay_samples.json] [--by-kind] [--steps]

Prints the table, writes ``benchmarks/results/replay_drafts.json`` and a
plot next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

#: Tokens of a sample's text the suffix tree is asked with (vLLM passes the
#: last ``suffix_decoding_max_tree_depth`` = 24).
SUFFIX_PATTERN = 24
#: The settings the cached samples were made with (made again on a change).
SAMPLING_KEYS = ("datasets", "prompts", "n", "temperature", "top_p", "max_tokens",
                 "engine_seed", "dtype", "structured")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", nargs="+", default=["humaneval", "mtbench"],
                   choices=["humaneval", "mtbench", "template"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=16, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--engine-seed", type=int, default=23)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--samples", default="benchmarks/results/replay_samples.json",
                   help="the sampled outputs (made by vanilla vLLM when missing)")
    p.add_argument("--structured", action="store_true",
                   help="sample the template set held to its JSON schema (vLLM structured "
                        "outputs), as bench.py's --structured")
    p.add_argument("--repeat", action="store_true",
                   help="replay each prompt's samples as requests asked one after another "
                        "(pass k: sample k of every prompt, one request at a time) instead "
                        "of a batch of siblings")
    p.add_argument("--by-kind", action="store_true",
                   help="also print lookahead's drafts by lookup kind (source, key length, "
                        "the places' agreement on the first token)")
    p.add_argument("--steps", action="store_true",
                   help="decode the samples instead of drafting at every position: a "
                        "sample moves on by the accepted draft plus one token a step, so "
                        "a long copied span is drafted once (step compression, S)")
    p.add_argument("--out", default="benchmarks/results/replay_drafts.json")
    return p.parse_args(argv)


# -- the samples --------------------------------------------------------------
def sample_outputs(args) -> dict:
    """``{dataset: [{"prompt": ids, "samples": [ids, ...]}, ...]}`` from
    vanilla vLLM (in this process)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.path.insert(0, str(Path(__file__).parent))
    from prompts import _load_prompts, _prepare_model, template_schema
    from tqdm import tqdm
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    path = str(_prepare_model("smollm2"))
    tok = AutoTokenizer.from_pretrained(path)
    llm = LLM(path, dtype=args.dtype, enforce_eager=True, max_model_len=2048,
              max_num_seqs=args.n, seed=args.engine_seed, kv_cache_memory_bytes=1 << 30)
    out = {}
    for ds in args.datasets:
        kwargs = {}
        if args.structured and ds == "template":  # as bench.py's --structured
            from vllm.sampling_params import StructuredOutputsParams

            kwargs["structured_outputs"] = StructuredOutputsParams(json=template_schema())
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                                max_tokens=args.max_tokens, **kwargs)
        out[ds] = []
        for p in tqdm(_load_prompts(ds, args.prompts, tok), desc=f"sampling {ds}"):
            got = llm.generate([TokensPrompt(prompt_token_ids=p)], params, use_tqdm=False)[0]
            out[ds].append({"prompt": list(p),
                            "samples": [list(c.token_ids) for c in got.outputs]})
    return out


# -- the drafters ---------------------------------------------------------------
class LookaheadDrafter:
    """Lookahead's unchecked lookup for every sample (its own
    :class:`~vllm_lookahead.algo.state.RequestState`), with or without the
    engine's shared memory."""

    def __init__(self, shared_memory: bool = True, lookup_len: int = 0) -> None:
        from vllm_lookahead.planner.acceptance import AcceptancePrior
        from vllm_lookahead.config import LookaheadConfig, RequestSettings
        from vllm_lookahead.algo.memory import SharedMemory

        self.settings = RequestSettings(lookup_len=lookup_len)
        self.k = max(self.settings.ngram_size, lookup_len)
        self.prior = AcceptancePrior(self.settings.guess_set_size)
        # as the proposer builds it, at the engine's default capacity
        self.memory = (SharedMemory(LookaheadConfig().memory_tokens,
                                    delay=self.settings.ngram_size) if shared_memory else None)
        self.states: dict[str, object] = {}

    def start(self, rid: str, prompt: list[int]) -> None:
        from vllm_lookahead.algo.drafting import new_state

        toks = np.asarray(prompt, dtype=np.int64)
        st = new_state(self.settings, toks, len(toks), len(toks), None, False, 0, self.prior)
        if self.memory is not None:
            st.memory_doc = self.memory.open(0, toks)
            st.memory_reads = True
        self.states[rid] = st

    def feed(self, rid: str, token: int) -> None:
        st = self.states[rid]
        if self.memory is not None:
            self.memory.extend(st.memory_doc, [token])

    def draft(self, rid: str, text: list[int]) -> list[int]:
        from vllm_lookahead.algo.drafting import lookup

        st = self.states[rid]
        toks = np.asarray(text, dtype=np.int64)
        st.add_context_ngrams(toks, self.settings.ngram_size, len(toks))
        draft = lookup(st, toks, len(toks), self.k, True, self.memory)
        self.kind = st.lookup_kind  # read by replay's per-kind figures
        return draft

    def stop(self, rid: str) -> None:
        st = self.states.pop(rid)
        if self.memory is not None:
            self.memory.close(st.memory_doc)


class NgramDrafter:
    """vLLM's ``ngram`` method (prompt lookup): the ``k`` tokens after the
    earliest place of the longest 2-4 token suffix of the text (vLLM's own
    function, ``NgramProposer``'s defaults as ``bench.py`` runs it)."""

    def __init__(self, k: int = 4) -> None:
        from vllm.v1.spec_decode.ngram_proposer import (
            _find_longest_matched_ngram_and_propose_tokens as find,
        )

        self.k, self.find = k, find

    def start(self, rid: str, prompt: list[int]) -> None:
        pass

    def feed(self, rid: str, token: int) -> None:
        pass

    def draft(self, rid: str, text: list[int]) -> list[int]:
        toks = np.asarray(text, dtype=np.int32)
        return self.find(toks, 2, 4, 1 << 30, self.k).tolist()

    def stop(self, rid: str) -> None:
        pass


class SuffixDrafter:
    """Arctic Inference's suffix cache, driven as vLLM's ``suffix`` method
    drives it (vLLM's defaults)."""

    def __init__(self, k: int) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.k = k
        self.cache = SuffixDecodingCache(max_tree_depth=24, max_cached_requests=10000)

    def start(self, rid: str, prompt: list[int]) -> None:
        self.cache.start_request(rid, np.asarray(prompt, dtype=np.int32))

    def feed(self, rid: str, token: int) -> None:
        self.cache.add_active_response(rid, [token])

    def draft(self, rid: str, text: list[int]) -> list[int]:
        pattern = np.asarray(text[-SUFFIX_PATTERN:], dtype=np.int32)
        got = self.cache.speculate(rid, pattern, max_spec_tokens=self.k,
                                   max_spec_factor=1.0, min_token_prob=0.1)
        return list(got.token_ids)

    def stop(self, rid: str) -> None:
        self.cache.stop_request(rid)


def drafters() -> dict[str, Callable[[], object]]:
    """Method name -> a fresh drafter's factory (suffix only where Arctic
    Inference's suffix tree is importable)."""
    out: dict[str, Callable[[], object]] = {
        "lookahead": lambda: LookaheadDrafter(True),
        "lookahead-own": lambda: LookaheadDrafter(False),
        "lookahead:16": lambda: LookaheadDrafter(True, lookup_len=16),
        "lookahead:24": lambda: LookaheadDrafter(True, lookup_len=24),
        "ngram:4": NgramDrafter,
    }
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
    except ImportError:
        print("suffix: arctic_inference.suffix_decoding is not installed "
              "(bash scripts/setup_suffix.sh): skipped", file=sys.stderr)
    else:
        out["suffix:4"] = lambda: SuffixDrafter(4)
        out["suffix:24"] = lambda: SuffixDrafter(24)
    return out


# -- the replay -------------------------------------------------------------------
def accepted_len(draft: list[int], actual: list[int]) -> int:
    """Length of the prefix of ``draft`` that ``actual`` starts with."""
    a = 0
    for d, x in zip(draft, actual):
        if d != x:
            break
        a += 1
    return a


class _Tally:
    """What :func:`replay` and :func:`decode` count: per drafting position
    (or step) the draft and its accepted prefix, and lookahead's drafts by
    lookup kind (``drafter.kind``)."""

    def __init__(self) -> None:
        self.positions = self.draft_tokens = self.accepted = self.drafted = 0
        # kind -> [drafts, first token right, accepted, tokens]
        self.by_kind: dict[str, list[int]] = {}

    def book(self, drafter, d: list[int], a: int) -> None:
        """A position that drafted ``d`` (maybe nothing), ``a`` accepted."""
        self.positions += 1
        self.draft_tokens += len(d)
        self.drafted += bool(d)
        self.accepted += a
        kind = getattr(drafter, "kind", None)
        if d and kind is not None:
            row = self.by_kind.setdefault(kind, [0, 0, 0, 0])
            row[0] += 1
            row[1] += a > 0
            row[2] += a
            row[3] += len(d)

    def summary(self) -> dict:
        p = max(self.positions, 1)
        out = dict(positions=self.positions, drafted=self.drafted,
                   draft_tokens=self.draft_tokens, accepted=self.accepted,
                   draft_per_pos=self.draft_tokens / p, accepted_per_pos=self.accepted / p,
                   rate=self.accepted / max(self.draft_tokens, 1))
        if self.by_kind:
            out["by_kind"] = {k: dict(drafts=n, first=f / n, accepted=a / n, tokens=t / n)
                              for k, (n, f, a, t) in sorted(self.by_kind.items())}
        return out


def _requests(items: list[dict], drafter):
    """Per prompt of ``items``, in order: its samples' request ids, the
    samples, and each sample's text so far (the prompt), the requests
    started in ``drafter`` before and stopped after."""
    rid = 0
    for item in items:
        prompt, samples = list(item["prompt"]), item["samples"]
        ids = [f"r{rid + i}" for i in range(len(samples))]
        rid += len(samples)
        for r in ids:
            drafter.start(r, prompt)
        yield ids, samples, [list(prompt) for _ in samples]
        for r in ids:
            drafter.stop(r)


def replay(items: list[dict], drafter) -> dict:
    """Replay ``items`` (``{"prompt", "samples"}`` per prompt, in order)
    through ``drafter``: the samples of a prompt in lockstep, a draft for
    every sample before every token but its first. Returns ``positions``,
    ``draft_tokens`` and ``accepted`` summed, ``drafted`` (positions with a
    draft) and their ratios."""
    tally = _Tally()
    for ids, samples, texts in _requests(items, drafter):
        for t in range(max((len(s) for s in samples), default=0)):
            for i, s in enumerate(samples):
                if 0 < t <= len(s):
                    texts[i].append(int(s[t - 1]))
                    drafter.feed(ids[i], int(s[t - 1]))
            for i, s in enumerate(samples):
                if t == 0 or t >= len(s):
                    continue
                d = drafter.draft(ids[i], texts[i])
                tally.book(drafter, d, accepted_len(d, s[t:]))
    return tally.summary()


def decode(items: list[dict], drafter) -> dict:
    """Decode ``items`` as :func:`replay` replays them, but as a decoding run
    moves: every tick each live sample drafts once, moves on by the
    accepted prefix plus one token (the verifier's own) and feeds all of
    them to ``drafter``. Returns :func:`replay`'s figures per step
    (``positions``: steps summed over samples), and ``steps``, ``tokens``
    and ``S`` (tokens per step)."""
    tally, tokens = _Tally(), 0
    for ids, samples, texts in _requests(items, drafter):
        pos = [0] * len(samples)
        while any(p < len(s) for p, s in zip(pos, samples)):
            for i, s in enumerate(samples):
                if pos[i] >= len(s):
                    continue
                # the first token of a sample is the prefill's: no draft
                d = drafter.draft(ids[i], texts[i]) if pos[i] > 0 else []
                a = min(accepted_len(d, s[pos[i]:]), len(s) - pos[i] - 1)
                took = s[pos[i]:pos[i] + a + 1]
                for tok in took:
                    texts[i].append(int(tok))
                    drafter.feed(ids[i], int(tok))
                pos[i] += len(took)
                tokens += len(took)
                tally.book(drafter, d, a)
    out = tally.summary()
    out.update(steps=tally.positions, tokens=tokens, S=tokens / max(tally.positions, 1))
    return out


def as_passes(items: list[dict]) -> list[dict]:
    """The same samples as single requests asked again and again: pass k
    asks every prompt once, answered by its k-th sample."""
    n = min((len(it["samples"]) for it in items), default=0)
    return [{"prompt": it["prompt"], "samples": [it["samples"][k]]}
            for k in range(n) for it in items]


def _table(results: dict) -> str:
    lines = [f"{'set':10s} {'method':14s} {'positions':>9s} {'drafted':>8s} "
             f"{'tok/pos':>8s} {'acc/pos':>8s} {'rate':>6s} {'S':>6s}"]
    for ds, by in results.items():
        for m, r in by.items():
            lines.append(f"{ds:10s} {m:14s} {r['positions']:9d} {r['drafted'] / max(r['positions'], 1):8.2f} "
                         f"{r['draft_per_pos']:8.2f} {r['accepted_per_pos']:8.3f} {r['rate']:6.3f}"
                         f" {r.get('S', float('nan')):6.3f}")
    return "\n".join(lines)


def _kind_table(results: dict, method: str = "lookahead") -> str:
    """Per set, ``method``'s drafts by lookup kind (``drafting.lookup``:
    source, key length, the places' agreement): how many, the share whose
    first token matched, accepted and draft tokens per draft."""
    lines = [f"{'set':10s} {'kind':10s} {'drafts':>7s} {'first':>6s} {'acc':>6s} {'tokens':>6s}"]
    for ds, by in results.items():
        for kind, r in by.get(method, {}).get("by_kind", {}).items():
            lines.append(f"{ds:10s} {kind:10s} {r['drafts']:7d} {r['first']:6.2f} "
                         f"{r['accepted']:6.2f} {r['tokens']:6.2f}")
    return "\n".join(lines)


def _plot(results: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    sets = list(results)
    fig, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 4), squeeze=False)
    for ax, ds in zip(axes[0], sets):
        names = list(results[ds])
        x = np.arange(len(names))
        ax.bar(x - 0.2, [results[ds][m]["draft_per_pos"] for m in names], 0.4,
               label="draft tokens / position")
        ax.bar(x + 0.2, [results[ds][m]["accepted_per_pos"] for m in names], 0.4,
               label="accepted / position")
        ax.set_xticks(x, names, rotation=20)
        ax.set_title(ds)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from report import save_results

    samples_path = Path(args.samples)
    config = {k: getattr(args, k) for k in SAMPLING_KEYS}
    cached = json.loads(samples_path.read_text()) if samples_path.exists() else None
    if cached is not None:  # files from before --structured were sampled without it
        cached.get("config", {}).setdefault("structured", False)
    if cached is not None and cached.get("config") == config:
        data = cached["sets"]
    else:  # none yet, or made with other settings
        data = sample_outputs(args)
        samples_path.parent.mkdir(parents=True, exist_ok=True)
        samples_path.write_text(json.dumps({"config": config, "sets": data}))
    if args.repeat:
        data = {ds: as_passes(items) for ds, items in data.items()}
    run = decode if args.steps else replay
    results = {ds: {name: run(items, make()) for name, make in drafters().items()}
               for ds, items in data.items()}
    print(_table(results))
    if args.by_kind:
        for method in ("lookahead", "lookahead:16"):
            print(f"\n{method}, drafts by lookup kind:")
            print(_kind_table(results, method))
    save_results(args.out, vars(args), results, _plot,
                 sys.argv if argv is None else ["replay_drafts.py", *argv])


if __name__ == "__main__":
    main()
