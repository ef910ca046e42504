"""What a compiled grammar can force: the shortest output each of its rules can end with, found on
xgrammar's serialized grammar (``Grammar.serialize_json``: rules and a flat array of expressions).

Why: xgrammar's jump-forward (``GrammarMatcher.find_jump_forward_tokens``, the grammar-forced drafts of
engine/spec/grammar_drafts.py) walks the forced continuation to its end, with no length limit and
nothing that can stop it. ``root ::= "a" root`` forces ``aaaa...`` for ever, and the call grows until
the kernel's OOM killer takes the worker; a JSON schema whose required property refers back to the
whole schema (``{"properties": {"n": {"$ref": "#"}}, "required": ["n"]}``) does the same. Both match
no finite output at all. So, at compile time (in the compiler's child process, under its limits):

- a grammar with a rule that can be reached but never ends (no finite derivation) is refused with a
  ``GrammarError``: no output can ever satisfy it;
- the forced continuation from any matcher state is a prefix of its shortest completion, which is
  bounded by the shortest lengths of what is left of each rule on the parse stack; jump-forward is
  allowed only where no part of a reachable rule (an alternative once chosen) needs more than
  :data:`MAX_FORCED_RULE_BYTES` to end, and where this module understands every expression (a grammar
  format it does not know gets no forced drafts, never a risk).

Standard library only.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from tokenmill.engine.errors import GrammarError

# NOTE: the serialized layouts this module reads (xgrammar's grammar_impl.h, GrammarExprType); another
# version may renumber them, so any other version gets no forced drafts (the grammar itself still works).
KNOWN_VERSIONS = frozenset({"v18"})
BYTE_STRING, CHARACTER_CLASS, CHARACTER_CLASS_STAR, EMPTY_STR, RULE_REF, SEQUENCE, CHOICES, TAG_DISPATCH, \
    REPEAT, TOKEN, EXCLUDE_TOKEN, TOKEN_TAG_DISPATCH = range(12)
# A rule that cannot end in fewer bytes than this makes jump-forward walks too long to run on the engine
# thread (a forced continuation is at most the parse stack's depth times this); such grammars draft nothing.
MAX_FORCED_RULE_BYTES = 4096


@dataclass(frozen=True)
class GrammarBounds:
    """What :func:`analyze` found of one compiled grammar."""

    allows_jump_forward: bool  # forced drafts may walk its forced continuations (bounded)
    longest_rule_bytes: int  # the largest shortest length of a part of a reachable rule (-1: format not understood)


def analyze(serialized: str) -> GrammarBounds:
    """The bounds of a grammar from ``xgrammar.Grammar.serialize_json()``.

    Raises:
        GrammarError: a reachable rule can never end (the grammar matches no finite output).
    """
    data = json.loads(serialized)
    if data.get("__VERSION__") not in KNOWN_VERSIONS:
        return GrammarBounds(allows_jump_forward=False, longest_rule_bytes=-1)
    grammar = _Grammar(data)
    if grammar.has_unknown_expr:
        return GrammarBounds(allows_jump_forward=False, longest_rule_bytes=-1)
    shortest = grammar.shortest_rule_bytes()
    reachable = grammar.reachable_rules()
    endless = [grammar.rule_names[rule] for rule in reachable if math.isinf(shortest[rule])]
    if endless:
        raise GrammarError(f"the grammar can never end: rule {endless[0]!r} has no finite expansion "
                           "(it always refers back to itself), so no output can satisfy it")
    longest = int(max((grammar.longest_part_bytes(rule, shortest) for rule in reachable), default=0))
    return GrammarBounds(allows_jump_forward=longest <= MAX_FORCED_RULE_BYTES, longest_rule_bytes=longest)


class _Grammar:
    """The rules and expressions of a serialized grammar, as ``(type, data)`` per expression."""

    def __init__(self, data: dict[str, Any]) -> None:
        flat, indptr = data["grammar_expr_data"], data["grammar_expr_indptr"]
        self.exprs: list[tuple[int, list[int]]] = []
        for start in indptr:
            # NOTE: each expression is [type, data length, data...]; indptr holds only the starts
            self.exprs.append((flat[start], flat[start + 2:start + 2 + flat[start + 1]]))
        self.rule_bodies: list[int] = [int(rule[1]) for rule in data["rules"]]
        self.rule_names = [str(rule[0]) for rule in data["rules"]]
        self.root = int(data["root_rule_id"])
        self.has_unknown_expr = any(kind > TOKEN_TAG_DISPATCH for kind, _ in self.exprs)

    def shortest_rule_bytes(self) -> list[float]:
        """Each rule's shortest expansion in bytes (a token counts one), ``inf`` for a rule that never ends.

        A worklist fixpoint: a rule is evaluated again only when a rule it refers to got shorter. Lengths
        only fall and are whole numbers, so it ends; it runs in the compiler's child, under its limits.
        """
        users: list[list[int]] = [[] for _ in self.rule_bodies]
        for rule, body in enumerate(self.rule_bodies):
            for used in set(self._referenced_rules(body)):
                users[used].append(rule)
        shortest = [math.inf] * len(self.rule_bodies)
        todo, queued = list(range(len(self.rule_bodies))), [True] * len(self.rule_bodies)
        while todo:
            rule = todo.pop()
            queued[rule] = False
            length = self._expr_bytes(self.rule_bodies[rule], shortest)
            if length < shortest[rule]:
                shortest[rule] = length
                for user in users[rule]:
                    if not queued[user]:
                        queued[user] = True
                        todo.append(user)
        return shortest

    def _expr_bytes(self, expr: int, shortest: list[float]) -> float:
        kind, data = self.exprs[expr]
        if kind == BYTE_STRING:
            return len(data)
        if kind in (CHARACTER_CLASS, TOKEN, EXCLUDE_TOKEN):
            return 1
        if kind in (CHARACTER_CLASS_STAR, EMPTY_STR):
            return 0
        if kind == RULE_REF:
            return shortest[data[0]]
        if kind == SEQUENCE:
            return sum(self._expr_bytes(child, shortest) for child in data)
        if kind == CHOICES:
            return min((self._expr_bytes(child, shortest) for child in data), default=math.inf)
        if kind == REPEAT:
            rule, min_count = data[0], data[1]
            return 0 if min_count == 0 else min_count * shortest[rule]
        # NOTE: tag dispatch is free text that may end at once (the tagged rules run only when a tag appears)
        return 0

    def longest_part_bytes(self, rule: int, shortest: list[float]) -> float:
        """The largest shortest length of any part of ``rule``'s body: after a choice is made, what is left
        of that alternative may be forced, however short another alternative is."""
        longest, todo = 0.0, [self.rule_bodies[rule]]
        while todo:
            expr = todo.pop()
            longest = max(longest, self._expr_bytes(expr, shortest))
            kind, data = self.exprs[expr]
            if kind in (SEQUENCE, CHOICES):
                todo.extend(data)
        return longest

    def reachable_rules(self) -> list[int]:
        """The rules the root can reach, the root first."""
        seen, todo = {self.root}, [self.root]
        while todo:
            for rule in self._referenced_rules(self.rule_bodies[todo.pop()]):
                if rule not in seen:
                    seen.add(rule)
                    todo.append(rule)
        return sorted(seen, key=lambda rule: (rule != self.root, rule))

    def _referenced_rules(self, expr: int) -> list[int]:
        rules, todo = [], [expr]
        while todo:
            kind, data = self.exprs[todo.pop()]
            if kind in (RULE_REF, REPEAT):
                rules.append(data[0])
            elif kind in (SEQUENCE, CHOICES):
                todo.extend(data)
            elif kind == TAG_DISPATCH:  # [tag_expr, rule] pairs, then two flags
                rules.extend(data[1:len(data) - 2:2])
            elif kind == TOKEN_TAG_DISPATCH:  # [trigger count, (token, rule) pairs, ...]
                rules.extend(data[2:2 + 2 * data[0]:2])
        return rules
