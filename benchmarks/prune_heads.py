"""How much faster a pruned module is: CPU time (time.process_time) on one thread, full and
pruned modules measured in interleaved rounds, medians. Run: python benchmarks/prune_heads.py

- an encoder layer (BERT-base size, batch 4 x 256): time falls with the heads removed;
- a GQA decode step (8 query / 2 K/V heads of 128, 2048 cached tokens, batch 4): removing
  query heads only saves compute, the K/V cache streamed stays the same; removing a whole group
  (its K/V head goes) halves the cache read.
"""
import time

import numpy as np

import mha_cy


def medians(cases, rounds=9, calls=3):
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            fn()
            start = time.process_time()
            for _ in range(calls):
                fn()
            times[name].append((time.process_time() - start) / calls)
    return {name: float(np.median(t)) for name, t in times.items()}


def main():
    mha_cy.set_num_threads(1)
    rng = np.random.default_rng(0)
    encoder = mha_cy.MultiHeadAttention(768, 12, seed=0)
    x = rng.standard_normal((4, 256, 768)).astype(np.float32)
    modules = {"12 heads": encoder, "pruned to 9": encoder.prune_heads([0, 3, 7]),
               "pruned to 6": encoder.prune_heads(range(6))}
    cases = {name: (lambda m=m: m(x)) for name, m in modules.items()}
    for name, t in medians(cases).items():
        print(f"encoder 4 x 256, E 768, {name:28s} {t * 1e3:8.2f} ms CPU")

    decoder = mha_cy.MultiHeadAttention(1024, 8, num_kv_heads=2, seed=0)
    prompt = rng.standard_normal((4, 2048, 1024)).astype(np.float32)
    step = rng.standard_normal((4, 1, 1024)).astype(np.float32)
    modules = {"8/2 heads (groups 4+4)": decoder,
               "without 1, 5, 6 (groups 3+2)": decoder.prune_heads([1, 5, 6]),
               "without 0-3 (one group of 4)": decoder.prune_heads([0, 1, 2, 3])}
    cases = {}
    for name, m in modules.items():
        cache = m.new_cache(4, 2049)
        m(prompt, cache=cache)

        def decode(m=m, cache=cache):
            m(step, cache=cache)
            cache.truncate(2048)
        cases[name] = decode
    for name, t in medians(cases, calls=20).items():
        print(f"decode step, 2048 cached, {name:28s} {t * 1e6:8.1f} us CPU")


if __name__ == "__main__":
    main()
