"""The engine's logprobs in OpenAI's two shapes. Chapter 05 (appendix).

The engine gives one dict per position, token id -> `Logprob(logprob, rank, decoded_token)`: the position's
own token first (sampled, or the prompt's), then the top k by rank (a token in both appears once); the
prompt's first position is None (nothing predicts it).

- /v1/completions (OpenAI's legacy shape, vLLM's conventions): `tokens` (decoded), `token_logprobs`,
  `top_logprobs` ({token text: logprob} of the token and the top k, so up to k + 1 entries), and
  `text_offset` (each token's start: the running sum of the token texts' lengths, from `offset`); the
  prompt's first token has no logprob and no top logprobs.
- /v1/chat/completions: `content`, one `{token, logprob, bytes, top_logprobs: [the k best, by rank]}` per
  token.

A logprob of -inf (a token the filters ruled out, with logprobs_mode="processed_logprobs") is -9999.0, as in
OpenAI and vLLM: JSON has no infinity.
"""

from __future__ import annotations

from nanoengine.outputs import Logprob, PositionLogprobs
from nanoengine.serve.responses import CompletionLogprobs, TokenLogprob, TopLogprob

MIN_LOGPROB = -9999.0  # what -inf becomes


def _value(lp: Logprob) -> float:
    return max(lp.logprob, MIN_LOGPROB)


def _text(lp: Logprob) -> str:
    if lp.decoded_token is None:
        raise ValueError("the engine gave a logprob without its decoded token (Logprob.decoded_token)")
    return lp.decoded_token


def _own(position: PositionLogprobs) -> Logprob:
    """The position's own token (the dict's first entry)."""
    return next(iter(position.values()))


def completion_logprobs(positions: list[PositionLogprobs | None], offset: int = 0,
                        unscored: str = "", into: CompletionLogprobs | None = None) -> CompletionLogprobs:
    """Positions in the legacy shape, the first token starting at character `offset`. `unscored`: the text
    of a position without logprobs (the prompt's first token). `into`: add them to these (a stream's first
    chunk joins the prompt's and the first tokens')."""
    out = into if into is not None else CompletionLogprobs()
    for position in positions:
        out.text_offset.append(offset)
        if position is None:
            token, logprob, top = unscored, None, None
        else:
            token, logprob = _text(_own(position)), _value(_own(position))
            top = {_text(lp): _value(lp) for lp in position.values()}
        out.tokens.append(token)
        out.token_logprobs.append(logprob)
        out.top_logprobs.append(top)
        offset += len(token)
    return out


def next_offset(logprobs: CompletionLogprobs) -> int:
    """Where the token after these starts (a stream's next chunk goes on from there)."""
    if not logprobs.tokens:
        return 0
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])


def _top(lp: Logprob) -> TopLogprob:
    token = _text(lp)
    return TopLogprob(token=token, logprob=_value(lp), bytes=list(token.encode("utf-8", errors="replace")))


def chat_logprobs(positions: list[PositionLogprobs], top_logprobs: int) -> list[TokenLogprob]:
    """Positions in chat's shape: each token, and the `top_logprobs` most likely at its step, by rank."""
    out = []
    for position in positions:
        own = _top(_own(position))
        best = sorted((lp for lp in position.values() if lp.rank is not None and lp.rank <= top_logprobs),
                      key=lambda lp: lp.rank)
        out.append(TokenLogprob(**own.model_dump(), top_logprobs=[_top(lp) for lp in best[:top_logprobs]]))
    return out
