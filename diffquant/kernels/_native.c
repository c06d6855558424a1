/* The native statistics pass of diffquant's profiler (issue 27): two traversals of a contiguous float32
 * tensor seen as `rows` rows of `width` values, in place of the dozen tensor-sized torch passes of
 * SiteStats.update. Compiled on first use by diffquant/kernels/native.py and called through ctypes; with no
 * C compiler the profiler keeps its torch path, the reference this file is tested against.
 *
 * Pass 1 (dq_pass1): extremes, each row's float64 sum, the abs-max per kept (head / channel) index, and the
 * signed log-histogram. The histogram counts the "fine code" of each value, its float32 bit pattern shifted
 * right by 14 (sign, 8 exponent bits, the top 9 mantissa bits: 2^18 codes), then folds codes into bins: a
 * fine interval lies inside exactly one bin, slot 1 + (e - 1) * 64 + k_of_m[m] for exponent e > 0, the zero
 * bin for e == 0, + slots for negatives (see diffquant/profile/stats.py). 6 and 100 are fine-interval edges,
 * so the counts of |x| >= 6 and >= 100 are read off the codes exactly. NaN / Inf (exponent 255) are
 * counted and left out of every statistic (the caller, which also locates them, is told how many).
 *
 * Pass 2 (dq_pass2): each row's central power sums about its float64 mean (float64: d = x - mean, sums of
 * d^2, d^3, d^4), the per-channel sums of squares (each square taken in float32 or float64 as the torch path
 * takes it, summed in float64), and the flat indices, in increasing order, of the entries with |x| >= bar
 * (top-k candidates: bar comes from pass 1's histogram) and of those with |x| > 100 (massive candidates).
 *
 * Determinism: no result depends on the thread count. Row sums are computed by one thread each in a fixed
 * lane order (element j of a row goes to accumulator j % 4, the four added as (a0 + a1) + (a2 + a3)); the
 * per-channel sums go through NSEG fixed row segments added in segment order; counts, extremes and abs-max
 * are exact in any order. Compiled without fast-math and with -ffp-contract=off, so vector code computes
 * exactly what is written here on every machine. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define NSEG 16
#define BINS_PER_OCTAVE 64
#define CODE_SHIFT 14        /* 23 mantissa bits - 9 kept */
#define N_CODES (1 << 18)    /* sign, exponent, 9 mantissa bits */
#define N_BLOCKS (1 << 9)    /* sign and exponent: 512 codes each */
#define CODE_6 (0x40C00000u >> CODE_SHIFT)
#define CODE_100 (0x42C80000u >> CODE_SHIFT)

static int n_threads(int want) {
#ifdef _OPENMP
    return want > 0 ? want : 1;
#else
    (void)want;
    return 1;
#endif
}

static int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline int64_t seg_start(int64_t s, int64_t rows) { return s * rows / NSEG; }

static inline int64_t keep_index(int64_t r, int64_t inner, int64_t groups, int64_t width, int percol) {
    int64_t g = (r / inner) % groups;
    return percol ? g * width : g;
}

/* Float order as integer order: the key of a float's bits (sign-magnitude) is monotonic in its value for
 * every non-NaN float, and a magnitude's bits (sign cleared) are monotonic in |x|; integer minima and maxima
 * vectorise, float ones (NaN rules) do not. */
static inline int32_t order_key(uint32_t b) { return (int32_t)(b ^ ((uint32_t)((int32_t)b >> 31) & 0x7FFFFFFFu)); }

static inline float key_value(int32_t k) {
    uint32_t b = (uint32_t)k ^ ((uint32_t)(k >> 31) & 0x7FFFFFFFu);
    float v;
    memcpy(&v, &b, sizeof v);
    return v;
}

/* The float64 sum of a row over 4 lanes (element j to lane j % 4, the lanes added as (0 + 1) + (2 + 3)). */
static double row_sum4(const float *row, int64_t n) {
    double s[4] = {0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 4 <= n; j += 4)
        for (int u = 0; u < 4; u++) s[u] += (double)row[j + u];
    for (; j < n; j++) s[j & 3] += (double)row[j];
    return (s[0] + s[1]) + (s[2] + s[3]);
}

/* One finite row of pass 1 besides the histogram and the sum: the extremes (as order keys) and the abs-max
 * (as magnitude bits, per column when percol). */
static void row_stats(const float *row, int64_t n, int32_t *kmin, int32_t *kmax, uint32_t *mmin, uint32_t *mmax,
                      uint32_t *am, int percol) {
    const uint32_t *bits = (const uint32_t *)row;
    int32_t lo = *kmin, hi = *kmax;
    uint32_t bot = *mmin, top = *mmax;
    for (int64_t j = 0; j < n; j++) {
        int32_t k = order_key(bits[j]);
        lo = k < lo ? k : lo;
        hi = k > hi ? k : hi;
        uint32_t m = bits[j] & 0x7FFFFFFFu;
        bot = m < bot ? m : bot;
        top = m > top ? m : top;
    }
    *kmin = lo;
    *kmax = hi;
    *mmin = bot;
    if (am && percol) {
        for (int64_t c = 0; c < n; c++) {
            uint32_t m = bits[c] & 0x7FFFFFFFu;
            am[c] = m > am[c] ? m : am[c];
        }
    } else if (am) {
        uint32_t row_top = 0;
        for (int64_t j = 0; j < n; j++) {
            uint32_t m = bits[j] & 0x7FFFFFFFu;
            row_top = m > row_top ? m : row_top;
        }
        *am = row_top > *am ? row_top : *am;
    }
    *mmax = top;
}

/* row_stats and the sum of a row holding NaN / Inf, those left out; returns how many there were. */
static int64_t row_stats_finite(const float *row, int64_t n, int32_t *kmin, int32_t *kmax, uint32_t *mmin,
                                uint32_t *mmax, double *sum, uint32_t *am, int percol) {
    const uint32_t *bits = (const uint32_t *)row;
    double s[4] = {0, 0, 0, 0};
    uint32_t top = 0;
    int64_t bad = 0;
    for (int64_t j = 0; j < n; j++) {
        uint32_t m = bits[j] & 0x7FFFFFFFu;
        if (m >= 0x7F800000u) { bad++; continue; }
        int32_t k = order_key(bits[j]);
        *kmin = k < *kmin ? k : *kmin;
        *kmax = k > *kmax ? k : *kmax;
        *mmin = m < *mmin ? m : *mmin;
        *mmax = m > *mmax ? m : *mmax;
        top = m > top ? m : top;
        if (am && percol) am[j] = m > am[j] ? m : am[j];
        s[j & 3] += (double)row[j];
    }
    *sum = (s[0] + s[1]) + (s[2] + s[3]);
    if (am && !percol) *am = top > *am ? top : *am;
    return bad;
}

/* x: rows x width float32, of which row r holds values only in columns ranges[2 q] .. ranges[2 q + 1] - 1,
 * q = r % period (ranges NULL: every column; the causal mask of an attention map, shared by its slices, gives
 * each query row one such range); the kept index of (row r, column c) is g * width + c (percol) or g, with
 * g = (r / inner) % groups, nkeep of them (absmax NULL: none). k_of_m[512]: the bin within its octave of each
 * 9-bit mantissa. Outputs: dense[2 * slots] (zeroed by the caller), row_sum[rows], absmax[nkeep] (zeroed),
 * row_count[rows] (values counted per row: NaN / Inf are left out of every statistic), ext[2] = min, max
 * (of the finite values), counts[3] = #|x| >= 6, #|x| >= 100, #NaN / Inf. Returns -1 when memory ran out,
 * else 0. */
int dq_pass1(const float *x, int64_t rows, int64_t width, const int64_t *ranges, int64_t period,
             int64_t inner, int64_t groups, int percol, int64_t nkeep, const int32_t *k_of_m, int64_t slots,
             int64_t *dense, double *row_sum, double *row_count, float *absmax, double *ext, int64_t *counts,
             int threads) {
    int nt = n_threads(threads);
    if (rows < nt) nt = rows > 0 ? (int)rows : 1;
    uint32_t *fine = calloc((size_t)nt * N_CODES, sizeof(uint32_t));
    uint32_t *amax = absmax ? calloc((size_t)nt * (size_t)nkeep, sizeof(uint32_t)) : NULL;
    int32_t *lo = malloc((size_t)nt * sizeof(int32_t)), *hi = malloc((size_t)nt * sizeof(int32_t));
    uint32_t *mlo = malloc((size_t)nt * sizeof(uint32_t)), *mhi = malloc((size_t)nt * sizeof(uint32_t));
    int64_t *nbad = calloc((size_t)nt, sizeof(int64_t));
    if (!fine || !lo || !hi || !mlo || !mhi || !nbad || (absmax && !amax)) {
        free(fine); free(amax); free(lo); free(hi); free(mlo); free(mhi); free(nbad);
        return -1;
    }
    for (int t = 0; t < nt; t++) { lo[t] = INT32_MAX; hi[t] = INT32_MIN; mlo[t] = 0x7F800000u; mhi[t] = 0; }
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static)
#endif
    for (int64_t r = 0; r < rows; r++) {
        int t = thread_id();
        uint32_t *h = fine + (size_t)t * N_CODES;
        int64_t a = ranges ? ranges[2 * (r % period)] : 0, n = ranges ? ranges[2 * (r % period) + 1] - a : width;
        const float *row = x + r * width + a;
        const uint32_t *bits = (const uint32_t *)row;
        for (int64_t j = 0; j < n; j++) h[bits[j] >> CODE_SHIFT]++;
        uint32_t *am = amax ? amax + (size_t)t * nkeep + keep_index(r, inner, groups, width, percol) : NULL;
        if (am && percol) am += a;
        /* a float64 sum of floats cannot overflow: it is finite exactly when every value is */
        double sum = row_sum4(row, n);
        int64_t bad = 0;
        if (isfinite(sum))
            row_stats(row, n, lo + t, hi + t, mlo + t, mhi + t, am, percol);
        else
            nbad[t] += bad = row_stats_finite(row, n, lo + t, hi + t, mlo + t, mhi + t, &sum, am, percol);
        row_sum[r] = sum;
        row_count[r] = (double)(n - bad);
    }
    int32_t kmin = INT32_MAX, kmax = INT32_MIN;
    int64_t ge6 = 0, ge100 = 0;
    for (int t = 0; t < nt; t++) {
        kmin = lo[t] < kmin ? lo[t] : kmin;
        kmax = hi[t] > kmax ? hi[t] : kmax;
        const uint32_t *h = fine + (size_t)t * N_CODES;
        counts[2] += nbad[t];  /* NaN / Inf: their codes (exponent 255) are binned nowhere */
        if (mlo[t] > mhi[t]) continue;  /* no finite value in this thread's rows */
        /* the exponents this thread's finite magnitudes span, for both signs: only those codes can be set */
        int e0 = (int)(mlo[t] >> 23), e1 = (int)(mhi[t] >> 23);
        for (int blk = 0; blk < N_BLOCKS; blk++) {
            int64_t e = blk & 0xFF, neg = blk >> 8;
            if (e < e0 || e > e1) continue;
            for (int m = 0; m < 512; m++) {
                uint32_t c = h[(blk << 9) | m];
                if (!c) continue;
                int64_t slot = e ? 1 + (e - 1) * BINS_PER_OCTAVE + k_of_m[m] : 0;
                dense[slot + (neg && slot ? slots : 0)] += c;
                uint32_t mag = (uint32_t)((e << 9) | m);
                ge6 += mag >= CODE_6 ? c : 0;
                ge100 += mag >= CODE_100 ? c : 0;
            }
        }
        if (absmax)
            for (int64_t i = 0; i < nkeep; i++) {
                uint32_t m = amax[(size_t)t * nkeep + i];
                float v;
                memcpy(&v, &m, sizeof v);
                absmax[i] = v > absmax[i] ? v : absmax[i];
            }
    }
    ext[0] = kmin <= kmax ? key_value(kmin) : INFINITY;
    ext[1] = kmin <= kmax ? key_value(kmax) : -INFINITY;
    counts[0] = ge6;
    counts[1] = ge100;
    free(fine); free(amax); free(lo); free(hi); free(mlo); free(mhi); free(nbad);
    return 0;
}

/* Candidate indices of one segment, grown as found. */
typedef struct { int64_t *idx; int64_t n, cap; } list_t;

static int push(list_t *l, int64_t i) {
    if (l->n == l->cap) {
        int64_t cap = l->cap ? 2 * l->cap : 256;
        int64_t *p = realloc(l->idx, (size_t)cap * sizeof(int64_t));
        if (!p) return -1;
        l->idx = p;
        l->cap = cap;
    }
    l->idx[l->n++] = i;
    return 0;
}

/* One row of pass 2's moments: the central power sums about `mean`, over 4 lanes. */
static void row_moments(const float *row, int64_t width, double mean, double *m2, double *m3, double *m4) {
    double a2[4] = {0, 0, 0, 0}, a3[4] = {0, 0, 0, 0}, a4[4] = {0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 4 <= width; j += 4)
        for (int u = 0; u < 4; u++) {
            double d = (double)row[j + u] - mean, d2 = d * d;
            a2[u] += d2;
            a3[u] += d2 * d;
            a4[u] += d2 * d2;
        }
    for (; j < width; j++) {
        double d = (double)row[j] - mean, d2 = d * d;
        a2[j & 3] += d2;
        a3[j & 3] += d2 * d;
        a4[j & 3] += d2 * d2;
    }
    *m2 = (a2[0] + a2[1]) + (a2[2] + a2[3]);
    *m3 = (a3[0] + a3[1]) + (a3[2] + a3[3]);
    *m4 = (a4[0] + a4[1]) + (a4[2] + a4[3]);
}

/* row_moments of a row holding NaN / Inf (mean over its finite values): the same lanes, those left out. */
static void row_moments_finite(const float *row, int64_t width, double mean, double *m2, double *m3,
                               double *m4) {
    double a2[4] = {0, 0, 0, 0}, a3[4] = {0, 0, 0, 0}, a4[4] = {0, 0, 0, 0};
    for (int64_t j = 0; j < width; j++) {
        if (!isfinite(row[j])) continue;
        double d = (double)row[j] - mean, d2 = d * d;
        a2[j & 3] += d2;
        a3[j & 3] += d2 * d;
        a4[j & 3] += d2 * d2;
    }
    *m2 = (a2[0] + a2[1]) + (a2[2] + a2[3]);
    *m3 = (a3[0] + a3[1]) + (a3[2] + a3[3]);
    *m4 = (a4[0] + a4[1]) + (a4[2] + a4[3]);
}

/* Indices (row offset base) of the entries of one row with |x| >= bar into top, > 100 into massive; blocks of
 * 64 whose largest magnitude is below both are skipped after one vectorised pass. */
static int row_candidates(const float *row, int64_t width, int64_t base, float bar, int want_massive,
                          list_t *top, list_t *massive) {
    float floor = want_massive && 100.0f < bar ? 100.0f : bar;
    for (int64_t j0 = 0; j0 < width; j0 += 64) {
        int64_t j1 = j0 + 64 < width ? j0 + 64 : width;
        float a8[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int64_t j = j0;
        for (; j + 8 <= j1; j += 8)
            for (int u = 0; u < 8; u++) {
                float a = fabsf(row[j + u]);
                a8[u] = a > a8[u] ? a : a8[u];
            }
        for (; j < j1; j++) {
            float a = fabsf(row[j]);
            a8[0] = a > a8[0] ? a : a8[0];
        }
        float blk = a8[0];
        for (int u = 1; u < 8; u++) blk = a8[u] > blk ? a8[u] : blk;
        if (blk < floor) continue;  /* NaN never passes: a block of NaN and small values is skipped */
        for (j = j0; j < j1; j++) {
            float a = fabsf(row[j]);
            if (!isfinite(a)) continue;
            if (a >= bar && push(top, base + j)) return -1;
            if (want_massive && a > 100.0f && push(massive, base + j)) return -1;
        }
    }
    return 0;
}

/* x, ranges, period, inner, groups, percol, nkeep: as for dq_pass1 (sums of squares need ranges NULL).
 * row_sum, row_count: pass 1's (row r's mean is row_sum[r] / row_count[r]; NaN / Inf are left out). m2, m3, m4[rows]: central power sums.
 * sumsq[nkeep] (NULL: not wanted): per kept index, the sum of squares, each square in float64 when square64
 * else in float32. bar (> FLT_MAX: none): collect the flat indices with |x| >= bar into top (at most
 * top_cap); want_massive: those with |x| > 100 into massive (at most massive_cap). n_out[2] = how many of
 * each were found (a count above its cap: the list was cut). Returns 0, or -1 when memory ran out. */
int dq_pass2(const float *x, int64_t rows, int64_t width, const int64_t *ranges, int64_t period,
             int64_t inner, int64_t groups, int percol, int64_t nkeep, const double *row_sum,
             const double *row_count, double *m2, double *m3, double *m4, double *sumsq,
             int square64, float bar, int64_t *top, int64_t top_cap, int want_massive, int64_t *massive,
             int64_t massive_cap, int64_t *n_out, int threads) {
    int nt = n_threads(threads);
    double *part = sumsq ? calloc((size_t)NSEG * (size_t)nkeep, sizeof(double)) : NULL;
    list_t tops[NSEG], mass[NSEG];
    int failed = 0;
    memset(tops, 0, sizeof tops);
    memset(mass, 0, sizeof mass);
    if (sumsq && !part) return -1;
    int want = bar <= 3.4028235e38f || want_massive;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) reduction(|| : failed)
#endif
    for (int64_t s = 0; s < NSEG; s++) {
        double *ps = part ? part + (size_t)s * nkeep : NULL;
        for (int64_t r = seg_start(s, rows); r < seg_start(s + 1, rows); r++) {
            int64_t a = ranges ? ranges[2 * (r % period)] : 0;
            int64_t n = ranges ? ranges[2 * (r % period) + 1] - a : width;
            const float *row = x + r * width + a;
            double cnt = row_count[r];
            if (cnt == (double)n) {
                row_moments(row, n, n ? row_sum[r] / cnt : 0.0, m2 + r, m3 + r, m4 + r);
            } else {  /* NaN / Inf in this row: every statistic leaves them out */
                row_moments_finite(row, n, cnt > 0 ? row_sum[r] / cnt : 0.0, m2 + r, m3 + r, m4 + r);
                if (ps && !ranges) {
                    double *sq = ps + keep_index(r, inner, groups, width, percol);
                    for (int64_t j = 0; j < n; j++) {
                        if (!isfinite(row[j])) continue;
                        double q = square64 ? (double)row[j] * (double)row[j] : (double)(row[j] * row[j]);
                        if (percol) sq[j] += q; else sq[0] += q;
                    }
                }
                if (want && row_candidates(row, n, r * width + a, bar, want_massive, &tops[s], &mass[s]))
                    failed = 1;
                continue;
            }
            if (ps && !ranges) {
                double *sq = ps + keep_index(r, inner, groups, width, percol);
                if (percol && square64)
                    for (int64_t j = 0; j < width; j++) sq[j] += (double)row[j] * (double)row[j];
                else if (percol)
                    for (int64_t j = 0; j < width; j++) sq[j] += (double)(row[j] * row[j]);
                else
                    for (int64_t j = 0; j < width; j++)
                        sq[0] += square64 ? (double)row[j] * (double)row[j] : (double)(row[j] * row[j]);
            }
            if (want && row_candidates(row, n, r * width + a, bar, want_massive, &tops[s], &mass[s]))
                failed = 1;
        }
    }
    int64_t n_top = 0, n_massive = 0;
    for (int s = 0; s < NSEG; s++) {
        for (int64_t i = 0; i < tops[s].n; i++, n_top++)
            if (n_top < top_cap) top[n_top] = tops[s].idx[i];
        for (int64_t i = 0; i < mass[s].n; i++, n_massive++)
            if (n_massive < massive_cap) massive[n_massive] = mass[s].idx[i];
        free(tops[s].idx);
        free(mass[s].idx);
    }
    n_out[0] = n_top;
    n_out[1] = n_massive;
    if (part) {
        for (int64_t i = 0; i < nkeep; i++) {
            double acc = 0;
            for (int s = 0; s < NSEG; s++) acc += part[(size_t)s * nkeep + i];
            sumsq[i] = acc;
        }
        free(part);
    }
    return failed ? -1 : 0;
}

/* Per-row sums of an attention map for the per-head metrics (diffquant/profile/attention_metrics.py), read in
 * place like dq_pass1 (row r's visible keys: columns ranges[2 q] .. ranges[2 q + 1] - 1, q = r % period).
 * mode 0 (a softmax map): out[4 r] = entropy sum_j -p_j log p_j (a zero p adds 0), out[4 r + 1] = the value
 * at key 0 when visible (else 0). mode 1 (a differential map D): out[4 r] = sum_j D_j, out[4 r + 1] = the
 * value at key 0 when visible, out[4 r + 2] = sum_j |D_j|, out[4 r + 3] = sum_j min(D_j, 0). Every term is
 * taken in float64 and summed over 4 lanes (j % 4), as the statistics pass sums. Returns 1 (outputs
 * incomplete) when a visible value is NaN / Inf, or negative in a softmax map (its entropy term is not a
 * number): the torch path then counts those rows. */
int dq_map_rows(const float *x, int64_t rows, int64_t width, const int64_t *ranges, int64_t period, int mode,
                double *out, int threads) {
    int nt = n_threads(threads);
    int bad = 0;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) reduction(|| : bad)
#endif
    for (int64_t r = 0; r < rows; r++) {
        int64_t a = ranges ? ranges[2 * (r % period)] : 0, n = ranges ? ranges[2 * (r % period) + 1] - a : width;
        const float *row = x + r * width + a;
        double s0[4] = {0, 0, 0, 0}, s1[4] = {0, 0, 0, 0}, s2[4] = {0, 0, 0, 0};
        int row_bad = 0;
        if (mode == 0) {
            for (int64_t j = 0; j < n; j++) {
                float p = row[j];
                if (!(p >= 0.0f) || isinf(p)) { row_bad = 1; break; }
                if (p > 0.0f) s0[j & 3] -= (double)p * (double)logf(p);
            }
        } else {
            for (int64_t j = 0; j < n; j++) {
                float d = row[j];
                if (!isfinite(d)) { row_bad = 1; break; }
                s0[j & 3] += (double)d;
                s1[j & 3] += fabs((double)d);
                s2[j & 3] += d < 0 ? (double)d : 0.0;
            }
        }
        bad = bad || row_bad;
        double *o = out + 4 * r;
        o[0] = (s0[0] + s0[1]) + (s0[2] + s0[3]);
        o[1] = (a == 0 && n > 0) ? (double)row[0] : 0.0;
        o[2] = (s1[0] + s1[1]) + (s1[2] + s1[3]);
        o[3] = (s2[0] + s2[1]) + (s2[2] + s2[3]);
    }
    return bad ? 1 : 0;
}

/* Symmetric dynamic fake quantization to integers with one fp32 scale per row (per token / row
 * granularity: w8a8's Linear inputs): s = amax / qmax (1 where that is 0), y = rint(x / s) * s, each step one
 * float32 operation as torch's fast path takes it (schemes.quantize_dynamic_finite: the division, round half
 * to even, the product; no clamp, since |x| <= amax keeps |x / s| below qmax + 0.5), in two traversals of a
 * row instead of five tensor passes. Returns 1 (out incomplete) when a value is NaN / Inf: the torch path
 * then counts and scrubs them. */
int dq_fake_int_rows(const float *x, int64_t rows, int64_t width, float qmax, float *out, int threads) {
    int nt = n_threads(threads);
    int bad = 0;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static) reduction(|| : bad)
#endif
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * width;
        const uint32_t *bits = (const uint32_t *)row;
        uint32_t top = 0;
        for (int64_t j = 0; j < width; j++) {
            uint32_t m = bits[j] & 0x7FFFFFFFu;
            top = m > top ? m : top;
        }
        if (top >= 0x7F800000u) { bad = 1; continue; }
        float amax;
        memcpy(&amax, &top, sizeof amax);
        float s = amax / qmax;
        if (!(s > 0.0f)) s = 1.0f;
        float *o = out + r * width;
        for (int64_t j = 0; j < width; j++) o[j] = rintf(row[j] / s) * s;
    }
    return bad ? 1 : 0;
}
