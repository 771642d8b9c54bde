"""Token-by-token generation with a small decoder stack: RoPE, GQA, ragged prompts, KV caches.

    python examples/generate.py [--layers 4] [--d-model 256] [--heads 8] [--kv-heads 2]
                                [--prompts 4] [--new-tokens 32] [--threads N]
                                [--cache-dtypes float32,float16,int8]

A toy decoder-only language model with random weights: a token embedding, then per layer
RMSNorm -> mha_cy.MultiHeadAttention (rotary embeddings, fewer K/V heads than query heads)
-> residual -> RMSNorm -> a SiLU MLP in NumPy -> residual; the LM head is the embedding
transposed. Prompts of different lengths are right-padded into one batch and prefilled in one
call per layer with lengths= (each sequence caches only its own tokens), then every sequence
generates --new-tokens tokens greedily, one call per layer and token, each at its own position.

Printed: prefill and generation tokens/s for mha_cy with each cache dtype and for the NumPy
baseline (mha_cy.reference with the same weights), and how many generated tokens each run
shares with the baseline (random weights have near-ties, so a float16 or int8 cache may pick
another token now and then; the float32 cache should agree everywhere). tqdm, when installed,
shows a progress bar.

The MLP and the LM head run on NumPy's BLAS, held at one thread: its spinning thread pool and
mha_cy's OpenMP threads on the same cores slowed each other down (a 2-core machine: the
prefill took 8x longer).
"""
import argparse
import time

import numpy as np
import threadpoolctl

import mha_cy
import mha_cy.reference


def rms_norm(x, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


class ToyDecoder:
    """Random weights, shared by the mha_cy and the NumPy variant of the model (attention is
    the only part that differs)."""

    def __init__(self, vocab, d_model, heads, kv_heads, layers, seed=0):
        rng = np.random.default_rng(seed)
        d_head = d_model // heads

        def normal(*shape):
            return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        self.embedding = normal(vocab, d_model) * np.float32(np.sqrt(d_model))
        self.layers = []
        for _ in range(layers):
            attn = dict(q_weight=normal(heads * d_head, d_model),
                        k_weight=normal(kv_heads * d_head, d_model),
                        v_weight=normal(kv_heads * d_head, d_model),
                        out_weight=normal(d_model, heads * d_head))
            self.layers.append(dict(attn=attn, up=normal(4 * d_model, d_model),
                                    down=normal(d_model, 4 * d_model)))
        self.heads, self.kv_heads = heads, kv_heads

    def attention_modules(self, library):
        """One attention module per layer from `library` (mha_cy or mha_cy.reference)."""
        return [library.MultiHeadAttention.from_weights(
                    **layer["attn"], num_heads=self.heads, num_kv_heads=self.kv_heads,
                    rope=mha_cy.RoPE())
                for layer in self.layers]

    def forward(self, tokens, attention, caches, lengths=None):
        """Logits (B, L, vocab) of tokens (B, L), appending to one cache per layer."""
        h = self.embedding[tokens]
        for layer, attn, cache in zip(self.layers, attention, caches):
            h = h + attn(rms_norm(h), cache=cache, lengths=lengths)
            x = rms_norm(h) @ layer["up"].T
            h = h + (x / (1 + np.exp(-x))) @ layer["down"].T
        return rms_norm(h) @ self.embedding.T


def best_of(repeats, run):
    """run() -> (tokens, prefill s, generate s) `repeats` times; the fastest times."""
    results = [run() for _ in range(max(1, repeats))]
    return (results[0][0], min(r[1] for r in results), min(r[2] for r in results))


def generate(model, attention, prompts, new_tokens, cache_dtype=None, progress=None):
    """(generated tokens (B, new_tokens), prefill seconds, generation seconds)."""
    batch = len(prompts)
    lengths = np.array([len(p) for p in prompts])
    padded = np.zeros((batch, lengths.max()), dtype=np.int64)
    for b, p in enumerate(prompts):
        padded[b, :len(p)] = p
    dtype = {} if cache_dtype is None else {"dtype": cache_dtype}
    caches = [attn.new_cache(batch, int(lengths.max()) + new_tokens, **dtype)
              for attn in attention]
    t0 = time.perf_counter()
    logits = model.forward(padded, attention, caches, lengths=lengths)
    token = logits[np.arange(batch), lengths - 1].argmax(-1)
    t1 = time.perf_counter()
    out = [token]
    steps = range(new_tokens - 1)
    for _ in (steps if progress is None else progress(steps, leave=False)):
        token = model.forward(token[:, None], attention, caches)[:, -1].argmax(-1)
        out.append(token)
    t2 = time.perf_counter()
    return np.stack(out, axis=1), t1 - t0, t2 - t1


def _progress_bar():
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--prompts", type=int, default=4, help="sequences in the batch")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cache-dtypes", default="float32,float16,int8",
                        help="comma-separated cache dtypes for mha_cy")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per configuration; the fastest is shown (the first one "
                             "pays for thread start-up and first-touch page faults)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    for name in ("layers", "d_model", "heads", "kv_heads", "vocab", "prompts", "new_tokens",
                 "repeats", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {value}")
    if args.heads % args.kv_heads or args.d_model % args.heads:
        parser.error(f"--kv-heads ({args.kv_heads}) must divide --heads ({args.heads}), which "
                     f"must divide --d-model ({args.d_model})")
    args.cache_dtypes = args.cache_dtypes.split(",")
    bad = [n for n in args.cache_dtypes if n not in ("float32", "float16", "int8")]
    if bad:
        parser.error(f"--cache-dtypes takes float32, float16 and int8; got {bad}")

    model = ToyDecoder(args.vocab, args.d_model, args.heads, args.kv_heads, args.layers)
    rng = np.random.default_rng(1)
    # prompts of different lengths (ragged), from a few tokens to a few dozen
    prompts = [rng.integers(0, args.vocab, int(n))
               for n in np.linspace(3, 40, args.prompts).astype(int)]
    progress = None if args.no_progress else _progress_bar()
    # the prefill's logits give each sequence its first new token: the steps decode the rest
    n_prompt, n_new = sum(len(p) for p in prompts), args.prompts * (args.new_tokens - 1)
    print(f"{args.layers} layers, d_model {args.d_model}, {args.heads} query / {args.kv_heads} "
          f"K/V heads, RoPE; {args.prompts} prompts ({n_prompt} tokens, ragged), "
          f"{args.new_tokens} new tokens each; mha_cy threads: "
          f"{args.threads or mha_cy.get_num_threads()}")

    with threadpoolctl.threadpool_limits(1, user_api="blas"):
        return _compare(model, prompts, args, progress, n_prompt, n_new)


def _compare(model, prompts, args, progress, n_prompt, n_new):
    reference = model.attention_modules(mha_cy.reference)
    baseline, t_pre, t_gen = best_of(args.repeats, lambda: generate(
        model, reference, prompts, args.new_tokens, progress=progress))
    rows = [("numpy baseline", t_pre, t_gen, baseline)]
    with mha_cy.threads(args.threads):
        attention = model.attention_modules(mha_cy)
        for name in args.cache_dtypes:
            cache_dtype = name if name == "int8" else np.dtype(name)
            if cache_dtype == np.float32:
                cache_dtype = None                    # the module's own dtype
            try:
                tokens, t_pre, t_gen = best_of(args.repeats, lambda: generate(
                    model, attention, prompts, args.new_tokens, cache_dtype, progress))
            except (TypeError, ValueError) as exc:    # a cache dtype this build lacks
                print(f"mha_cy, {name} cache: not available ({exc})")
                continue
            rows.append((f"mha_cy, {name} cache", t_pre, t_gen, tokens))

    print(f"{'':24} {'prefill tok/s':>14} {'generate tok/s':>15} {'same tokens':>12}")
    for label, t_pre, t_gen, tokens in rows:
        same = int((tokens == baseline).sum())
        gen = f"{n_new / t_gen:15.0f}" if n_new else f"{'-':>15}"   # --new-tokens 1: no step
        print(f"{label:24} {n_prompt / t_pre:14.0f} {gen} {same:>6}/{baseline.size}")
    return rows


if __name__ == "__main__":
    main()
