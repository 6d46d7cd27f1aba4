"""Sampling filters and stop-string handling of the detokeniser."""

from __future__ import annotations

import msgspec
import pytest
import torch

from tidal.engine.api import SamplingParams
from tidal.engine.torch.sampling import Detokenizer, make_generator, sample


class CharTokenizer:
    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        return ""


def test_stop_string_is_cut_and_never_streamed() -> None:
    d = Detokenizer(CharTokenizer(), ["END"])
    ids: list[int] = []
    streamed = ""
    for c in "abcEN":
        ids.append(ord(c))
        delta, hit = d.update(ids, final=False)
        streamed += delta
        assert not hit
    assert streamed == "abc"  # "EN" held back: it may become "END"
    ids.append(ord("D"))
    delta, hit = d.update(ids, final=False)
    assert hit and streamed + delta == "abc"
    d2 = Detokenizer(CharTokenizer(), ["END"])
    assert d2.update([ord("E")], final=False) == ("", False)
    assert d2.update([ord("E"), ord("x")], final=True) == ("Ex", False)


def test_top_k_top_p_and_seed() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(200, 1)
    sps = [SamplingParams(temperature=1.0, top_k=2, seed=i) for i in range(200)]
    toks, _ = sample(logits, sps, [make_generator(sp) for sp in sps], want_logprobs=False)
    assert set(toks) == {2, 3}  # both survivors drawn, nothing outside the top 2
    again, _ = sample(logits, sps, [make_generator(sp) for sp in sps], want_logprobs=False)
    assert again == toks  # same seeds, same draws
    sp = SamplingParams(temperature=1.0, top_p=0.5, seed=1)  # p(3) = 0.64 >= 0.5: only 3
    toks, lps = sample(logits[:5], [sp] * 5, [make_generator(sp) for _ in range(5)], True)
    assert toks == [3] * 5
    expected = torch.log_softmax(logits[0], -1)[3].item()
    assert all(abs(lp - expected) < 1e-6 for lp in lps)
    greedy = SamplingParams(temperature=0)
    assert make_generator(greedy) is None
    assert sample(logits[:1], [greedy], [None], False)[0] == [3]


def test_penalties_and_logit_bias_arithmetic() -> None:
    from tidal.engine.torch.sampling import apply_penalties

    logits = torch.zeros(2, 5)
    sp = SamplingParams(frequency_penalty=0.5, presence_penalty=1.0, logit_bias=((4, 3.0),))
    out = apply_penalties(logits, [sp, SamplingParams()], [[1, 1, 2], [1]])
    # token 1 twice: -(0.5 * 2 + 1.0) = -2; token 2 once: -(0.5 + 1.0) = -1.5; token 4: +3
    assert out[0].tolist() == [0.0, -2.0, -1.5, 0.0, 3.0]
    assert out[1].tolist() == [0.0] * 5  # no penalties asked: untouched
    assert logits.abs().sum() == 0  # a new tensor


def test_logprobs_of_lists_the_top_alternatives_most_likely_first() -> None:
    from tidal.engine.torch.sampling import logprobs_of

    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    chosen, tops = logprobs_of(logits, [2, 0], [2, 0])
    lp = torch.log_softmax(logits, -1)
    assert chosen == pytest.approx([lp[0, 2].item(), lp[1, 0].item()])
    assert [t for t, _ in tops[0]] == [1, 2] and tops[1] == ()
    assert tops[0][0][1] == pytest.approx(lp[0, 1].item())


def test_a_greedy_token_tied_at_the_top_is_its_own_first_alternative() -> None:
    """Logits rounded to bf16 tie often: greedy takes the first of equal maxima, and the top
    alternatives list ties in that order, whatever order `torch.topk` returns them in."""
    from tidal.engine.torch.sampling import logprobs_of

    vocab = 49152
    g = torch.Generator().manual_seed(0)
    for first, second in [(14, 9600), (300, 301), (7, 48000)]:
        logits = (torch.randn(1, vocab, generator=g) * 2).to(torch.bfloat16).float()
        logits[0, first] = logits[0, second] = 30.0
        greedy = sample(logits, [SamplingParams(temperature=0.0)], [None], False)[0]
        assert greedy == [min(first, second)]
        _, tops = logprobs_of(logits, greedy, [3])
        assert [t for t, _ in tops[0][:2]] == sorted((first, second))
        assert tops[0][0][1] == tops[0][1][1]


def test_penalties_and_bias_survive_a_migration() -> None:

    from services.instance.sglang.api import RecomputePayload
    from tidal.engine.api import EngineRequest
    from tidal.engine.torch import kv_transfer as kvt

    sp = SamplingParams(frequency_penalty=0.5, presence_penalty=-1.0, logit_bias=((7, -100.0),))
    req = EngineRequest("r", [1, 2], sp)
    # as torch_migrate carries it: the request dict inside a MessagePack state
    wire = msgspec.msgpack.encode(kvt.request_to_dict(req))
    moved = kvt.request_from_dict(msgspec.msgpack.decode(wire))
    assert moved.sampling == sp
    payload = RecomputePayload("m", req, [3], [], "")
    assert RecomputePayload.decode(payload.encode()).req.sampling == sp
