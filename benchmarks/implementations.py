"""The implementations compared by the benchmarks, each behind one small interface.

``prepare(workload, data, threads)`` builds everything a call needs (modules, sessions, tensors,
prefilled caches) outside the timing and returns a ``Prepared``: ``run(*args)`` is the one call that
is timed, ``setup()`` (optional) makes the fresh per-round state that a stateful call consumes (a
KV cache that the step appends to), and ``to_numpy`` turns the result into an array in the
baseline's layout for the output check.

- ``numpy``: ``mha_cy.reference``, the pure-NumPy baseline (and the oracle of the output checks).
- ``mha_cy``: this library.
- ``torch_sdpa``: ``F.linear`` + ``F.scaled_dot_product_attention`` + ``F.linear``, in
  ``torch.inference_mode()``; GQA through ``enable_gqa=True`` (no repeated K/V).
- ``torch_mha``: ``nn.MultiheadAttention(batch_first=True)``, ``need_weights=False``; it has no
  grouped KV heads, so it sits out the GQA workloads.
- ``onnxruntime``: an ONNX graph built with ``onnx.helper``: MatMul projections around the
  ``com.microsoft`` ``MultiHeadAttention`` contrib op (MHA workloads) or ``GroupQueryAttention``
  (GQA workloads, with the KV cache shared between ``past_*`` and ``present_*`` through IOBinding,
  as ORT's generation loop does, so no cache copy is timed); for ``mha`` and ``sdpa`` workloads
  also the standard ONNX ``Attention`` op (opset 23): prepare times both variants briefly and
  keeps the faster (the notes say which, with both times).
- ``openvino``: a graph built with OpenVINO's Python opset API (MatMul projections + bias Add,
  Reshape/Transpose into heads, ``ScaledDotProductAttention``, Transpose back, MatMul), compiled
  for "CPU" in f32 (``INFERENCE_PRECISION_HINT``; the default may be bf16), with
  ``INFERENCE_NUM_THREADS`` and the latency hint; the notes list the layer types the CPU plugin
  actually ran (it may decompose SDPA into MatMul + Softmax).

Peers that are not importable are reported as unavailable (the tests skip with the reason).
All implementations run with the same thread count: ``thread_limits(n)`` sets NumPy's BLAS and
every OpenMP runtime (threadpoolctl), ``torch.set_num_threads`` and ``mha_cy.threads``; ORT gets
``intra_op_num_threads = n`` (and ``inter_op_num_threads = 1``) in its session.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import itertools
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np
import threadpoolctl

import mha_cy
import mha_cy.reference
import roof

# Peers are imported here, at collection time, before any thread limit is entered, so that
# threadpoolctl sees their BLAS/OpenMP libraries.
try:
    import torch
    import torch.nn.functional as F
except ImportError as exc:  # pragma: no cover - depends on the environment
    torch = None
    _TORCH_ERROR = f"torch is not importable ({exc})"
try:
    import onnx
    import onnx.helper
    import onnx.numpy_helper
    import onnxruntime as ort
except ImportError as exc:  # pragma: no cover
    ort = None
    _ORT_ERROR = f"onnxruntime/onnx is not importable ({exc})"
try:
    import openvino as ov
except ImportError as exc:  # pragma: no cover
    ov = None
    _OV_ERROR = f"openvino is not importable ({exc})"

PREFILL_CHUNK = 256  # tokens per prefill call (bounds the baseline's Lq x Lk score tensor)


@contextlib.contextmanager
def thread_limits(n: int):
    """Run everything inside with ``n`` threads: BLAS, OpenMP, torch and mha_cy."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(threadpoolctl.threadpool_limits(limits=n))
        if torch is not None:
            old = torch.get_num_threads()
            torch.set_num_threads(n)
            stack.callback(torch.set_num_threads, old)
        stack.enter_context(mha_cy.threads(n))
        yield


@dataclasses.dataclass
class Prepared:
    run: Callable[..., Any]
    setup: Callable[[], tuple] | None = None  # -> (args, kwargs), fresh state for one round
    to_numpy: Callable[[Any], np.ndarray] = np.asarray
    notes: str = ""

    def call_once(self):
        args, kwargs = self.setup() if self.setup is not None else ((), {})
        return self.to_numpy(self.run(*args, **kwargs))


def _joined(result) -> np.ndarray:
    """(output, weights) as one flat array, so that one output check covers both."""
    out, weights = result
    return np.concatenate([np.ravel(np.asarray(out)), np.ravel(np.asarray(weights))])


def _fastest(variants: list) -> Prepared:
    """The faster of several ``(label, Prepared)`` ways to run a workload (a short median)."""
    timed = []
    for label, prepared in variants:
        prepared.run()  # warm-up
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            prepared.run()
            times.append(time.perf_counter() - t0)
        timed.append((statistics.median(times), label, prepared))
    timed.sort(key=lambda t: t[0])
    best = timed[0][2]
    if len(timed) > 1:
        best.notes += "; fastest of " + ", ".join(f"{label} {t * 1e3:.3g} ms" for t, label, _ in timed)
    return best


def rotating(w, impl, data, threads):
    """Copies of the prepared call, each over its own K/V (sdpa: copies of the same values, so
    every copy gives the baseline's output) or its own prefilled cache (decode); each timed call
    takes the next copy. w.layers copies at least, and enough that the calls read BEYOND_L3
    times this machine's L3 in a round (8 x 64 MiB is 16 x the L3 of an EPYC, 1.1 x a Xeon's)."""
    n = roof.copies_beyond_l3(w.bytes, minimum=w.layers)
    copies = [impl.prepare(w, {**data, "k": data["k"].copy(), "v": data["v"].copy()}
                           if w.kind == "sdpa" else data, threads)
              for _ in range(n)]
    first = copies[0]
    order = itertools.cycle(range(n))
    notes = f"{first.notes}; {n} copies in turn ({n * w.bytes / 2 ** 20:.0f} MiB read per round)"
    if first.setup is None:
        return Prepared(lambda: copies[next(order)].run(),
                        to_numpy=first.to_numpy, notes=notes)

    def setup():
        i = next(order)
        args, kwargs = copies[i].setup()
        return (i, *args), kwargs
    return Prepared(lambda i, *args, **kwargs: copies[i].run(*args, **kwargs),
                    setup=setup, to_numpy=first.to_numpy, notes=notes)


class Implementation:
    name = ""
    threads_at_prepare = False  # True: the prepared object depends on the thread count

    def unavailable(self) -> str | None:
        return None

    def unsupported(self, w) -> str | None:
        return None

    def unsupported_here(self, w) -> str | None:
        """unsupported(w), and the cache dtypes only mha_cy's API takes."""
        if w.cache_dtype != "float32" and not isinstance(self, _MhaCyAPI):
            return f"a {w.cache_dtype} KV cache through this API is not built here"
        return self.unsupported(w)

    def prepare(self, w, data: dict, threads: int) -> Prepared:
        raise NotImplementedError


# --------------------------------------------------------------------------------------------
# mha_cy and its NumPy reference: the same API


class _MhaCyAPI(Implementation):
    module: Any = None

    def _from_weights(self, w, d):
        return self.module.MultiHeadAttention.from_weights(
            d["wq"], d["wk"], d["wv"], d["wo"], num_heads=w.Hq, num_kv_heads=w.Hkv,
            q_bias=d["bq"], k_bias=d["bk"], v_bias=d["bv"], out_bias=d["bo"], window=w.window)

    def prepare(self, w, d, threads):
        causal = w.causal
        if w.kind == "sdpa":
            sdpa = self.module.scaled_dot_product_attention
            q, k, v, mask = d["q"], d["k"], d["v"], d["attn_mask"]
            return Prepared(lambda: sdpa(q, k, v, attn_mask=mask, is_causal=causal),
                            notes="scaled_dot_product_attention(attn_mask=, is_causal=), GQA K/V as is")
        mha = self._from_weights(w, d)
        if w.kind == "mha":
            x, kpm, weights = d["x"], d["kpm"], w.need_weights
            return Prepared(lambda: mha(x, key_padding_mask=kpm, is_causal=causal, need_weights=weights),
                            to_numpy=_joined if weights else np.asarray,
                            notes="MultiHeadAttention.from_weights(...)(x, key_padding_mask=, is_causal="
                                  + (", need_weights=True)" if weights else ")"))
        # decode: prefill a cache through the API, then time one step; the cache is rewound per round
        cache = self._prefilled(w, d, mha)
        x, cached = d["x"], w.cached
        ragged = w.lengths is not None
        rewind = np.array(cached, dtype=np.int64) if ragged else cached[0]
        if hasattr(cache, "truncate"):
            # the public rewind: forget the step's token, O(1), in pedantic setup (not timed)
            def setup():
                cache.truncate(rewind)
                return (cache,), {}
            how = f"cache.truncate({list(cached) if ragged else cached[0]}) before each round"
        else:
            def setup():
                return (copy.deepcopy(cache),), {}
            how = "a fresh copy of the prefilled cache per round"
        filled = (f"{list(cached)} tokens (lengths=: right-padded prompts)" if ragged
                  else f"{cached[0]} tokens")
        notes = (f"mha(x_step, cache=c), c prefilled with {filled} through the API; {how} "
                 "(pedantic setup, not timed)")
        if w.window is not None:
            notes = f"MultiHeadAttention(window={w.window}); " + notes
        return Prepared(lambda c: mha(x, cache=c), setup=setup, notes=notes)

    # the prefilled cache of the last decode workload, per implementation: a rotating workload
    # (w.layers) prepares several copies, and an 8k-token prefill through the NumPy baseline
    # takes a while, so the copies after the first are cache.copy() of one prefill
    _last_prefill: tuple | None = None

    def _prefilled(self, w, d, mha):
        if self._last_prefill is not None and self._last_prefill[0] == w.name:
            return self._last_prefill[1].copy()
        self._last_prefill = None  # free the previous workload's cache first
        cache = (mha.new_cache(w.B, w.Lk) if w.cache_dtype == "float32"
                 else mha.new_cache(w.B, w.Lk, dtype=w.cache_dtype))
        prompt = d["prompt"]
        lengths = None if w.lengths is None else np.array(w.lengths, dtype=np.int64)
        for start in range(0, prompt.shape[1], PREFILL_CHUNK):
            chunk = prompt[:, start:start + PREFILL_CHUNK]
            if lengths is None:
                mha(chunk, cache=cache)
            else:  # each sequence appends only its real tokens of this chunk
                mha(chunk, cache=cache, lengths=np.clip(lengths - start, 0, chunk.shape[1]))
        assert cache.lengths.tolist() == list(w.cached), (cache.lengths, w.cached)
        if hasattr(cache, "copy"):
            self._last_prefill = (w.name, cache)
            return cache.copy()
        return cache


class NumpyBaseline(_MhaCyAPI):
    name = "numpy"
    module = mha_cy.reference


class MhaCy(_MhaCyAPI):
    name = "mha_cy"
    module = mha_cy


# --------------------------------------------------------------------------------------------
# PyTorch


def _t(a):
    return None if a is None else torch.from_numpy(np.ascontiguousarray(a))


class _Torch(Implementation):
    def unavailable(self):
        return None if torch is not None else _TORCH_ERROR


def _no_weights(w, who):
    return f"{who} returns no attention weights" if w.need_weights else None


class TorchSDPA(_Torch):
    name = "torch_sdpa"

    def unsupported(self, w):
        return _no_weights(w, "F.scaled_dot_product_attention")

    def prepare(self, w, d, threads):
        B, Hq, Hkv, D = w.B, w.Hq, w.Hkv, w.D
        if w.kind == "sdpa":
            q, k, v, mask = _t(d["q"]), _t(d["k"]), _t(d["v"]), _t(d["attn_mask"])
            gqa, causal = Hq != Hkv, w.causal

            @torch.inference_mode()
            def run():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                      enable_gqa=gqa)
            return Prepared(run, to_numpy=lambda o: o.numpy(),
                            notes="F.scaled_dot_product_attention(attn_mask=, is_causal=, enable_gqa=)")

        wq, wk, wv, wo = (_t(d[n]) for n in ("wq", "wk", "wv", "wo"))
        bq, bk, bv, bo = (_t(d[n]) for n in ("bq", "bk", "bv", "bo"))
        x = _t(d["x"])
        if w.kind == "mha":
            L, E, causal = w.Lq, w.E, w.causal
            # bool attn_mask: True = may attend (F.sdpa's convention); built once, outside the timing
            mask = None if d["kpm"] is None else _t(~d["kpm"])[:, None, None, :]

            @torch.inference_mode()
            def run():
                q = F.linear(x, wq, bq).view(B, L, Hq, D).transpose(1, 2)
                k = F.linear(x, wk, bk).view(B, L, Hkv, D).transpose(1, 2)
                v = F.linear(x, wv, bv).view(B, L, Hkv, D).transpose(1, 2)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
                return F.linear(o.transpose(1, 2).reshape(B, L, Hq * D), wo, bo)
            return Prepared(run, to_numpy=lambda o: o.numpy(),
                            notes="F.linear x3 + F.scaled_dot_product_attention + F.linear"
                                  + ("; key padding as a bool attn_mask (B,1,1,L)" if mask is not None else ""))

        # decode: a preallocated cache holding the prompt's K/V; the step writes its K/V at
        # position P (the same values every round, so rounds need no reset) and attends over P+1.
        P = w.Lk - 1
        kc = torch.zeros(B, Hkv, w.Lk, D)
        vc = torch.zeros(B, Hkv, w.Lk, D)
        kc[:, :, :P] = _t(d["k_prefix"])
        vc[:, :, :P] = _t(d["v_prefix"])
        notes = ("F.linear x3, K/V written into a preallocated cache, "
                 "F.scaled_dot_product_attention(enable_gqa=True), F.linear")
        if w.lengths is not None:
            return self._ragged_step(w, x, (wq, wk, wv, wo, bq, bk, bv, bo), kc, vc, notes)
        # a sliding window: the step's query sees the last `window` keys, so a user slices them
        first = 0 if w.window is None else max(0, P + 1 - w.window)
        if w.window is not None:
            notes += f"; window: K/V sliced to the last {P + 1 - first} keys"

        @torch.inference_mode()
        def run():
            q = F.linear(x, wq, bq).view(B, 1, Hq, D).transpose(1, 2)
            kc[:, :, P:P + 1] = F.linear(x, wk, bk).view(B, 1, Hkv, D).transpose(1, 2)
            vc[:, :, P:P + 1] = F.linear(x, wv, bv).view(B, 1, Hkv, D).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, kc[:, :, first:P + 1], vc[:, :, first:P + 1],
                                               enable_gqa=True)
            return F.linear(o.transpose(1, 2).reshape(B, 1, Hq * D), wo, bo)
        return Prepared(run, to_numpy=lambda o: o.numpy(), notes=notes)

    @staticmethod
    def _ragged_step(w, x, weights, kc, vc, notes):
        """A ragged batch: sequence b writes its step's K/V at its own position lengths[b] and
        attends over its first lengths[b] + 1 slots; a bool attn_mask (B, 1, 1, max + 1) hides
        the rest (the padding's K/V that the preallocated cache holds there). x, weights: the
        step's tensors as prepare made them (wq, wk, wv, wo, bq, bk, bv, bo)."""
        B, Hq, Hkv, D = w.B, w.Hq, w.Hkv, w.D
        wq, wk, wv, wo, bq, bk, bv, bo = weights
        pos = torch.tensor(w.cached)
        rows = torch.arange(B)
        stop = max(w.cached) + 1
        mask = (torch.arange(stop)[None, :] <= pos[:, None])[:, None, None, :]

        @torch.inference_mode()
        def run():
            q = F.linear(x, wq, bq).view(B, 1, Hq, D).transpose(1, 2)
            kc[rows, :, pos] = F.linear(x, wk, bk).view(B, Hkv, D)
            vc[rows, :, pos] = F.linear(x, wv, bv).view(B, Hkv, D)
            o = F.scaled_dot_product_attention(q, kc[:, :, :stop], vc[:, :, :stop], attn_mask=mask,
                                               enable_gqa=True)
            return F.linear(o.transpose(1, 2).reshape(B, 1, Hq * D), wo, bo)
        return Prepared(run, to_numpy=lambda o: o.numpy(),
                        notes=notes.replace("into a preallocated cache",
                                            "into a preallocated cache at each sequence's position")
                        + f"; ragged: a bool attn_mask (B,1,1,{stop}) hides each sequence's unused slots")


class TorchMHA(_Torch):
    name = "torch_mha"

    def unsupported(self, w):
        if w.kind != "mha" or w.Hq != w.Hkv:
            return "nn.MultiheadAttention has no grouped KV heads (GQA) nor a KV cache"
        return None

    def prepare(self, w, d, threads):
        E, causal, weights = w.E, w.causal, w.need_weights
        m = torch.nn.MultiheadAttention(E, w.Hq, bias=True, batch_first=True)
        with torch.no_grad():
            m.in_proj_weight.copy_(_t(np.concatenate([d["wq"], d["wk"], d["wv"]])))
            m.in_proj_bias.copy_(_t(np.concatenate([d["bq"], d["bk"], d["bv"]])))
            m.out_proj.weight.copy_(_t(d["wo"]))
            m.out_proj.bias.copy_(_t(d["bo"]))
        m.eval()
        x = _t(d["x"])
        kpm = _t(d["kpm"])  # bool, True = padding: the same convention as ours
        # nn.MultiheadAttention's bool attn_mask is True = NOT allowed (the opposite of F.sdpa's)
        attn_mask = torch.triu(torch.ones(w.Lq, w.Lk, dtype=torch.bool), 1) if causal else None

        @torch.inference_mode()
        def run():
            out = m(x, x, x, key_padding_mask=kpm, need_weights=weights, attn_mask=attn_mask,
                    is_causal=causal, average_attn_weights=False)
            return out if weights else out[0]
        return Prepared(run, to_numpy=_joined if weights else (lambda o: o.numpy()),
                        notes="nn.MultiheadAttention(batch_first=True), need_weights="
                              + ("True, average_attn_weights=False" if weights else "False"))


# --------------------------------------------------------------------------------------------
# onnxruntime


def _ort_session(model, threads):
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _make_model(nodes, inputs, outputs, initializers, opset=17):
    h = onnx.helper
    graph = h.make_graph(nodes, "attention", inputs, outputs, initializers)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset), h.make_opsetid("com.microsoft", 1)])
    model.ir_version = min(model.ir_version, 10)
    return model


def _tensor(name, elem, shape):
    return onnx.helper.make_tensor_value_info(name, elem, shape)


def _initializers(d, names, transposed=False):
    nh = onnx.numpy_helper
    return [nh.from_array(np.ascontiguousarray(d[n].T if transposed else d[n]), n + ("_t" if transposed else ""))
            for n in names]


def _projections(d, biases=True, names="qkv"):
    """MatMul (+ Add) nodes x -> q, k, v (B, L, H*D), output names ``names``, and the
    initializers of all four projections (Wo^T and bo too)."""
    mk = onnx.helper.make_node
    nodes, inits = [], _initializers(d, ("wq", "wk", "wv", "wo"), transposed=True)
    if biases:
        inits += _initializers(d, ("bq", "bk", "bv", "bo"))
    for c, name in zip("qkv", names):
        if biases:
            nodes += [mk("MatMul", ["x", f"w{c}_t"], [c + "0"]), mk("Add", [c + "0", "b" + c], [name])]
        else:
            nodes.append(mk("MatMul", ["x", f"w{c}_t"], [name]))
    return nodes, inits


def _sdpa_layout(w, d):
    """The sdpa inputs as (B, L, H*D), the layout of the ops that take packed heads."""
    def packed(a):
        return np.ascontiguousarray(a.transpose(0, 2, 1, 3).reshape(a.shape[0], a.shape[2], -1))
    return {c: packed(d[c]) for c in "qkv"}


class OnnxRuntime(Implementation):
    name = "onnxruntime"
    threads_at_prepare = True

    def unavailable(self):
        return None if ort is not None else _ORT_ERROR

    def unsupported(self, w):
        return _no_weights(w, "the ORT attention ops used here")

    def prepare(self, w, d, threads):
        if w.kind == "decode":  # the standard op would copy past_* into present_* every step
            return self._prepare_gqa(w, d, threads)
        variants = [("ONNX Attention", self._onnx_attention(w, d, threads))]
        if w.Hq != w.Hkv:
            variants.append(("GroupQueryAttention", self._prepare_gqa(w, d, threads)))
        else:
            variants.append(("MultiHeadAttention", self._contrib_mha(w, d, threads)))
        return _fastest(variants)

    def _contrib_mha(self, w, d, threads):
        """mha: x -> MatMul(Wq^T), MatMul(Wk^T), MatMul(Wv^T) -> MultiHeadAttention(q, k, v,
        bias=[bq bk bv], key_padding_mask) -> MatMul(Wo^T) -> Add(bo); sdpa: the op alone on q, k,
        v given as (B, L, H*D).

        The contrib op adds the projection biases itself (its ``bias`` input). Key padding mask:
        int32 (B, Lk), **1 = keep, 0 = padding** (the opposite polarity to ours). Causal:
        ``unidirectional=1`` (Lq == Lk here, so top-left and bottom-right alignment agree).
        """
        T = onnx.TensorProto
        mk = onnx.helper.make_node
        B, L, HD = w.B, w.Lq, w.Hq * w.D
        pad = d["kpm"] is not None
        attrs = dict(num_heads=w.Hq)
        if w.causal:
            attrs["unidirectional"] = 1
        if w.kind == "mha":
            nodes, inits = _projections(d, biases=False)
            inits += [onnx.numpy_helper.from_array(np.concatenate([d["bq"], d["bk"], d["bv"]]), "bqkv"),
                      onnx.numpy_helper.from_array(d["bo"], "bo")]
            inputs, feed = [_tensor("x", T.FLOAT, ["B", "L", w.E])], {"x": d["x"]}
            bias, out, shape = "bqkv", "ctx", ["B", "L", w.E]
            to_numpy = np.asarray
        else:
            nodes, inits, bias, out, shape = [], [], "", "y", [B, L, HD]
            feed = _sdpa_layout(w, d)
            inputs = [_tensor(c, T.FLOAT, [B, L, HD]) for c in "qkv"]
            to_numpy = lambda y: y.reshape(B, L, w.Hq, w.D).transpose(0, 2, 1, 3)  # noqa: E731
        nodes.append(mk("MultiHeadAttention", ["q", "k", "v", bias, "kpm" if pad else ""], [out],
                        domain="com.microsoft", **attrs))
        if w.kind == "mha":
            nodes += [mk("MatMul", ["ctx", "wo_t"], ["y0"]), mk("Add", ["y0", "bo"], ["y"])]
        if pad:
            inputs.append(_tensor("kpm", T.INT32, [B, w.Lk]))
            feed["kpm"] = (~d["kpm"]).astype(np.int32)  # built once, outside the timing
        sess = _ort_session(_make_model(nodes, inputs, [_tensor("y", T.FLOAT, shape)], inits), threads)
        options = [o for o, on in (("bias fused", w.kind == "mha"), ("int32 key_padding_mask 1=keep", pad),
                                   ("unidirectional=1", w.causal)) if on]
        notes = f"com.microsoft.MultiHeadAttention ({', '.join(options) or 'no mask'})"
        if w.kind == "mha":
            notes = f"MatMul x3 + {notes} + MatMul + Add"
        return Prepared(lambda: sess.run(None, feed)[0], to_numpy=to_numpy, notes=notes)

    def _onnx_attention(self, w, d, threads):
        """The standard ONNX ``Attention`` op (opset 23): mha: MatMul+Add x3 -> Attention on
        (B, L, H*D) with q_num_heads/kv_num_heads -> MatMul+Add; sdpa: the op alone on q, k, v
        (B, H, L, D). Key padding: a bool attn_mask (B, 1, Lq, Lk), True = attend (ORT wants the
        query axis spelled out); causal: ``is_causal=1``. GQA is native (no repeated K/V)."""
        T = onnx.TensorProto
        mk = onnx.helper.make_node
        B, Lq, Lk = w.B, w.Lq, w.Lk
        pad = d["kpm"] is not None
        if w.kind == "mha":
            nodes, inits = _projections(d)
            inputs, feed = [_tensor("x", T.FLOAT, ["B", "L", w.E])], {"x": d["x"]}
            shape, out = ["B", "L", w.E], "ctx"
        else:
            nodes, inits, shape, out = [], [], [B, w.Hq, Lq, w.D], "y"
            feed = {c: d[c] for c in "qkv"}
            inputs = [_tensor(c, T.FLOAT, list(d[c].shape)) for c in "qkv"]
        if pad:
            inputs.append(_tensor("mask", T.BOOL, [B, 1, Lq, Lk]))
            feed["mask"] = np.ascontiguousarray(np.broadcast_to(~d["kpm"][:, None, None, :], (B, 1, Lq, Lk)))
        nodes.append(mk("Attention", ["q", "k", "v", "mask" if pad else ""], [out],
                        q_num_heads=w.Hq, kv_num_heads=w.Hkv, is_causal=int(w.causal)))
        if w.kind == "mha":
            nodes += [mk("MatMul", ["ctx", "wo_t"], ["y0"]), mk("Add", ["y0", "bo"], ["y"])]
        model = _make_model(nodes, inputs, [_tensor("y", T.FLOAT, shape)], inits, opset=23)
        sess = _ort_session(model, threads)
        options = [o for o, on in (("bool attn_mask (B,1,Lq,Lk)", pad), ("is_causal=1", w.causal),
                                   ("GQA native", w.Hq != w.Hkv)) if on]
        notes = f"ONNX Attention (opset 23{''.join(', ' + o for o in options)})"
        if w.kind == "mha":
            notes = f"MatMul+Add x3 + {notes} + MatMul+Add"
        return Prepared(lambda: sess.run(None, feed)[0], notes=notes)

    def _prepare_gqa(self, w, d, threads):
        """com.microsoft.GroupQueryAttention for one decode token over a cache of Lk tokens.

        Inputs: query (B, 1, Hq*D), key/value of the new token (B, 1, Hkv*D) (packed, BSH),
        past_key/past_value (B, Hkv, Lk, D) (BNSH), seqlens_k = Lk - 1 per batch entry (the total
        length minus one), total_sequence_length = Lk (int32 scalar). past_* and present_* are bound
        to the same OrtValues (buffer sharing), so the op writes the new token at position Lk - 1 in
        place (the same values every round) and never copies the cache. For ``decode`` the graph
        computes q/k/v with MatMul + Add first and projects the output with MatMul + Add. A ragged
        batch: seqlens_k = lengths (each sequence's cached tokens: its total minus one; the op
        writes and reads each at its own length), total_sequence_length = the longest total. A
        sliding window: ``local_window_size = window`` (the op's query then sees ``window`` keys,
        itself included, as mha_cy's window: the output check holds it to that).
        """
        T = onnx.TensorProto
        B, Hq, Hkv, D, Lk = w.B, w.Hq, w.Hkv, w.D, w.Lk
        P = Lk - 1
        mk = onnx.helper.make_node
        nodes, inits, inputs = [], [], []
        if w.kind == "sdpa":
            q, k, v = d["q"], d["k"], d["v"]
            kbuf, vbuf = k.copy(), v.copy()
            kbuf[:, :, P:] = 0  # the step writes the last token itself
            vbuf[:, :, P:] = 0
            feed = dict(query=np.ascontiguousarray(q.transpose(0, 2, 1, 3).reshape(B, 1, Hq * D)),
                        key=np.ascontiguousarray(k[:, :, P:].transpose(0, 2, 1, 3).reshape(B, 1, Hkv * D)),
                        value=np.ascontiguousarray(v[:, :, P:].transpose(0, 2, 1, 3).reshape(B, 1, Hkv * D)))
            inputs += [_tensor("query", T.FLOAT, [B, 1, Hq * D]), _tensor("key", T.FLOAT, [B, 1, Hkv * D]),
                       _tensor("value", T.FLOAT, [B, 1, Hkv * D])]
            out_name, out_shape = "ctx", [B, 1, Hq * D]
            to_numpy = lambda y: y.reshape(B, 1, Hq, D).transpose(0, 2, 1, 3).copy()  # noqa: E731
            notes = "com.microsoft.GroupQueryAttention, past/present KV buffer shared (IOBinding)"
        else:
            nodes, inits = _projections(d)
            nodes += [mk("Identity", [c], [name]) for c, name in zip("qkv", ("query", "key", "value"))]
            inputs.append(_tensor("x", T.FLOAT, [B, 1, w.E]))
            kbuf = np.zeros((B, Hkv, Lk, D), np.float32)
            vbuf = np.zeros((B, Hkv, Lk, D), np.float32)
            kbuf[:, :, :P] = d["k_prefix"]
            vbuf[:, :, :P] = d["v_prefix"]
            feed = dict(x=d["x"])
            out_name, out_shape = "y", [B, 1, w.E]
            to_numpy = lambda y: y.copy()  # noqa: E731
            notes = ("MatMul+Add x3 + com.microsoft.GroupQueryAttention (past/present KV buffer "
                     "shared via IOBinding) + MatMul + Add")
        attrs = dict(num_heads=Hq, kv_num_heads=Hkv)
        cached = (P,) * B if w.kind == "sdpa" else w.cached
        if w.kind == "decode" and w.window is not None:
            attrs["local_window_size"] = w.window
            notes += f"; local_window_size={w.window}"
        if w.kind == "decode" and w.lengths is not None:
            notes += f"; ragged: seqlens_k = {list(cached)}"
        nodes.append(mk("GroupQueryAttention",
                        ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"],
                        ["ctx", "present_key", "present_value"], domain="com.microsoft", **attrs))
        if w.kind == "decode":
            nodes += [mk("MatMul", ["ctx", "wo_t"], ["y0"]), mk("Add", ["y0", "bo"], ["y"])]
        inputs += [_tensor("past_key", T.FLOAT, [B, Hkv, Lk, D]), _tensor("past_value", T.FLOAT, [B, Hkv, Lk, D]),
                   _tensor("seqlens_k", T.INT32, [B]), _tensor("total_sequence_length", T.INT32, [])]
        outputs = [_tensor(out_name, T.FLOAT, out_shape),
                   _tensor("present_key", T.FLOAT, [B, Hkv, Lk, D]), _tensor("present_value", T.FLOAT, [B, Hkv, Lk, D])]
        sess = _ort_session(_make_model(nodes, inputs, outputs, inits), threads)
        feed["seqlens_k"] = np.array(cached, np.int32)
        feed["total_sequence_length"] = np.array(max(cached) + 1, np.int32)
        kv_k = ort.OrtValue.ortvalue_from_numpy(kbuf)
        kv_v = ort.OrtValue.ortvalue_from_numpy(vbuf)
        out = np.empty(out_shape, np.float32)
        io = sess.io_binding()
        for name, arr in feed.items():
            io.bind_cpu_input(name, arr)
        io.bind_ortvalue_input("past_key", kv_k)
        io.bind_ortvalue_input("past_value", kv_v)
        io.bind_ortvalue_output("present_key", kv_k)
        io.bind_ortvalue_output("present_value", kv_v)
        io.bind_output(out_name, "cpu", 0, np.float32, out.shape, out.ctypes.data)
        keep = (feed, kbuf, vbuf, kv_k, kv_v, io, sess)  # keep the bound buffers alive

        def run(_keep=keep):
            sess.run_with_iobinding(io)
            return out
        return Prepared(run, to_numpy=to_numpy, notes=notes)


# --------------------------------------------------------------------------------------------
# OpenVINO


def _ov_opset():
    """The newest opset module that has everything used here (some opsets only add a few ops)."""
    for v in range(30, 12, -1):
        try:
            ops = importlib.import_module(f"openvino.opset{v}")
        except ImportError:
            continue
        if hasattr(ops, "scaled_dot_product_attention") and hasattr(ops, "matmul"):
            return ops
    raise ImportError("no openvino opset with scaled_dot_product_attention")


class _OVGraph:
    """The few graph pieces every OpenVINO workload is made of."""

    def __init__(self, w):
        self.w, self.ops = w, _ov_opset()
        self.params, self.feeds = [], []

    def shape(self, *dims):
        return self.ops.constant(np.array(dims, np.int64))

    def input(self, name, array):
        self.params.append(self.ops.parameter(list(array.shape), array.dtype, name=name))
        self.feeds.append(np.ascontiguousarray(array))
        return self.params[-1]

    def linear(self, x, weight, bias):  # x @ W^T + b, W in nn.Linear's (out, in) layout
        return self.ops.add(self.ops.matmul(x, self.ops.constant(weight), False, True), self.ops.constant(bias))

    def heads(self, x, heads):  # (B, L, H*D) -> (B, H, L, D)
        w = self.w
        return self.ops.transpose(self.ops.reshape(x, self.shape(w.B, -1, heads, w.D), False), self.shape(0, 2, 1, 3))

    def attention(self, q, k, v, mask=None):
        """ScaledDotProductAttention; GQA (one query token) as the group's query heads stacked
        as query rows against their shared K/V head: exact, and no repeated K/V."""
        w, ops = self.w, self.ops
        if w.Hq == w.Hkv:
            return ops.scaled_dot_product_attention(q, k, v, attention_mask=mask, causal=w.causal)
        grouped = ops.reshape(q, self.shape(w.B, w.Hkv, w.Hq // w.Hkv, w.D), False)
        o = ops.scaled_dot_product_attention(grouped, k, v, attention_mask=mask)
        return ops.reshape(o, self.shape(w.B, w.Hq, 1, w.D), False)

    def merge_heads(self, o):  # (B, H, L, D) -> (B, L, H*D)
        w = self.w
        return self.ops.reshape(self.ops.transpose(o, self.shape(0, 2, 1, 3)), self.shape(w.B, -1, w.Hq * w.D), False)


class OpenVINO(Implementation):
    name = "openvino"
    threads_at_prepare = True

    def unavailable(self):
        return None if ov is not None else _OV_ERROR

    def unsupported(self, w):
        if w.Hq != w.Hkv and w.Lq != 1:
            return "GQA is built here for one query token only (no such workload)"
        return _no_weights(w, "ScaledDotProductAttention")

    def prepare(self, w, d, threads):
        g = _OVGraph(w)
        ops = g.ops
        mask = None
        if d.get("kpm") is not None:  # bool, True = attend (the op's convention), broadcast over heads/queries
            mask = g.input("mask", ~d["kpm"][:, None, None, :])
        if w.kind == "sdpa":
            q, k, v = (g.input(c, d[c]) for c in "qkv")
            y = g.attention(q, k, v, mask)
            notes = "ScaledDotProductAttention on q, k, v"
        else:
            x = g.input("x", d["x"])
            q, k, v = (g.heads(g.linear(x, d["w" + c], d["b" + c]), h)
                       for c, h in (("q", w.Hq), ("k", w.Hkv), ("v", w.Hkv)))
            notes = "MatMul+Add x3, Reshape/Transpose, ScaledDotProductAttention"
            if w.kind == "decode":
                # The cache holds the prompt's K/V as inputs (each prepared copy its own, so that
                # rotating layers read distinct memory); the step's K/V join them by Concat,
                # which copies the cache every step: a graph cannot write into its inputs.
                # A window: the input holds only the window's window - 1 cached keys.
                first = 0 if w.window is None else max(0, w.Lk - w.window)
                k = ops.concat([g.input("k_past", d["k_prefix"][:, :, first:].copy()), k], 2)
                v = ops.concat([g.input("v_past", d["v_prefix"][:, :, first:].copy()), v], 2)
                notes += " over Concat(K/V cache input, step's K/V) (copies the cache per step)"
                if w.window is not None:
                    notes += f"; window: the cache input holds the last {w.Lk - 1 - first} keys"
                if w.lengths is not None:
                    # ragged: sequence b sees its cached tokens and the step's, which Concat puts
                    # last (at Lk - 1, not lengths[b]: the same attention without positions)
                    keep = np.arange(w.Lk)[None, :] < np.array(w.cached)[:, None]
                    keep[:, -1] = True
                    mask = g.input("mask", keep[:, None, None, :])
                    notes += ("; ragged: a bool mask (B,1,1,Lk) of each sequence's cached tokens "
                              "and the step's (appended last)")
            y = g.linear(g.merge_heads(g.attention(q, k, v, mask)), d["wo"], d["bo"])
            notes += ", Transpose/Reshape, MatMul+Add"
        if w.Hq != w.Hkv:
            notes += "; GQA: each group's query heads as query rows of its K/V head"
        if mask is not None and w.lengths is None:
            notes += "; key padding as a bool mask (B,1,1,Lk)"
        if w.causal:
            notes += "; causal=True"
        compiled = ov.Core().compile_model(ov.Model([y], g.params, "attention"), "CPU", {
            ov.properties.hint.inference_precision: ov.Type.f32,  # not bf16/f16 by default
            ov.properties.inference_num_threads: threads,
            ov.properties.hint.performance_mode: ov.properties.hint.PerformanceMode.LATENCY})
        precision = compiled.get_property(ov.properties.hint.inference_precision)
        assert precision == ov.Type.f32, f"OpenVINO compiled for {precision}, not f32"
        request = compiled.create_infer_request()
        for i, array in enumerate(g.feeds):  # zero-copy inputs, bound once
            request.set_input_tensor(i, ov.Tensor(array, shared_memory=True))
        ran = sorted({op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ops()}
                     - {"Const", "Input", "Output"})
        notes += "; the CPU plugin ran: " + ", ".join(ran)

        def run(_keep=g.feeds):
            request.infer()
            return request.get_output_tensor(0).data
        return Prepared(run, to_numpy=np.copy, notes=notes)


IMPLEMENTATIONS: dict[str, Implementation] = {
    impl.name: impl for impl in (MhaCy(), NumpyBaseline(), TorchSDPA(), TorchMHA(), OnnxRuntime(), OpenVINO())
}


def versions() -> dict:
    v = {"numpy": np.__version__, "python": sys.version.split()[0]}
    if torch is not None:
        v["torch"] = torch.__version__
    if ort is not None:
        v["onnxruntime"] = ort.__version__
        v["onnx"] = onnx.__version__
    if ov is not None:
        v["openvino"] = ov.__version__
    return v
