"""A request's limits, defined once: the instance that runs it and the scheduler that plans for
it apply the same rule."""

from __future__ import annotations


def fit_max_tokens(max_tokens: int, is_default: bool, num_prompt: int, max_model_len: int) -> int:
    """The output budget of a request with `num_prompt` tokens on a model of `max_model_len`:
    a client that set no `max_tokens` gets what the context leaves (at least 1), never a
    rejection; one that set it gets it (the instance rejects what does not fit). 0 for
    `max_model_len`: the context is not known (the scheduler before any report), no fitting."""
    if not is_default or max_model_len <= 0:
        return max_tokens
    return max(1, min(max_tokens, max_model_len - num_prompt))
