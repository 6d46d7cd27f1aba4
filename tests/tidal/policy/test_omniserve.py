"""OmniServe controls on hand-worked states (papers/omniserve.md §3.3.3–3.3.6)."""

from __future__ import annotations

from tidal.perf.linear import LinearStepModel
from tidal.policy.batch_shape import decode_shape
from tidal.policy.omniserve import admit_ls, fit_decodes, max_chunk, piggyback_admission

TOK = LinearStepModel(base_s=0.01, per_token_s=1e-4, per_ctx_token_s=0.0, per_attn_pair_s=0.0)
CTX = LinearStepModel(base_s=0.01, per_token_s=0.0, per_ctx_token_s=1e-5, per_attn_pair_s=0.0)


def test_admission_inequality_and_early_rejection() -> None:
    dec = decode_shape([10, 10])
    # Pending LS prompt 1000 with 200 prefilled -> 800 left. New 1000: 10 + 0.1*(2+800+1000) ms
    # = 190.2 ms <= 200 ms. New 1100: 200.2 ms > 200 ms -> reject.
    assert admit_ls(TOK, [(1000, 200)], dec, 1000, 0.2)
    assert not admit_ls(TOK, [(1000, 200)], dec, 1100, 0.2)


def test_chunk_prefill_binary_search() -> None:
    dec = decode_shape([10, 10])
    # 10 + 0.1*(2 + q) <= 50 ms -> q = 398.
    assert max_chunk(TOK, dec, 1000, 0, 0.05, 4096) == 398
    assert max_chunk(TOK, dec, 100, 0, 0.05, 4096) == 100
    assert max_chunk(TOK, dec, 1000, 0, 0.05, 256) == 256
    assert max_chunk(TOK, dec, 1000, 0, 0.005, 4096) == 0


def test_be_decode_fcfs_until_the_first_misfit() -> None:
    shape = decode_shape([1000])  # 20 ms
    # bound 30 ms -> 1000 more KV tokens: 400 + 500 fit, 200 would make 1100.
    assert fit_decodes(CTX, shape, [400, 500, 200, 50], 0.03) == 2


def test_piggyback_admits_from_the_lowest_layer_up() -> None:
    shape = decode_shape([0])  # 10.01 ms
    # d = 4 layers; each piggybacked request adds 0.1 ms / 4 = 25 µs at its layer.
    # Slack 160 µs -> 6 requests: layer 0 takes 3, layer 1 takes 3, the rest none.
    base = TOK.step_s(shape)
    assert piggyback_admission(TOK, shape, [3, 3, 3, 3], base + 160e-6) == [3, 3, 0, 0]
    assert piggyback_admission(TOK, shape, [0, 5, 1, 0], base + 160e-6) == [0, 5, 1, 0]
    assert piggyback_admission(TOK, shape, [3, 3], base - 1e-6) == [0, 0]


def test_admission_costs_a_chunked_prefill_as_the_chunked_steps_it_runs() -> None:
    fixed = LinearStepModel(base_s=0.02, per_token_s=3e-4, per_ctx_token_s=0.0,
                            per_attn_pair_s=0.0)  # fmt: skip
    dec = decode_shape([])
    # one step of 1500 tokens: 0.47 s; six chunks of <= 256: 0.45 s of tokens + 6 x 0.02 s
    assert admit_ls(fixed, [], dec, 1500, 0.5)
    assert not admit_ls(fixed, [], dec, 1500, 0.5, chunk_size=256)
    assert admit_ls(fixed, [], dec, 1500, 0.6, chunk_size=256)
