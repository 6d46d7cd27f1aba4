"""The sim engine's sizes and switches (`SimEngineConfig`): its own planner's limits, its KV
pool, the layer boundaries a step can be cut at and the bytes an emulated request carries."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SimEngineConfig:
    model_name: str = "tidal-sim"  # the model id clients ask for
    max_model_len: int = 8192  # prompt + output tokens per request
    max_num_seqs: int = 256  # requests in one step (own planner)
    max_batch_tokens: int = 2048  # prefill + decode tokens per step (own planner)
    chunk_size: int = 2048  # most prefill tokens one request gets per step (own planner)
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int = 8192  # KV pool size, in blocks
    num_layers: int = 30  # layer boundaries a step can be cut at (SmolLM2-135M has 30)
    # bytes of KV per token: 30 layers * (k, v) * 3 KV heads * 64 dims * 2 bytes (SmolLM2, bf16)
    kv_bytes_per_token: int = 23_040
    # bytes of emulated KV an exported request really carries per token (-1: kv_bytes_per_token).
    # Fewer (0: none) keeps a small host from spending its cores copying and hashing migration
    # payloads that a real cluster moves over its accelerator links (`tidal bench replay`).
    kv_payload_bytes_per_token: int = -1
    realtime: bool = False  # step() blocks for the emulated step time (cut at layer boundaries)
    tokenizer: str = ""  # "" = the embedded SmolLM2's; a GGUF or HF dir; "bytes" = SimTokenizer
    checkpoint_host_bytes: int = 0  # host memory for offline KV checkpoints (0: none)

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if min(self.max_num_seqs, self.max_batch_tokens, self.chunk_size) < 1:
            raise ValueError("max_num_seqs, max_batch_tokens and chunk_size must be >= 1")
        if min(self.block_size, self.num_kv_blocks, self.num_layers) < 1:
            raise ValueError("block_size, num_kv_blocks and num_layers must be >= 1")
        if self.checkpoint_host_bytes < 0:
            raise ValueError("checkpoint_host_bytes must be >= 0 (0: no checkpoints)")
        if self.kv_bytes_per_token < 0:
            raise ValueError("kv_bytes_per_token must be >= 0")
        if self.kv_payload_bytes_per_token < -1:
            raise ValueError("kv_payload_bytes_per_token must be >= 0, or -1")
        if self.num_kv_blocks * self.block_size < self.max_model_len:
            raise ValueError("the KV pool cannot hold even one max_model_len request")
