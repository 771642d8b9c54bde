"""Benchmark workloads: shapes, deterministic inputs, and the work each call must do.

A workload is one attention problem, float32 throughout. ``kind`` says which entry point runs it:

- ``"mha"``: a full ``MultiHeadAttention`` forward, ``y = mha(x, key_padding_mask=..., is_causal=...)``:
  Q/K/V projections, attention, output projection. Self-attention, ``Lq == Lk == L``, ``E = H * D``.
- ``"sdpa"``: ``scaled_dot_product_attention(q, k, v, attn_mask=..., is_causal=...)`` alone, q
  ``(B, Hq, Lq, D)``, k/v ``(B, Hkv, Lk, D)``. The ``*_sdpa`` workloads are the attention part of
  the ``mha`` workload of the same name (same shapes, padding and causality), so attention can be
  compared apart from the projections (and across BLAS environments: it calls little BLAS).
- ``"decode"``: one incremental decoding step ``y = mha(x_step, cache=cache)``, x_step ``(B, 1, E)``,
  with a KV cache already holding ``Lk - 1`` tokens; the step appends its K/V and attends over all
  ``Lk`` cached tokens.

Work per call (the numbers recorded in ``benchmark.extra_info`` as ``flops`` and ``bytes``)
-------------------------------------------------------------------------------------------
FLOPs count multiply-adds as 2 and only the matrix products; softmax, masking, bias adds and
scaling are O(B*H*Lq*Lk) or smaller and are left out (as is customary, e.g. FlashAttention's counts).

- ``mha`` (self-attention, E = Hq*D, Hkv = Hq here)::

      projections = 2*B*L*E*E * 4                       # Q, K, V and the output projection
      attention   = 2*B*Hq*L*L*D * 2 = 4*B*L*L*E        # Q K^T and P V
      causal      : attention * (L + 1) / (2 * L)       # only the lower triangle is needed
      padding     : not discounted (the count is the dense problem; a kernel may skip padded keys)
      flops = projections + attention

  ``need_weights`` (encoder_weights) does the same products; it also writes the (B, Hq, L, L)
  weights, which is what its time beside ``encoder``'s measures.

  e.g. encoder_batched: 8*8*512*768^2 + 4*8*512^2*768 = 19.33 + 6.44 = 25.8 GFLOP.
  Bytes (the unavoidable traffic, for the record; these workloads are compute-bound)::

      bytes = 4 * (B*L*E [x] + 4*E*E + 4*E [weights, biases] + B*L*E [y] + B*L [mask, bool])

- ``sdpa``: ``flops = 4*B*Hq*Lq*Lk*D`` (causal: times (L + 1) / (2 * L), as above). Decoding
  over a cache (decode_gqa) is memory-bound: the K/V cache is read once, nothing is reused::

      bytes = 4 * (2*B*Hkv*Lk*D [K, V] + 2*B*Hq*Lq*D [q, o])

  decode_gqa: 4*8*2048*128*4*2 = 64 MiB of K/V per call, 134 MFLOP.

- ``decode`` (one step with projections, E = d_model, Hq*D and Hkv*D the projection widths)::

      flops = 2*B*E*(Hq*D + 2*Hkv*D)  [Q, K, V of the new token]
            + 2*B*(Hq*D)*E            [output projection]
            + 4*B*Hq*Lk*D             [attention over the Lk cached tokens]
      bytes = 4 * (E*(Hq*D + 2*Hkv*D) + Hq*D*E + Hq*D + 2*Hkv*D + E   [weights, biases]
                   + 2*B*Hkv*Lk*D                                     [K/V cache read]
                   + 2*B*Hkv*D                                        [K/V of the step, written]
                   + 2*B*E)                                           [x_step, y]

  decode_proj: 160 MiB of weights + 64 MiB of cache = 224 MiB per call: memory-bound.

  A ragged batch (``lengths``: sequence b holds lengths[b] cached tokens before the step) and a
  sliding window (``window``: the step sees only its last ``window`` keys, and the kernels skip
  the others) read only the keys each sequence really attends to; ``B*Lk`` above becomes::

      keys = sum_b min(lengths[b] + 1, window)     # lengths[b] = Lk - 1 when not ragged

  in the attention FLOPs (``4*Hq*D*keys``) and in the cache read (``2*Hkv*keys*D*4`` bytes).
  decode_ragged: 2048 + 1501 + 1001 + 513 = 5063 keys, 39.6 MiB of cache (not 4 x 2048 = 64 MiB);
  decode_window: 4096 of 8192 keys, 32 MiB of a 64 MiB cache.

``bound`` says which roof applies: ``"compute"`` workloads are reported in GFLOP/s against the
measured sgemm rate, ``"memory"`` workloads in GB/s against the measured copy bandwidth.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

__all__ = ["Workload", "WORKLOADS", "get", "make_data"]


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    kind: str  # "mha" | "sdpa" | "decode"
    B: int
    Lq: int
    Lk: int
    E: int  # d_model (for "sdpa": Hq * D, informational)
    Hq: int
    Hkv: int
    D: int
    causal: bool = False
    padding: bool = False  # key padding: last 25% of keys padded in the first half of the batch
    need_weights: bool = False  # "mha": also return the per-head weights (B, Hq, Lq, Lk)
    bound: str = "compute"
    # > 1: the harness prepares at least this many copies of the workload (each with its own
    # K/V, or its own cache), and more where the L3 is large (roof.copies_beyond_l3), and the
    # timed calls rotate over them, as a model's layers do: a working set several times the
    # L3, so that a decode step reads DRAM rather than what the last call left in cache (bytes
    # and flops stay per call)
    layers: int = 1
    cache_dtype: str = "float32"  # "decode": the KV cache's storage (new_cache(dtype=...))
    # "decode": tokens each sequence holds before the step (a ragged batch, prefilled with
    # lengths=); None = Lk - 1 for every sequence. Lk stays the cache's capacity (max_len)
    lengths: tuple[int, ...] | None = None
    window: int | None = None  # "decode": MultiHeadAttention(window=...), None = unlimited
    description: str = ""

    def __post_init__(self):
        if self.lengths is not None and (len(self.lengths) != self.B
                                         or not 0 <= min(self.lengths) <= max(self.lengths) < self.Lk):
            raise ValueError(f"{self.name}: lengths must be {self.B} ints in [0, Lk - 1 = "
                             f"{self.Lk - 1}]; got {self.lengths}")

    @property
    def cached(self) -> tuple[int, ...]:
        """Tokens of each sequence in the cache before the step."""
        return self.lengths if self.lengths is not None else (self.Lk - 1,) * self.B

    @property
    def keys_read(self) -> int:
        """Keys the step attends to, summed over the batch (its own cached ones and the new
        one, the last ``window`` of them with a window); B * Lk for the sdpa workloads."""
        if self.kind != "decode":
            return self.B * self.Lk
        window = self.window or self.Lk
        return sum(min(n + 1, window) for n in self.cached)

    @property
    def flops(self) -> int:
        B, Lq, Lk, E, Hq, Hkv, D = self.B, self.Lq, self.Lk, self.E, self.Hq, self.Hkv, self.D
        attention = 4 * B * Hq * Lq * Lk * D
        if self.causal:  # Lq == Lk in the causal workloads
            attention = attention * (Lq + 1) // (2 * Lq)
        if self.kind == "mha":
            return 2 * B * Lq * E * E * 4 + attention
        if self.kind == "sdpa":
            return attention
        if self.kind == "decode":
            return 2 * B * E * (Hq * D + 2 * Hkv * D) + 2 * B * Hq * D * E + 4 * Hq * self.keys_read * D
        raise ValueError(f"unknown kind {self.kind!r}")

    @property
    def bytes(self) -> int:
        B, Lq, Lk, E, Hq, Hkv, D = self.B, self.Lq, self.Lk, self.E, self.Hq, self.Hkv, self.D
        if self.kind == "mha":
            L = Lq
            return 4 * (2 * B * L * E + 4 * E * E + 4 * E) + (B * L if self.padding else 0)
        if self.kind == "sdpa":
            return 4 * (2 * B * Hkv * Lk * D + 2 * B * Hq * Lq * D)
        if self.kind == "decode":
            weights = E * (Hq * D + 2 * Hkv * D) + Hq * D * E + Hq * D + 2 * Hkv * D + E
            # a float16 cache reads 2 bytes per value, an int8 one 1 plus a float32 scale per
            # (sequence, K/V head, position) for K and for V
            per_value = {"float32": 4, "float16": 2, "int8": 1}[self.cache_dtype]
            cache = 2 * Hkv * self.keys_read * (D * per_value + (4 if self.cache_dtype == "int8" else 0))
            return 4 * (weights + 2 * B * Hkv * D + 2 * B * E) + cache
        raise ValueError(f"unknown kind {self.kind!r}")

    def info(self) -> dict:
        """The shape fields, for ``extra_info`` and the report."""
        d = dataclasses.asdict(self)
        d.pop("description")
        d["flops"] = self.flops
        d["bytes"] = self.bytes
        return d


_ENCODER = dict(B=1, Lq=128, Lk=128, E=768, Hq=12, Hkv=12, D=64)
_ENCODER_BATCHED = dict(B=8, Lq=512, Lk=512, E=768, Hq=12, Hkv=12, D=64, padding=True)
_LONG_CAUSAL = dict(B=1, Lq=4096, Lk=4096, E=512, Hq=8, Hkv=8, D=64, causal=True)

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload("encoder", "mha", **_ENCODER,
                 description="batch 1, 128 tokens, d_model 768, 12 heads, no mask"),
        Workload("encoder_weights", "mha", **_ENCODER, need_weights=True,
                 description="encoder with need_weights=True: the output and the per-head "
                             "weights (B, 12, 128, 128)"),
        Workload("encoder_batched", "mha", **_ENCODER_BATCHED,
                 description="batch 8, 512 tokens, d_model 768, 12 heads, key padding mask "
                             "(last 25% of keys padded in half the batch)"),
        Workload("long_causal", "mha", **_LONG_CAUSAL,
                 description="batch 1, 4096 tokens, d_model 512, 8 heads, causal"),
        Workload("encoder_sdpa", "sdpa", **_ENCODER,
                 description="the attention of encoder alone: q, k, v (1, 12, 128, 64)"),
        Workload("encoder_batched_sdpa", "sdpa", **_ENCODER_BATCHED,
                 description="the attention of encoder_batched alone: q, k, v (8, 12, 512, 64), "
                             "key padding as a bool attn_mask (8, 1, 1, 512)"),
        Workload("long_causal_sdpa", "sdpa", **_LONG_CAUSAL,
                 description="the attention of long_causal alone: q, k, v (1, 8, 4096, 64), causal"),
        Workload("decode_gqa", "sdpa", B=4, Lq=1, Lk=2048, E=4096, Hq=32, Hkv=8, D=128,
                 bound="memory",
                 description="scaled_dot_product_attention of 1 new token over a 2048-token K/V "
                             "cache, batch 4, 32 query heads, 8 KV heads, head_dim 128"),
        Workload("decode_proj", "decode", B=4, Lq=1, Lk=2048, E=4096, Hq=32, Hkv=8, D=128,
                 bound="memory",
                 description="one decode step with projections, d_model 4096, cache of 2047 "
                             "tokens + the new one, batch 4, 32 query heads, 8 KV heads"),
        Workload("decode_dram", "sdpa", B=4, Lq=1, Lk=2048, E=4096, Hq=32, Hkv=8, D=128,
                 bound="memory", layers=8,
                 description="decode_gqa over 8 or more caches in turn (3 x L3 or more): "
                             "the step's DRAM read rate"),
        Workload("decode_mqa_32k", "sdpa", B=1, Lq=1, Lk=32768, E=1024, Hq=8, Hkv=1, D=128,
                 bound="memory", layers=8,
                 description="one sequence, 8 query heads over one K/V head of 32k tokens "
                             "(32 MiB), 8 or more such caches in turn: split-K must keep every core "
                             "streaming"),
        # d_model 64: the step's weights are 2.5 MiB against a 64 MiB float32 cache (at d_model
        # 256 they were 10 MiB, 14% of the float32 step's bytes and 24% of the float16 one's, so
        # the step's time measured the weights' read as much as the cache format's)
        *[Workload(f"decode_cache_{short}", "decode", B=4, Lq=1, Lk=2048, E=64, Hq=32,
                   Hkv=8, D=128, bound="memory", cache_dtype=dtype, layers=8,
                   description=f"one decode step over a {dtype} KV cache "
                               f"(new_cache(dtype=...)) of 2047 tokens + the new one, batch 4, "
                               "32 query / 8 KV heads, head_dim 128; d_model 64 so that the "
                               "cache, not the weights, is read; 8 or more such caches in turn")
          for short, dtype in (("f32", "float32"), ("f16", "float16"), ("int8", "int8"))],
        Workload("decode_ragged", "decode", B=4, Lq=1, Lk=2048, E=256, Hq=32, Hkv=8, D=128,
                 bound="memory", layers=8, lengths=(2047, 1500, 1000, 512),
                 description="one decode step of a ragged batch: 4 sequences holding 2047, 1500, "
                             "1000 and 512 tokens of a 2048-token cache (prefilled with lengths=), "
                             "each appends at its own position and reads only its own tokens; "
                             "32 query / 8 KV heads, head_dim 128, d_model 256; 8 or more such "
                             "caches in turn"),
        Workload("decode_window", "decode", B=1, Lq=1, Lk=8192, E=256, Hq=32, Hkv=8, D=128,
                 bound="memory", layers=8, window=4096,
                 description="one decode step with a 4096-token sliding window (Mistral) over a "
                             "cache of 8191 tokens + the new one: only the window's keys are "
                             "read (32 of 64 MiB); 32 query / 8 KV heads, head_dim 128, "
                             "d_model 256; 8 or more such caches in turn"),
        Workload("decode_small", "decode", B=1, Lq=1, Lk=17, E=64, Hq=4, Hkv=4, D=16,
                 description="one decode step of a small layer (d_model 64, 4 heads) over 16 "
                             "cached tokens: the per-call cost of a step"),
        Workload("sentence", "mha", B=1, Lq=32, Lk=32, E=384, Hq=12, Hkv=12, D=32,
                 description="batch 1, 32 tokens, d_model 384, 12 heads: a sentence through a "
                             "MiniLM-size layer (sentence embeddings, rerankers)"),
        Workload("tiny", "mha", B=1, Lq=16, Lk=16, E=64, Hq=4, Hkv=4, D=16,
                 description="batch 1, 16 tokens, d_model 64, 4 heads (per-call overhead)"),
        Workload("threads", "mha", **_ENCODER_BATCHED,
                 description="encoder_batched at 1 and at 2 (or --mha-threads) threads"),
    ]
}


def get(name: str) -> Workload:
    return WORKLOADS[name]


@functools.lru_cache(maxsize=1)
def make_data(name: str, seed: int = 0) -> dict:
    """Deterministic float32 inputs of a workload (cached: the last workload only).

    Weights follow ``nn.Linear``'s layout ``(out_features, in_features)`` and scale
    (std ~ 1/sqrt(in_features)), so activations stay O(1) and the fp32 tolerances mean something.

    Keys: ``mha``: wq wk wv wo bq bk bv bo x kpm (kpm: bool (B, L), True = padding, or None).
    ``sdpa``: q k v kpm, and ``attn_mask``: ``~kpm`` as bool (B, 1, 1, Lk), True = may attend, or
    None. ``decode``: the weights, ``prompt`` (B, Lk - 1, E) to prefill a cache with,
    ``x`` (B, 1, E) the step, and ``k_prefix``/``v_prefix`` (B, Hkv, Lk - 1, D), the K/V of the prompt
    for implementations that are handed a cache directly (computed here once with NumPy). A
    ragged workload's prompt is right-padded: sequence b's tokens past ``lengths[b]`` are
    padding (random values too: their K/V in ``k_prefix``/``v_prefix`` must stay hidden).
    """
    w = WORKLOADS[name]
    rng = np.random.default_rng(seed + sum(map(ord, w.name)))

    def normal(shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    kpm = None
    if w.padding:
        kpm = np.zeros((w.B, w.Lk), dtype=bool)
        kpm[: w.B // 2, w.Lk - w.Lk // 4:] = True
    if w.kind == "sdpa":
        return dict(q=normal((w.B, w.Hq, w.Lq, w.D)),
                    k=normal((w.B, w.Hkv, w.Lk, w.D)),
                    v=normal((w.B, w.Hkv, w.Lk, w.D)),
                    kpm=kpm, attn_mask=None if kpm is None else ~kpm[:, None, None, :])

    E, HqD, HkvD = w.E, w.Hq * w.D, w.Hkv * w.D
    d = dict(wq=normal((HqD, E), E ** -0.5), wk=normal((HkvD, E), E ** -0.5),
             wv=normal((HkvD, E), E ** -0.5), wo=normal((E, HqD), HqD ** -0.5),
             bq=normal(HqD, 0.1), bk=normal(HkvD, 0.1), bv=normal(HkvD, 0.1), bo=normal(E, 0.1))
    if w.kind == "mha":
        d["x"] = normal((w.B, w.Lq, E))
        d["kpm"] = kpm
        return d
    # decode
    P = w.Lk - 1
    d["prompt"] = normal((w.B, P, E))
    d["x"] = normal((w.B, 1, E))
    for name_, wt, b in (("k_prefix", d["wk"], d["bk"]), ("v_prefix", d["wv"], d["bv"])):
        kv = d["prompt"].reshape(-1, E) @ wt.T + b
        d[name_] = np.ascontiguousarray(kv.reshape(w.B, P, w.Hkv, w.D).transpose(0, 2, 1, 3))
    return d
