"""Per-step planner: each request's :class:`~.shapes.Shape` for the step.

It maximises the batch's expected tokens per second (tokens from each
request's :mod:`.acceptance`, seconds from :mod:`.cost_model`) by coordinate
ascent on ``tokens - lambda * seconds`` (Dinkelbach, lambda the plan's rate),
from all off and from all drafting. Shapes that cannot beat off are not searched.
"""

from __future__ import annotations

from vllm_lookahead.planner.acceptance import RequestAcceptance
from vllm_lookahead.planner.shapes import (
    OFF, RequestView, Shape, _shape, _tree_table, draft_lengths, draft_p, verified_rows,
    verify_seconds)


class Planner:
    """Chooses every request's :class:`Shape` for a step (``cost``: a
    :class:`~.cost_model.CostModel`; ``fused``: trees ride in the verification
    forward, else in a second pass; ``sweeps``: coordinate-ascent sweeps)."""

    #: Share of the planned time that may go to trees not predicted best (tree
    #: acceptance is learnt only from trees that run), never one making the
    #: step more than EXPLORE_MAX_STEP plain steps; a request is explored
    #: EXPLORE_AFTER steps after its last tree, or at its start until the
    #: prior has learnt from EXPLORE_KNOWN trees.
    EXPLORE_SHARE = 0.03
    EXPLORE_MAX_STEP = 1.5
    EXPLORE_AFTER = 64
    EXPLORE_KNOWN = 16
    #: A seeded draft's verifier seconds (first token, each next) in plain
    #: one-request steps, where the curve measured none.
    SEEDED_FIRST = 0.25
    SEEDED_NEXT = 0.15

    def __init__(self, cost, fused: bool = True, sweeps: int = 3) -> None:
        self.cost = cost
        self.fused = fused
        self.sweeps = sweeps
        #: predicted seconds planned and explored (the same on every TP rank)
        self.planned_s = 0.0
        self.explore_s = 0.0
        self.explored = 0
        self._turn = 0
        #: requests left off without being searched (:meth:`_prune`)
        self.left_off = 0
        #: steps a tree run lasts (a catch-up tree's first step confirms
        #: nothing); the StepDrafter updates it from its counts
        self.horizon = 8.0
        #: draft rows past the first rejection cost nothing (patch 15, CPU)
        self.lazy_verify = False

    # -- one request ---------------------------------------------------------------
    def shapes(self, v: RequestView, batch: int) -> list[Shape]:
        """The shapes request ``v`` may take in a ``batch``-request step,
        :data:`OFF` first, then its drafts, then its trees."""
        if v.fixed is not None:
            return [v.fixed]
        out = [OFF]
        if v.room <= 0:
            return out
        acc = v.acc
        if v.chain > 0:  # drafted once, then guesses: valued as the policy
            k = min(v.chain, v.room)
            out.append(Shape("draft", draft=k, tokens=1 + acc.unchecked_gain(k),
                             extra_s=v.verify_s(k, v.draft_p())))
        elif v.unchecked > 0:
            p = v.draft_p()
            for k in draft_lengths(min(v.unchecked, v.room)):
                out.append(Shape("draft", draft=k, tokens=1 + acc.unchecked_gain(k, v.lookup_kind),
                                 extra_s=v.verify_s(k, p)))
        if not v.trees:
            return out
        # separate mode: a second forward every step, shared by the batch
        extra_1 = 0.0 if self.fused else self.cost.predict(1, 1) / max(batch, 1)
        # a catch-up tree confirms nothing until the next step
        catch_up = 1.0 - 1.0 / max(self.horizon, 1.0) if self.fused and v.chain <= 0 else 1.0
        table, roots = _tree_table(v.ngram_size, v.window_size, v.guess_set_size)
        p_chain, checked = v.draft_p(tree=True), acc.checked.p
        verify = {}  # draft length -> its verifier seconds
        for (w, g, nodes), m in zip(table, acc.tree_gains(roots)):
            m = min(m, v.ngram_size - 1)
            # steady state: each step drafts the chain the last tree confirmed
            d = min(int(round(m)), v.room)
            if d not in verify:
                verify[d] = v.verify_s(d, p_chain)
            out.append(_shape(("tree", d, w, g, nodes, 1 + m * checked * catch_up,
                               extra_1 + verify[d])))
        return out

    def steady_draft(self, acc: RequestAcceptance, kind: str, k_max: int,
                     batch: int = 1) -> int:
        """A seeded request's draft length from nothing timed while it runs:
        the k <= ``k_max`` with the most tokens per second of a ``batch``-step
        (fixed at its start) where it alone drafts, on the start-up curve."""
        plain = self.cost.plain
        b = max(int(batch), 1)
        first, nxt = self.cost.verify(b, True, True)
        first += self.cost.switch(b, True, True)
        if not (first or nxt):
            one = max(plain(1, 1), 1e-12)
            first, nxt = one * self.SEEDED_FIRST, one * self.SEEDED_NEXT
        best, best_rate = 0, b / max(plain(b, 1), 1e-12)
        p = draft_p(acc, kind)
        for k in range(1, k_max + 1):
            verify = verify_seconds((first, nxt), k,
                                    verified_rows(k, p) if self.lazy_verify else None)
            rate = (b + acc.unchecked_gain(k, kind)) / max(plain(b, 1 + k / b) + verify, 1e-12)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    # -- the batch -----------------------------------------------------------------
    def plan(self, views: list[RequestView], max_tree_tokens: int = 0,
             explore: bool = False) -> list[Shape]:
        """One shape per view (``explore``: perhaps try a tree where the plan has none)."""
        r_n = len(views)
        if r_n == 0:
            return []
        options = [self.shapes(v, r_n) for v in views]
        memo: dict[tuple[int, bool, int], float] = {}

        def seconds(total_query: int, trees: int, drafting: int) -> float:
            key = (total_query, trees > 0, drafting)
            s = memo.get(key)
            if s is None:
                s = memo[key] = self.cost.predict(r_n, total_query / r_n, tree=trees > 0,
                                                  drafting=drafting)
            return s

        switch = max(v.switch for v in views)
        pays = self._bound(r_n, seconds)
        # requests whose drafts could pay beside another drafting one
        drafts_pay = [v.fixed is None and any(s.kind == "draft" and pays(v, s) for s in o)
                      for v, o in zip(views, options)]
        searched = self._prune(views, options, pays, drafts_pay)
        # per option: (query, tree, weighted tokens, extra s, drafting, verified)
        rows = [[(1 + d + nodes, kind == "tree", 1.0 + v.weight * (tokens - 1.0), extra_s,
                  d + nodes > 0, d > 0) for kind, d, _, _, nodes, tokens, extra_s in opts]
                for v, opts in zip(views, searched)]
        pick, rate = _search(rows, [0] * r_n, seconds, memo, switch, self.sweeps)
        start = [int(d) for d in drafts_pay]
        if switch > 0 and sum(start) >= 2 and start != pick:
            # from all off the first to draft pays the switch alone: drafts
            # that pay only together need a start with them drafting
            other, other_rate = _search(rows, start, seconds, memo, switch, self.sweeps)
            if other_rate > rate * (1 + 1e-9):
                pick = other
        chosen = [searched[r][pick[r]] for r in range(r_n)]
        if max_tree_tokens > 0:
            chosen = self._fit(chosen, options, max_tree_tokens)
        if not explore:
            return chosen
        sec = seconds(sum(c.query for c in chosen), sum(c.kind == "tree" for c in chosen),
                      sum(c.query > 1 for c in chosen)) + sum(c.extra_s for c in chosen) \
            + (switch if any(c.draft > 0 for c in chosen) else 0.0)
        self.planned_s += sec
        if not any(c.kind == "tree" for c in chosen):
            self._explore(chosen, options, views, sec, seconds, max_tree_tokens, switch)
        return chosen

    @staticmethod
    def _bound(r_n: int, seconds):
        """``pays(view, shape)``: whether ``shape`` beats off with the others
        off, at the plain rate (the switch left out, shared). If not, the
        search never picks it: with others on, the rate is only higher."""
        plain = seconds(r_n, 0, 0)
        lam = r_n / plain

        def pays(v: RequestView, s: Shape) -> bool:
            sec = seconds(r_n - 1 + s.query, s.kind == "tree", int(s.query > 1)) - plain + s.extra_s
            return v.weight * (s.tokens - 1.0) > lam * sec
        return pays

    def _prune(self, views, options, pays, drafts_pay) -> list[list[Shape]]:
        """Per request the shapes searched: all where a tree could pay, else
        off and its drafts where one could (``drafts_pay``), else off."""
        out = []
        for v, opts, drafts in zip(views, options, drafts_pay):
            n = 1 + sum(s.kind == "draft" for s in opts)
            if not any(pays(v, s) for s in opts[n:]):
                opts = opts[:n] if drafts else opts[:1]
            out.append(opts)
        self.left_off += sum(v.fixed is None and len(o) == 1 for v, o in zip(views, out))
        return out

    def explore_due(self, acc: RequestAcceptance) -> bool:
        """Whether a request's acceptance ``acc`` is due an exploration tree."""
        known = acc.prior.trees_seen >= self.EXPLORE_KNOWN
        return not ((acc.tree_runs or known) and acc.since_tree < self.EXPLORE_AFTER)

    def _explore(self, chosen, options, views, sec, seconds, max_tree_tokens,
                 switch: float) -> None:
        """Give one request due a tree, in turn, the tree losing least
        against the plan within the exploration's credit."""
        credit = self.EXPLORE_SHARE * self.planned_s - self.explore_s
        r_n = len(chosen)
        plain = seconds(r_n, 0, 0)
        if credit < plain or sec <= 0:  # no tree step fits the credit yet
            return
        rate = sum(c.tokens for c in chosen) / sec
        q, extra = sum(c.query for c in chosen), sum(c.extra_s for c in chosen)
        n_draft, n_ver = sum(c.query > 1 for c in chosen), sum(c.draft > 0 for c in chosen)
        limit = min(credit, self.EXPLORE_MAX_STEP * plain)
        for k in range(r_n):
            r = (self._turn + k) % r_n
            v, cur, best = views[r], chosen[r], None
            if v.fixed is not None or not v.trees or not self.explore_due(v.acc):
                continue
            for o in options[r]:
                if o.kind != "tree" or (max_tree_tokens and o.nodes > max_tree_tokens):
                    continue
                s2 = seconds(q - cur.query + o.query, 1,
                             n_draft - (cur.query > 1) + (o.query > 1)) + extra - cur.extra_s \
                    + o.extra_s
                if o.draft > 0 or n_ver - (cur.draft > 0) > 0:
                    s2 += switch
                lost = (s2 - sec) - (o.tokens - cur.tokens) / rate
                if s2 <= limit and (best is None or lost < best[0]):
                    best = (lost, s2, o)
            if best is not None:
                chosen[r] = best[2]
                self.explore_s += best[1]
                self.explored += 1
                self._turn = r + 1
                return

    @staticmethod
    def _fit(chosen: list[Shape], options: list[list[Shape]], budget: int) -> list[Shape]:
        """Shrink trees to ``budget`` nodes, least tokens lost per node first."""
        chosen = list(chosen)
        while sum(s.nodes for s in chosen) > budget:
            best = None
            for r, s in enumerate(chosen):
                if s.nodes == 0:
                    continue
                smaller = [o for o in options[r] if o.nodes < s.nodes] or [OFF]
                alt = max(smaller, key=lambda o: o.tokens)
                loss = (s.tokens - alt.tokens) / (s.nodes - alt.nodes)
                if best is None or loss < best[0]:
                    best = (loss, r, alt)
            if best is None:
                break
            chosen[best[1]] = best[2]
        return chosen


def _search(rows, pick: list[int], seconds, memo: dict, switch: float,
            sweeps: int) -> tuple[list[int], float]:
    """Coordinate ascent over ``rows`` (:meth:`Planner.plan`'s) from ``pick``:
    each request takes its best option given the others', for up to
    ``sweeps`` sweeps. Returns the picks and the plan's rate."""
    cur = [rows[r][j] for r, j in enumerate(pick)]
    q_tot, n_tree, tok, extra, n_draft, n_ver = (sum(c[i] for c in cur) for i in range(6))
    for _ in range(sweeps):
        lam = tok / (seconds(q_tot, n_tree, n_draft) + extra + (switch if n_ver else 0.0))
        changed = False
        for r, opts in enumerate(rows):
            if len(opts) == 1:
                continue
            cq, ctree, ctok, cextra, cdraft, cver = opts[pick[r]]
            q_base, t_base = q_tot - cq, n_tree - ctree
            d_base, v_base = n_draft - cdraft, n_ver - cver
            best, best_val = pick[r], None
            for j, (oq, otree, otok, oextra, odraft, over) in enumerate(opts):
                key = (q_base + oq, t_base + otree > 0, d_base + odraft)
                sec = memo.get(key)  # seconds(), inlined: the innermost loop
                if sec is None:
                    sec = seconds(*key)
                if v_base or over:
                    sec += switch
                val = otok - lam * (sec + oextra)
                if best_val is None or val > best_val + 1e-12:
                    best, best_val = j, val
            if best != pick[r]:
                totals = (q_tot, n_tree, tok, extra, n_draft, n_ver)
                q_tot, n_tree, tok, extra, n_draft, n_ver = (
                    t + (n - c) for t, n, c in zip(totals, opts[best], opts[pick[r]]))
                pick[r] = best
                changed = True
        if not changed:
            break
    return pick, tok / (seconds(q_tot, n_tree, n_draft) + extra + (switch if n_ver else 0.0))
