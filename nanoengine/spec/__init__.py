"""Speculative decoding (chapter 09): propose a few tokens cheaply, verify them in one forward of the model,
keep the longest accepted prefix plus the model's own next token.

- `ngram.py`: the n-gram (prompt lookup) proposer, plain Python;
- `verify.py`: the acceptance rules (greedy: accept while the draft equals the model's token; sampling: the
  rejection-sampling rule) and the per-engine counts (acceptance rate, tokens per verification).
The scheduler asks the proposer for drafts and gives each speculating sequence 1 + k tokens of the budget;
the engine verifies them and the scheduler rolls back the blocks that only rejected drafts wrote.
"""
