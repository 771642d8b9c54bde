"""mha_cy: multi-head attention for fast CPU inference.

Layout of the package (one job per file):
  attention.py            MultiHeadAttention, scaled_dot_product_attention: the fast path
  reference.py            the same API in plain NumPy: the tests' oracle, the benchmarks' baseline
  _module.py              what both share: parameters, argument checks, KV-cache bookkeeping
  _checks.py              argument validation (errors name the argument, expected and actual)
  _cache.py               KVCache, the preallocated keys/values of incremental decoding
  _kv_encode.pyx          the float16 / int8 cache writes' encode on arrays (src/kv_encode.c)
  _call_plan.py           CachePlan: one cached call's per-sequence positions (ragged batches)
  _window.py              the sliding window's argument checks
  rope.py                 RoPE, the rotary position embeddings' configuration; call positions
  _rope_kernel.pyx        the rotation of the q/k heads in place over OpenMP threads (src/rope.c)
  _linear_kernel.pyx      the projections (x @ W.T + b), shape-fixed tiles over OpenMP threads
  _attention_kernel.pyx   attention tasks over OpenMP threads: fused C tiles (BLAS for head
                          dims > 256), online softmax, split-K
  _kernel_rules.pxd       the kernels' tuning constants, projection tile grid and split-K
                          rule, declared once (the compiled small calls reproduce them)
  _step_kernel.pyx        a small call (decode step, prefill or self-attention of <= 256 tokens
                          a sequence) as one compiled call: serial, or one team of threads
  _cython_blas.pyx/.pxd   row-major GEMM over scipy.linalg.cython_blas (nogil)
  _panels.pxd             packing x into the projections' row panels, a panel at a time
  _openmp_helpers.pyx/.pxd  the only OpenMP calls, with a serial fallback
  _threads.py             the thread-count contract; BLAS held to one thread inside kernels
  _build_info.py          build_info(): version, OpenMP, threads, BLAS, SIMD level
  _pruning.py             prune_heads: a smaller module without some query heads (GQA-aware)
  analysis.py             head_stats, rank_heads: what each head does, which heads matter
  plotting.py             plot_heads: per-head heatmaps (matplotlib, imported when drawing)
  _simd.py                MHA_CY_SIMD: one variable forces every C kernel's SIMD path
  _blas_kernel.py         OpenBLAS core names -> SIMD levels: warn when BLAS runs below the CPU
  ../src/                 plain C: attention_tile (masking, online softmax, vectorized exp),
                          attention_microkernel (fused score/softmax/PV tiles), row_panel_gemm
                          (the projections), small_gemm (decode projections),
                          rope (the rotary embeddings' cos/sin and rotation), kv_format
                          (attention over float16 / int8 caches in their stored format;
                          kv_int8_dot_impl.h: int8 with AVX512-VNNI integer products)
"""
from ._version import __version__
from ._simd import check_simd_request as _check_simd_request
from ._cache import KVCache
from ._threads import get_num_threads, set_num_threads, threads
from ._build_info import build_info
from .attention import MultiHeadAttention, scaled_dot_product_attention
from .rope import RoPE
from .plotting import plot_heads
from . import analysis, reference

_check_simd_request()

__all__ = ["MultiHeadAttention", "KVCache", "RoPE", "scaled_dot_product_attention", "reference",
           "set_num_threads", "get_num_threads", "threads", "build_info", "plot_heads",
           "analysis", "__version__"]
