"""A `GenerateRequest` as the engine takes it: the chat template applied, the prompt tokenised,
`max_tokens` fitted to the context, what a recompute resumes from appended, and the sampling
checked against the vocabulary. Run off the loop (`asyncio.to_thread`): templating and tokenising
a 100k-token prompt takes a while. A ValueError is the client's error, said to it as such."""

from __future__ import annotations

import time

from tidal.config.limits import fit_max_tokens
from tidal.engine.api import (
    ControllableEngine,
    EngineRequest,
    RequestClass,
    SamplingParams,
    check_fits,
)
from tidal.schemas.messages import GenerateRequest


def to_engine_request(engine: ControllableEngine, req: GenerateRequest) -> EngineRequest:
    tok = engine.tokenizer
    if req.messages is not None:
        prompt = tok.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in req.messages]
        )
    else:
        prompt = req.prompt or ""
    ids = tok.encode(prompt)
    if not ids:
        raise ValueError("the prompt is empty")
    s = req.sampling
    max_tokens = fit_max_tokens(
        s.max_tokens, s.max_tokens_is_default, len(ids), engine.max_model_len
    )
    check_fits(len(ids), max_tokens, engine.max_model_len)
    # A recompute after a lost instance: what the client already has is input now.
    resumed = list(req.resume_token_ids)
    if len(resumed) >= max_tokens:
        raise ValueError("resume_token_ids already hold max_tokens tokens")
    sampling = SamplingParams(
        max_tokens=max_tokens - len(resumed),
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        stop=tuple(s.stop),
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        logprobs=s.logprobs,
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
        logit_bias=tuple((int(t), float(b)) for t, b in s.logit_bias),
    )
    sampling.check_vocab(engine.tokenizer.vocab_size)
    return EngineRequest(
        req_id=req.req_id,
        prompt_token_ids=ids + resumed,
        sampling=sampling,
        req_class=RequestClass(req.req_class),
        arrival_s=req.arrival_unix_s or time.time(),
        priority=req.priority,
    )
