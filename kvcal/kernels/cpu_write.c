/* kvcal's fused CPU cache write: a decode step's new K and V tokens -> stored codes + block scales + the float32
 * values the torch path's attention reads, in ONE call per layer (an engine's `reshape_and_cache`).
 *
 * The numeric spec is kvcal/formats.py (`quantize`, `dequantize`); the torch reference of this kernel is
 * `decode_write_ref` in kvcal/kernels/testing.py, which checks this file against it bit for bit. Every
 * float32 operation below is the one torch performs there, in the same order (compiled with -ffp-contract=off, no
 * fast-math: no fused multiply-add, no reassociation). Why a C kernel: a decode step writes
 * one token per layer, and the eager torch ops of a quantize + dequantize (25-60 of them for FP4) cost ~10 us each
 * on CPU, more than the step's attention.
 *
 * Layout: every tensor is [B, H, T, C] with its own element strides for b, h, t and a contiguous last dim
 * (C = D for x and values, the format's code / block-scale width otherwise). Padding positions (valid[b, t] == 0)
 * are stored as zeros and not counted as non-finite, as `cache.without_padding` stores them.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* format ids: kvcal/formats.py's `c_kernel` column (kvcal_format_id below lets cpu_write.py compare them) */
enum {
    F_BF16 = 0, F_E4M3 = 1, F_E5M2 = 2, F_INT8 = 3, F_NVFP4 = 4, F_NVFP4_4OVER6 = 5, F_MXFP4 = 6, F_FP4_E2M1 = 7,
    F_FP16 = 8, F_E4M3_TOKEN = 9, F_INT8S = 10, F_INT4_RHT = 11,
    /* TurboQuant's sides (a preset pairs a key side with a value side) */
    F_TQ_FP8 = 12, F_TQ_MSE4 = 13, F_TQ_MSE3 = 14, F_TQ_UNI4 = 15, F_TQ_UNI3 = 16
};
enum { IN_F32 = 0, IN_BF16 = 1 };

static const float E2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                               NAN,   -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
static const float MIDS[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
#define BF16_MAX 3.3895313892515355e38f

static inline uint32_t bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* float32 -> bfloat16 bits, round to nearest even; NaN -> 0xFFFF, what torch's CPU cast writes */
static inline uint16_t to_bf16(float f) {
    if (isnan(f)) return 0xFFFF;
    uint32_t u = bits(f);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float from_bf16(uint16_t h) { return from_bits((uint32_t)h << 16); }

/* float32 -> FP8 byte with m mantissa bits and exponent bias `bias` (E4M3FN: 3, 7; E5M2: 2, 15), round to nearest
 * even, as torch's CPU cast (c10's Float8 conversions): E4M3FN has no Inf (|f| >= 480 and NaN -> 0x7F), E5M2
 * overflows to Inf (0x7C). Callers clamp first, as formats.py does. */
static inline uint8_t to_fp8(float f, int m, int bias) {
    int e5m2 = m == 2;
    uint32_t u = bits(f), sign = u & 0x80000000u;
    u ^= sign;
    uint8_t r;
    if (e5m2 ? u >= (143u << 23) : u >= (1087u << 20)) {
        r = (!e5m2 || u > (255u << 23)) ? 0x7F : 0x7C;
    } else if (u < ((uint32_t)(128 - bias) << 23)) {
        /* subnormal: adding 2**(emin - m + 23) lets the float adder round to the subnormal step */
        const uint32_t denorm = (uint32_t)(127 + 23 - m - (bias - 1)) << 23;
        r = (uint8_t)(bits(from_bits(u) + from_bits(denorm)) - denorm);
    } else {
        uint32_t odd = (u >> (23 - m)) & 1u;
        u += ((uint32_t)(bias - 127) << 23) + ((1u << (22 - m)) - 1u) + odd;
        r = (uint8_t)(u >> (23 - m));
    }
    return r | (uint8_t)(sign >> 24);
}
static inline uint8_t to_e4m3(float f) { return to_fp8(f, 3, 7); }

/* FP8 byte -> float32 (exact); E4M3FN: only S.1111.111 is NaN; E5M2: exponent 31 is Inf / NaN */
static inline float fp8_value(uint8_t c, int m, int bias) {
    int s = c >> 7, e = (c & 0x7F) >> m, man = c & ((1 << m) - 1), emax = m == 2 ? 31 : 15;
    float v;
    if (e == emax && (m == 2 || man == (1 << m) - 1)) {
        if (m == 3 || man) return NAN;
        v = INFINITY;
    } else {
        v = e == 0 ? ldexpf((float)man, 1 - bias - m) : ldexpf((float)((1 << m) + man), e - bias - m);
    }
    return s ? -v : v;
}
static inline float e4m3_value(uint8_t c) { return fp8_value(c, 3, 7); }

/* E2M1 code of an already scaled value, ties to even (formats.e2m1_encode(y, 'even')) */
static inline uint8_t e2m1_even(float y) {
    if (isnan(y)) return 8;
    float a = fabsf(y);
    uint8_t mag = 0;
    for (int i = 0; i < 7; i++) mag += (i % 2 == 1) ? (a >= MIDS[i]) : (a > MIDS[i]);
    return (uint8_t)(((y < 0) && mag > 0) ? (8 | mag) : mag);
}

/* E2M1 code of an already scaled value, ties away from zero (formats.e2m1_encode(y, 'away'): SGLang's rule) */
static inline uint8_t e2m1_away(float y) {
    if (isnan(y)) return 8;
    float a = fabsf(y);
    uint8_t mag = 0;
    for (int i = 0; i < 7; i++) mag += a >= MIDS[i];
    return (uint8_t)(((y < 0) && mag > 0) ? (8 | mag) : mag);
}

/* |x| with NaN and Inf as 0 (formats.finite_abs) */
static inline float fin_abs(float x) { return isfinite(x) ? fabsf(x) : 0.0f; }

/* the finite |max| of n values (formats.finite_abs(x).amax(-1)); 0 when none is finite and nonzero */
static inline float block_max(const float *x, int n) {
    float m = 0.0f;
    for (int i = 0; i < n; i++) { float a = fin_abs(x[i]); if (a > m) m = a; }
    return m;
}

/* vLLM's per-(token, head) scale of a row: max(finite amax / qmax, 1e-6) (int8 and FP8 per token head) */
static inline float pth_scale(const float *x, int D, float qmax) {
    float s = block_max(x, D) / qmax;
    return s < 1e-6f ? 1e-6f : s;
}

/* saturating cast to float32's range (formats._to / fast._saturate); NaN stays */
static inline float sat(float y) {
    if (y > 3.4028234663852886e38f) return 3.4028234663852886e38f;
    if (y < -3.4028234663852886e38f) return -3.4028234663852886e38f;
    return y;
}

/* 2**e for integer e in [-127, 127] (formats.exp2_int) */
static inline float exp2_int(int e) { return e == -127 ? from_bits(0x00400000u) : from_bits((uint32_t)(e + 127) << 23); }

/* float32 -> IEEE float16 bits, round to nearest even, beyond the largest half (65520 and up) +-Inf, NaN ->
 * 0x7E00 with its sign: torch's CPU cast (c10's fp16_ieee_from_fp32_value; F16C's vcvtps2ph gives the same) */
static inline uint16_t to_f16(float f) {
    uint32_t u = bits(f), sign = (u >> 16) & 0x8000u;
    u &= 0x7FFFFFFFu;
    if (u > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);
    if (u >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* 65520.0f: the tie above 65504 rounds to Inf */
    if (u < 0x38800000u) {                                    /* below 2**-14: a subnormal half */
        const uint32_t denorm = 126u << 23;                   /* 0.5f: the float adder rounds to 2**-24 steps */
        return (uint16_t)(sign | (bits(from_bits(u) + from_bits(denorm)) - denorm));
    }
    uint32_t odd = (u >> 13) & 1u;
    u += ((uint32_t)(15 - 127) << 23) + 0xFFFu + odd;
    return (uint16_t)(sign | (u >> 13));
}

/* IEEE float16 bits -> float32 (exact) */
static inline float f16_value(uint16_t h) {
    int s = h >> 15, e = (h >> 10) & 0x1F, man = h & 0x3FF;
    float v;
    if (e == 31) v = man ? NAN : INFINITY;
    else v = e == 0 ? ldexpf((float)man, -24) : ldexpf((float)(1024 + man), e - 25);
    return s ? -v : v;
}

/* vLLM's round half away from zero as float32: trunc(y +- 0.5) (formats._round_half_away) */
static inline float round_half_away(float y) { return y >= 0 ? truncf(y + 0.5f) : truncf(y - 0.5f); }

/* In place: the unnormalised Walsh-Hadamard transform of x[D] (D a power of two) in the order of formats.hadamard's
 * butterfly: at width h, x[i] + x[i + h] and x[i] - x[i + h] for every pair of each 2h group; `hadamard` in float32
 * (int4_per_token_head), `hadamard64` in float64 (TurboQuant's rotation sums in float64) */
#define HADAMARD(name, T)                                                                                          \
    static void name(T *x, int D) {                                                                               \
        for (int h = 1; h < D; h <<= 1)                                                                            \
            for (int g = 0; g < D; g += 2 * h)                                                                     \
                for (int i = g; i < g + h; i++) {                                                                  \
                    T a = x[i], b = x[i + h];                                                                      \
                    x[i] = a + b;                                                                                  \
                    x[i + h] = a - b;                                                                              \
                }                                                                                                  \
    }
HADAMARD(hadamard, float)
HADAMARD(hadamard64, double)

/* formats.tq_pack: 4 bits two per byte (low nibble first); 3 bits: each 8 codes a 24-bit little-endian word,
 * code j at bit 3j */
static void tq_pack(const uint8_t *idx, int D, int nbits, uint8_t *out) {
    if (nbits == 4) {
        for (int d = 0; d < D; d += 2) out[d / 2] = (uint8_t)(idx[d] | (idx[d + 1] << 4));
        return;
    }
    for (int g = 0; g < D / 8; g++) {
        uint32_t w = 0;
        for (int j = 0; j < 8; j++) w |= (uint32_t)idx[8 * g + j] << (3 * j);
        out[3 * g] = (uint8_t)(w & 0xFF);
        out[3 * g + 1] = (uint8_t)((w >> 8) & 0xFF);
        out[3 * g + 2] = (uint8_t)((w >> 16) & 0xFF);
    }
}

/* TurboQuant MSE keys (formats.tq_quantize_mse, then _dequantize_tq_mse for the values): x[D] -> packed codes, the
 * fp16 norm, float32 values. The rotation is the releases' H / sqrt(D), its own inverse. aux: centroids [2**nbits]
 * ascending, then the Hadamard entry. */
static void write_tq_mse(const float *x, int D, int nbits, const float *aux, uint8_t *codes, uint16_t *norm16,
                         float *vals) {
    const float *cent = aux;
    const double h = (double)aux[1 << nbits];
    int n = 1 << nbits, bad = 0;
    for (int d = 0; d < D; d++) bad |= !isfinite(x[d]);
    double acc = 0.0, y[1024];
    for (int d = 0; d < D; d++) {
        double v = bad ? 0.0 : (double)x[d];
        acc += v * v;
    }
    float norm = (float)sqrt(acc), den = norm + 1e-8f;
    for (int d = 0; d < D; d++) y[d] = (double)((bad ? 0.0f : x[d]) / den);
    hadamard64(y, D);
    uint8_t idx[1024];
    for (int d = 0; d < D; d++) {
        float r = (float)(y[d] * h);
        int c = 0; /* the number of midpoints (c[i] + c[i + 1]) / 2 <= r */
        for (int i = 0; i < n - 1; i++) c += (cent[i] + cent[i + 1]) / 2.0f <= r;
        idx[d] = bad ? 0 : (uint8_t)c;
    }
    tq_pack(idx, D, nbits, codes);
    uint16_t w = bad ? 0x7E00u : to_f16(norm);
    *norm16 = w;
    /* values: norm * the norm-corrected centroid vector, rotated back (float64 sums, rounded once) */
    double nsq = 0.0;
    for (int d = 0; d < D; d++) nsq += (double)cent[idx[d]] * (double)cent[idx[d]];
    float nsqf = (float)nsq + 1e-16f;
    float root = (float)sqrt((double)nsqf);
    float inv = (float)(1.0 / (double)root), nv = f16_value(w);
    for (int d = 0; d < D; d++) y[d] = (double)(nv * (cent[idx[d]] * inv));
    hadamard64(y, D);
    for (int d = 0; d < D; d++) vals[d] = (float)(y[d] * h);
}

/* TurboQuant uniform values (formats._quantize_tq_uniform / _dequantize_tq_uniform): x[D] -> packed codes, fp16
 * (scale, zero), float32 values */
static void write_tq_uniform(const float *x, int D, int nbits, uint8_t *codes, uint16_t *words, float *vals) {
    float levels = (float)((1 << nbits) - 1);
    int bad = 0;
    for (int d = 0; d < D; d++) bad |= !isfinite(x[d]);
    float lo = 0.0f, hi = 0.0f;
    if (!bad) {
        lo = hi = x[0];
        for (int d = 1; d < D; d++) { if (x[d] < lo) lo = x[d]; if (x[d] > hi) hi = x[d]; }
    }
    float s = (hi - lo) / levels;
    s = s > 1e-8f ? s : 1e-8f;
    uint8_t idx[1024];
    for (int d = 0; d < D; d++) {
        float q = truncf(((bad ? 0.0f : x[d]) - lo) / s + 0.5f);
        if (q < 0.0f) q = 0.0f;
        if (q > levels) q = levels;
        idx[d] = bad ? 0 : (uint8_t)q;
    }
    tq_pack(idx, D, nbits, codes);
    words[0] = bad ? 0x7E00u : to_f16(s);
    words[1] = bad ? 0x7E00u : to_f16(lo);
    float sv = f16_value(words[0]), zv = f16_value(words[1]);
    for (int d = 0; d < D; d++) vals[d] = (float)idx[d] * sv + zv;
}

typedef struct {
    const void *x;
    int64_t xb, xh, xt;
    void *codes;
    int64_t cb, ch, ct;
    void *scales; /* block scales; unused for bf16 / fp8 */
    int64_t sb, sh, st;
    float *vals;
    int64_t vb, vh, vt;
    const float *scale; /* fp8 static scale / nvfp4 global; NULL = 1.0 */
    int64_t gb, gh;
    /* fp4_e2m1: torch's log2 of the block ratios, contiguous [B, H, T, D/16]; int4_per_token_head: the Hadamard
     * transform's +-1 signs [D] (formats.rht_signs); TurboQuant MSE keys: the Lloyd-Max centroids [2**bits]
     * ascending, then the Hadamard entry 1/sqrt(D) as float32 (formats.tq_hadamard_entry); NULL otherwise */
    const float *aux;
} side_t;

/* The ABI cpu_write.py checks before it uses this library: out[0] = sizeof(side_t), out[1..20] = the byte offsets
 * of its fields in declaration order (ctypes' _Side must equal them); returns how many values it wrote (21), or -1
 * when n is too small. */
int kvcal_side_layout(int64_t *out, int n) {
    const int64_t v[21] = {
        sizeof(side_t),
        offsetof(side_t, x),     offsetof(side_t, xb),    offsetof(side_t, xh),     offsetof(side_t, xt),
        offsetof(side_t, codes), offsetof(side_t, cb),    offsetof(side_t, ch),     offsetof(side_t, ct),
        offsetof(side_t, scales), offsetof(side_t, sb),   offsetof(side_t, sh),     offsetof(side_t, st),
        offsetof(side_t, vals),  offsetof(side_t, vb),    offsetof(side_t, vh),     offsetof(side_t, vt),
        offsetof(side_t, scale), offsetof(side_t, gb),    offsetof(side_t, gh),     offsetof(side_t, aux),
    };
    if (n < 21) return -1;
    for (int i = 0; i < 21; i++) out[i] = v[i];
    return 21;
}

/* This kernel's id of a format (kvcal/formats.py's canonical name) or input dtype ("in:float32", "in:bfloat16");
 * -1 for a name it does not know. */
int kvcal_format_id(const char *name) {
    static const struct { const char *name; int id; } ids[] = {
        {"bf16", F_BF16}, {"fp8_e4m3", F_E4M3}, {"fp8_e5m2", F_E5M2}, {"int8_per_token_head", F_INT8},
        {"nvfp4", F_NVFP4}, {"nvfp4_4over6", F_NVFP4_4OVER6}, {"mxfp4", F_MXFP4}, {"fp4_e2m1", F_FP4_E2M1},
        {"float16", F_FP16}, {"fp8_per_token_head", F_E4M3_TOKEN}, {"int8_per_tensor", F_INT8S},
        {"int4_per_token_head", F_INT4_RHT}, {"tq_fp8", F_TQ_FP8}, {"tq_mse4_nc", F_TQ_MSE4},
        {"tq_mse3_nc", F_TQ_MSE3}, {"tq_uniform4", F_TQ_UNI4}, {"tq_uniform3", F_TQ_UNI3},
        {"in:float32", IN_F32}, {"in:bfloat16", IN_BF16},
    };
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++)
        if (strcmp(ids[i].name, name) == 0) return ids[i].id;
    return -1;
}

/* the new K or V row as stored: rounded to the K/V input dtype, padding zeroed; returns its non-finite count */
static int64_t load_row(const side_t *s, int in_dtype, int round_bf16, int64_t b, int64_t h, int64_t t, int D,
                        int real, float *row) {
    int64_t bad = 0, off = b * s->xb + h * s->xh + t * s->xt;
    for (int d = 0; d < D; d++) {
        float v = in_dtype == IN_BF16 ? from_bf16(((const uint16_t *)s->x)[off + d]) : ((const float *)s->x)[off + d];
        if (round_bf16) v = from_bf16(to_bf16(v));
        if (!real) v = 0.0f;
        bad += !isfinite(v);
        row[d] = v;
    }
    return bad;
}

/* nvfp4 / nvfp4_4over6 / mxfp4: block codes of y (already scaled), packed two per byte, low nibble first */
static inline void put_fp4(uint8_t *c, int i, uint8_t code) {
    if (i % 2 == 0) c[i / 2] = code; else c[i / 2] |= (uint8_t)(code << 4);
}

/* One (token, head) row x[D] as stored (rounded to the K/V dtype, padding zeroed): its codes, block scales and float32
 * values. x_bf16: the K/V dtype is bfloat16 (int4_per_token_head rounds its rotated row to it). */
static void write_row(int fmt, const float *x, int D, float g, const float *aux, int x_bf16, uint8_t *codes,
                      void *scales, float *vals) {
    switch (fmt) {
    case F_BF16:
        for (int d = 0; d < D; d++) {
            float y = x[d];
            /* clamp keeps NaN */
            if (y > BF16_MAX) y = BF16_MAX;
            if (y < -BF16_MAX) y = -BF16_MAX;
            uint16_t h = to_bf16(y);
            ((uint16_t *)codes)[d] = h;
            vals[d] = from_bf16(h);
        }
        break;
    case F_E4M3:
    case F_E5M2: {
        float m = fmt == F_E4M3 ? 448.0f : 57344.0f;
        for (int d = 0; d < D; d++) {
            float y = x[d] / g;
            if (y > m) y = m;
            if (y < -m) y = -m;
            uint8_t c = fmt == F_E4M3 ? to_fp8(y, 3, 7) : to_fp8(y, 2, 15);
            codes[d] = c;
            vals[d] = sat((fmt == F_E4M3 ? fp8_value(c, 3, 7) : fp8_value(c, 2, 15)) * g);
        }
        break;
    }
    case F_INT8: {
        /* vLLM 0.32.0 / 0.33.0: scale = max(amax / 127, 1e-6); code = x * (1 / scale) rounded half away from
           zero (+-0.5, then the truncating int8 store) */
        float s = pth_scale(x, D, 127.0f), inv = 1.0f / s;
        for (int d = 0; d < D; d++) {
            int8_t c;
            if (isnan(x[d])) c = -128;
            else {
                float r = x[d] * inv;
                c = (int8_t)round_half_away(r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r));
            }
            ((int8_t *)codes)[d] = c;
            vals[d] = c == -128 ? NAN : sat((float)c * s);
        }
        *(float *)scales = s;
        break;
    }
    case F_NVFP4: {
        for (int k = 0; k < D / 16; k++) {
            const float *xb = x + 16 * k;
            float r = block_max(xb, 16) / (6.0f * g);
            if (r > 448.0f) r = 448.0f;
            uint8_t bs = to_e4m3(r);
            ((uint8_t *)scales)[k] = bs;
            float eff = e4m3_value(bs) * g;
            for (int i = 0; i < 16; i++) {
                float y = eff > 0 ? xb[i] / eff : (isnan(xb[i]) ? xb[i] : 0.0f);
                uint8_t c = e2m1_even(y);
                put_fp4(codes, 16 * k + i, c);
                vals[16 * k + i] = sat(E2M1[c] * eff);
            }
        }
        break;
    }
    case F_NVFP4_4OVER6: {
        float sf_scale = 1.0f / g, back = 1.0f / sf_scale;
        const float recip[2] = {1.0f / 4.0f, 1.0f / 6.0f};
        for (int k = 0; k < D / 16; k++) {
            const float *xb = x + 16 * k;
            float fin[16], bmax = 0.0f;
            for (int i = 0; i < 16; i++) { fin[i] = isfinite(xb[i]) ? xb[i] : 0.0f; float a = fabsf(fin[i]); if (a > bmax) bmax = a; }
            uint8_t sf[2];
            float inv[2], err[2];
            for (int n = 0; n < 2; n++) {
                float r = sf_scale * (bmax * recip[n]);
                if (r > 448.0f) r = 448.0f;
                sf[n] = to_e4m3(r);
                float sfv = e4m3_value(sf[n]);
                inv[n] = sfv != 0 ? 1.0f / (sfv * back) : 0.0f;
                float m = inv[n], deq = m != 0 ? 1.0f / m : 0.0f, e = 0.0f;
                for (int j = 0; j < 8; j++) {
                    float d0 = E2M1[e2m1_even(fin[2 * j] * m)] * deq - fin[2 * j];
                    float d1 = E2M1[e2m1_even(fin[2 * j + 1] * m)] * deq - fin[2 * j + 1];
                    float pair = d0 * d0 + d1 * d1;
                    e = j == 0 ? pair : e + pair;
                }
                err[n] = e;
            }
            int use4 = err[0] < err[1];
            uint8_t bs = use4 ? sf[0] : sf[1];
            float mult = use4 ? inv[0] : inv[1];
            ((uint8_t *)scales)[k] = bs;
            float eff = e4m3_value(bs) * g;
            for (int i = 0; i < 16; i++) {
                float y = mult != 0 ? xb[i] * mult : (isnan(xb[i]) ? xb[i] : 0.0f);
                uint8_t c = e2m1_even(y);
                put_fp4(codes, 16 * k + i, c);
                vals[16 * k + i] = sat(E2M1[c] * eff);
            }
        }
        break;
    }
    case F_MXFP4: {
        for (int k = 0; k < D / 32; k++) {
            const float *xb = x + 32 * k;
            float bmax = block_max(xb, 32);
            int e;
            frexpf(bmax, &e);
            int shared = bmax > 0 ? e - 3 : -127;
            if (shared < -127) shared = -127;
            if (shared > 127) shared = 127;
            float p = exp2_int(shared);
            ((uint8_t *)scales)[k] = (uint8_t)(shared + 127);
            for (int i = 0; i < 32; i++) {
                uint8_t c = e2m1_even(xb[i] / p);
                put_fp4(codes, 32 * k + i, c);
                vals[32 * k + i] = sat(E2M1[c] * p);
            }
        }
        break;
    }
    case F_FP4_E2M1: {
        /* SGLang's KVFP4QuantizeUtil: exponent ceil(log2(max(bmax / 6, 1e-10))), the log2 torch's
         * (kvcal_block_ratio) */
        for (int k = 0; k < D / 16; k++) {
            int e = (int)ceilf(aux[k]);
            float p = exp2_int(e);
            ((uint8_t *)scales)[k] = (uint8_t)(e + 127);
            for (int i = 0; i < 16; i++) {
                uint8_t c = e2m1_away(x[16 * k + i] / p);
                put_fp4(codes, 16 * k + i, c);
                vals[16 * k + i] = sat(E2M1[c] * p);
            }
        }
        break;
    }
    case F_FP16:
        /* an IEEE cast: beyond +-65504 rounds to +-Inf, read back as +-Inf (formats' float16) */
        for (int d = 0; d < D; d++) {
            uint16_t h = to_f16(x[d]);
            ((uint16_t *)codes)[d] = h;
            vals[d] = f16_value(h);
        }
        break;
    case F_E4M3_TOKEN: {
        /* vLLM's per-token-head FP8: scale = max(amax / 448, 1e-6); code = e4m3(clamp(x * (1 / scale), +-448)) */
        float s = pth_scale(x, D, 448.0f), inv = 1.0f / s;
        for (int d = 0; d < D; d++) {
            float y = x[d] * inv;
            if (y > 448.0f) y = 448.0f;
            if (y < -448.0f) y = -448.0f;
            uint8_t c = to_e4m3(y);
            codes[d] = c;
            vals[d] = sat(e4m3_value(c) * s);
        }
        *(float *)scales = s;
        break;
    }
    case F_INT8S: {
        /* TensorRT-LLM's INT8: round half to even of x * (1 / scale), saturated to [-128, 127], NaN -> 0 */
        float inv = 1.0f / g;
        for (int d = 0; d < D; d++) {
            float r = rintf(x[d] * inv);
            if (r > 127.0f) r = 127.0f;
            if (r < -128.0f) r = -128.0f;
            int8_t c = isnan(r) ? 0 : (int8_t)r;
            ((int8_t *)codes)[d] = c;
            vals[d] = sat((float)c * g);
        }
        break;
    }
    case F_INT4_RHT: {
        /* vLLM's int4_per_token_head (formats._quantize_int4_rht): rotate H (D1 x), round to the K/V dtype, then
         * asymmetric 4-bit [min, max] -> 0..15; the fp32 scale's 4 low mantissa bits hold the zero point */
        float y[1024];
        int bad = 0;
        for (int d = 0; d < D; d++) y[d] = x[d] * aux[d];
        hadamard(y, D);
        for (int d = 0; d < D; d++) {
            if (x_bf16) y[d] = from_bf16(to_bf16(y[d]));
            bad |= !isfinite(y[d]);
        }
        float lo = 0.0f, hi = 0.0f;
        if (!bad) {
            lo = hi = y[0];
            for (int d = 1; d < D; d++) { if (y[d] < lo) lo = y[d]; if (y[d] > hi) hi = y[d]; }
        }
        float s = (hi - lo) / 15.0f;
        if (s < 1e-6f) s = 1e-6f;
        float zp = round_half_away(-lo / s), inv = 1.0f / s;
        if (zp < 0.0f) zp = 0.0f;
        if (zp > 15.0f) zp = 15.0f;
        for (int d = 0; d < D; d++) {
            float q = round_half_away((bad ? 0.0f : y[d]) * inv + zp);
            if (q < 0.0f) q = 0.0f;
            if (q > 15.0f) q = 15.0f;
            put_fp4(codes, d, (uint8_t)q);
        }
        uint32_t word = bad ? bits(NAN) : ((bits(s) & ~15u) | (uint32_t)zp);
        *(float *)scales = from_bits(word);
        /* the values: ((code - zp) * scale) rotated back, H y * D1 / D (formats._dequantize_int4_rht) */
        float sc = from_bits(word & ~15u), z = (float)(word & 15u);
        for (int d = 0; d < D; d++) {
            uint8_t c = d % 2 == 0 ? codes[d / 2] & 0x0F : codes[d / 2] >> 4;
            y[d] = ((float)c - z) * sc;
        }
        hadamard(y, D);
        for (int d = 0; d < D; d++) vals[d] = sat(y[d] * aux[d] / (float)D);
        break;
    }
    case F_TQ_FP8:
        /* TurboQuant's FP8 keys: K itself to E4M3FN, +-448 saturated, no scale */
        for (int d = 0; d < D; d++) {
            float y = x[d];
            if (y > 448.0f) y = 448.0f;
            if (y < -448.0f) y = -448.0f;
            uint8_t c = to_e4m3(y);
            codes[d] = c;
            vals[d] = e4m3_value(c);
        }
        break;
    case F_TQ_MSE4:
    case F_TQ_MSE3:
        write_tq_mse(x, D, fmt == F_TQ_MSE4 ? 4 : 3, aux, codes, (uint16_t *)scales, vals);
        break;
    case F_TQ_UNI4:
    case F_TQ_UNI3:
        write_tq_uniform(x, D, fmt == F_TQ_UNI4 ? 4 : 3, codes, (uint16_t *)scales, vals);
        break;
    }
}

/* Write T new tokens of K and V ([B, H, T, D] each) in format `fmt`. valid: [B, T] bytes (stride vb_stride along
 * b, 1 along t) or NULL (all real). nonfinite[0], [1]: NaN/Inf counts of K's and V's real tokens (after rounding
 * to bf16 when round_bf16). Returns 0, or -1 when D exceeds the row buffer. */
int kvcal_write(int fmt_k, int fmt_v, int in_dtype, int round_bf16, int64_t B, int64_t H, int64_t T, int D, const uint8_t *valid,
                int64_t valid_b, side_t *k, side_t *v, int64_t *nonfinite) {
    float row[1024];
    if (D > 1024) return -1;
    nonfinite[0] = nonfinite[1] = 0;
    for (int which = 0; which < 2; which++) {
        side_t *s = which ? v : k;
        int fmt = which ? fmt_v : fmt_k;
        int csize = fmt == F_BF16 || fmt == F_FP16 ? 2 : 1;
        /* bytes per block-scale element: fp32 per-(token, head) scales, TurboQuant's fp16 norms / (scale, zero) */
        int ssize = fmt == F_INT8 || fmt == F_E4M3_TOKEN || fmt == F_INT4_RHT ? 4
                    : fmt >= F_TQ_MSE4 ? 2 : 1;
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < T; t++) {
                int real = valid == NULL || valid[b * valid_b + t];
                for (int64_t h = 0; h < H; h++) {
                    int64_t bad = load_row(s, in_dtype, round_bf16, b, h, t, D, real, row);
                    if (real) nonfinite[which] += bad;
                    float g = s->scale ? s->scale[b * s->gb + h * s->gh] : 1.0f;
                    uint8_t *c = (uint8_t *)s->codes + (b * s->cb + h * s->ch + t * s->ct) * csize;
                    void *sc = NULL;
                    if (s->scales)
                        sc = (void *)((uint8_t *)s->scales + (b * s->sb + h * s->sh + t * s->st) * ssize);
                    const float *aux = fmt == F_INT4_RHT || fmt == F_TQ_MSE4 || fmt == F_TQ_MSE3 ? s->aux
                                       : s->aux ? s->aux + ((b * H + h) * T + t) * (D / 16) : NULL;
                    write_row(fmt, row, D, g, aux, in_dtype == IN_BF16 || round_bf16, c, sc,
                              s->vals + b * s->vb + h * s->vh + t * s->vt);
                }
            }
    }
    return 0;
}

/* fp4_e2m1's first pass: max(bmax / 6, 1e-10) of every 16-element block of the new K and V as stored (rounded,
 * padding zeroed; bmax the finite |max|) into ratio_k / ratio_v, contiguous [B, H, T, D/16] as formats computes it.
 * Its log2 is then computed by torch (torch's log2 rounds its last bit by the element's place in a vectorised
 * loop, so the same tensor shape gives the same bits: formats.fp4_e2m1_exponent) and handed to kvcal_write. */
int kvcal_block_ratio(int in_dtype, int round_bf16, int64_t B, int64_t H, int64_t T, int D, const uint8_t *valid,
                     int64_t valid_b, side_t *k, side_t *v, float *ratio_k, float *ratio_v) {
    float row[1024];
    if (D > 1024) return -1;
    for (int which = 0; which < 2; which++) {
        side_t *s = which ? v : k;
        float *out = which ? ratio_v : ratio_k;
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < T; t++) {
                int real = valid == NULL || valid[b * valid_b + t];
                for (int64_t h = 0; h < H; h++) {
                    load_row(s, in_dtype, round_bf16, b, h, t, D, real, row);
                    float *o = out + ((b * H + h) * T + t) * (D / 16);
                    for (int kb = 0; kb < D / 16; kb++) {
                        float r = block_max(row + 16 * kb, 16) / 6.0f;  /* formats.fp4_e2m1_exponent's clamp */
                        o[kb] = r < 1e-10f ? 1e-10f : r;
                    }
                }
            }
    }
    return 0;
}
