/* Body of attention_tile.c for one floating type: included with REAL = float and with REAL =
 * double, once per SIMD level (simd_isas.h; the C equivalent of a Cython fused type).
 * Defines needed: REAL, SUFFIX, EXP (the scalar exp), EXP_C(NAME) (its constants, fast_exp.h).
 * Loop indices are ptrdiff_t, not int: Python's CFLAGS carry -fwrapv, under which gcc does not
 * vectorize loops over int indices (measured: the softmax ran 10x slower). */

#define MHA_CAT_(a, b) a##b
#define MHA_CAT(a, b) MHA_CAT_(a, b)
#define FN(name) MHA_CAT(name, SUFFIX)

#include "softmax_row_impl.h"

void FN(mha_online_softmax_row_)(REAL *s, int n, const REAL *add, ptrdiff_t add_stride,
                                 const unsigned char *pad, int n_skip, int n_valid,
                                 REAL *m, REAL *l, REAL *acc, int dv)
{
    FN(online_softmax_row_)(s, n, add, add_stride, pad, n_skip, n_valid, m, l, acc, dv);
}

void FN(mha_softmax_row_)(REAL *s, int n, const REAL *add, ptrdiff_t add_stride,
                          const unsigned char *pad, int n_skip, int n_valid)
{
    REAL mx = FN(mask_and_max_)(s, n, add, add_stride, pad, n_skip, n_valid);
    if (mx == -INFINITY) {               /* all keys masked: weights of zeros, not NaN */
        for (ptrdiff_t j = 0; j < n; j++)
            s[j] = (REAL)-0.0;               /* (hidden: the caller makes them +0) */
        return;
    }
    if (mx != mx) {     /* a NaN row: NaN weights at the keys it sees, 0 at hidden ones */
        for (ptrdiff_t j = 0; j < n; j++)
            s[j] = s[j] == -INFINITY ? 0 : (REAL)NAN;
        return;
    }
    REAL sum = FN(exp_and_sum_)(s, n, mx);
    if (sum != sum) {   /* the same for a row of NaN from +inf scores (exp(inf - inf)) */
        for (ptrdiff_t j = 0; j < n; j++)
            s[j] = s[j] == 0 && signbit(s[j]) ? 0 : (REAL)NAN;
        return;
    }
    REAL inv = 1 / sum;
    for (ptrdiff_t j = 0; j < n; j++)
        s[j] *= inv;
}

/* out[0:dv] = acc / l, or zeros when l == 0 (every key of the row was masked); NaN l: NaN. */
static inline void FN(finish_row_)(const REAL *acc, REAL l, REAL *out, int dv)
{
    REAL inv = l == 0 ? 0 : 1 / l;      /* l is NaN when a NaN reached the row: keep it */
    for (ptrdiff_t d = 0; d < dv; d++)
        out[d] = acc[d] * inv;
}

void FN(mha_finish_rows_)(const REAL *acc, const REAL *l, int rows, int dv, REAL *out,
                          ptrdiff_t out_rs)
{
    for (ptrdiff_t r = 0; r < rows; r++)
        FN(finish_row_)(acc + r * dv, l[r], out + r * out_rs, dv);
}

#undef FN
#undef MHA_CAT
#undef MHA_CAT_
