/* Body of kv_encode.c, included once per SIMD level (simd_isas.h); see kv_encode.h. */

#define MHA_CAT_(a, b) a##b
#define MHA_CAT(a, b) MHA_CAT_(a, b)
#define FN(name) MHA_CAT(name, SUFFIX)

void FN(mha_kv_encode_f16_)(const float *x, ptrdiff_t n, uint16_t *out)
{
    ptrdiff_t i = 0;
#ifdef __F16C__
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) == 0) {
            _mm_storeu_si128((__m128i *)(out + i), _mm256_cvtps_ph(v, 0));
            continue;
        }
        for (int t = 0; t < 8; t++)         /* a NaN: NumPy's bits, not the quieted ones */
            out[i + t] = mha_float_to_half(x[i + t]);
    }
#endif
    for (; i < n; i++)
        out[i] = mha_float_to_half(x[i]);
}

void FN(mha_kv_encode_i8_)(const float *x, ptrdiff_t d, int8_t *out, float *scale)
{
    float amax = 0, nan = 0;
    int has_nan = 0;
    for (ptrdiff_t i = 0; i < d; i++) {
        float a = fabsf(x[i]);
        if (a != a) {
            if (!has_nan)
                nan = a;
            has_nan = 1;
        }
        amax = a > amax ? a : amax;
    }
    float s = (has_nan ? nan : amax) / 127.0f;
    if (!(s > 0 && s < INFINITY)) {         /* zero, NaN or inf: zeros, and inf becomes NaN */
        memset(out, 0, (size_t)d);
        if (s == INFINITY) {
            uint32_t qnan = 0x7fc00000u;
            memcpy(&s, &qnan, sizeof s);
        }
        *scale = s;
        return;
    }
    for (ptrdiff_t i = 0; i < d; i++) {
        float q = rintf(x[i] / s);
        out[i] = (int8_t)(q > 127 ? 127 : q < -127 ? -127 : q);
    }
    *scale = s;
}

#undef FN
#undef MHA_CAT
#undef MHA_CAT_
