"""Grammar-forced draft tokens: where a structured request's grammar allows only one continuation
(a JSON key the schema fixes, the punctuation between fields, the closing braces), those tokens are
proposed as a draft. The model verifies them like any draft (the rows' masks follow the grammar over
the draft, engine/sample/grammar_mask.py), so they are kept unless the model's tokenizer would spell
the forced text in other tokens. Shares the sampler's grammar matchers (engine/sample/, which imports
torch); imports xgrammar lazily (with the first structured request).

xgrammar's jump-forward walks the whole forced continuation, however long, and cannot be stopped or
limited: it runs only for grammars whose forced continuations are proven bounded at compile time
(engine/sample/grammar_bounds.py; a grammar that can never end is refused there).

A proposer of speculative decoding (engine/spec/speculator.py's ``Proposer``): it proposes for
structured requests only; the others are left to the next proposer.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.engine.core.request import Request
from tokenmill.engine.sample.grammar import GrammarCompiler
from tokenmill.engine.sample.grammar_mask import synced_matcher


class GrammarForcedProposer:
    """Drafts the tokens a structured request's grammar forces next (xgrammar's jump-forward tokens).

    Args:
        compiler: the engine's grammar compiler (the sampler's): the same grammars and matchers.
    """

    name = "grammar"

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler

    def propose(self, wanted: list[tuple[Request, Sequence[int], int]]) -> dict[str, list[int]]:
        drafts = {}
        for request, _, num_tokens in wanted:
            params = request.sampling_params
            if not params.is_structured:
                continue
            matcher = synced_matcher(self.compiler, request.sampling_state, params)
            if not request.sampling_state.allows_jump_forward:
                continue
            draft = list(matcher.find_jump_forward_tokens())[:num_tokens]
            if draft:
                drafts[request.request_id] = draft
        return drafts

    def finished(self, request: Request) -> None:
        """Nothing to keep: the matcher lives on the request's sampling state."""
