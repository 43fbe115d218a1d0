/* Calibration's |x| histogram in one pass (kvcal/calibrate/histogram.py; its torch reference `histogram_ref` there,
 * held to it bit for bit by tests/calibrate/test_observers.py). Compiled by kvcal/clib.py with -ffp-contract=off,
 * no fast-math: every float operation is the one torch performs, in the same order.
 *
 * a: |x| as float32 [H, N] contiguous; l: torch.log2(a), the same shape (torch's log2, whose last bit C's log2f
 * need not match). Bin of an element: floor((l - lo) * per_octave) clamped to [0, nbins - 1], in float32 as torch
 * computes it. Per head and bin, added in element order as torch.bincount adds: the count, the sum of (double)a and
 * of (double)a * (double)a, into cnt, s1, s2 [H, nbins] (zeroed by the caller). */
#include <stdint.h>

void kvcal_hist_update(const float *a, const float *l, int64_t H, int64_t N, int64_t nbins, int lo, int per_octave,
                       double *cnt, double *s1, double *s2) {
    const float flo = (float)lo, fper = (float)per_octave, top = (float)(nbins - 1);
    for (int64_t h = 0; h < H; h++) {
        const float *ah = a + h * N, *lh = l + h * N;
        double *c = cnt + h * nbins, *p = s1 + h * nbins, *q = s2 + h * nbins;
        for (int64_t i = 0; i < N; i++) {
            float t = (lh[i] - flo) * fper;
            /* floor, then clamp: below 0 (and -inf, log2 of 0) is bin 0, at or above the top the last bin, and in
             * between truncation is floor (no libm floorf call in the loop) */
            int64_t b = t <= 0.0f ? 0 : (t >= top ? nbins - 1 : (int64_t)t);
            double v = (double)ah[i];
            c[b] += 1.0;
            p[b] += v;
            q[b] += v * v;
        }
    }
}
