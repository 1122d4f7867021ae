/* The fused O2/O5 optimizer step, in C: one pass per parameter.

   The plain O2 step moves every parameter through memory three or four times
   (half gradient -> FP32 buffer, unscale, the optimizer's update of the FP32
   master, master -> half weight). This kernel does it in one: it reads the
   gradient (FP32, BF16 or FP16) and multiplies it by the inverse loss scale,
   updates the FP32 master and the optimizer state, and writes the half weight,
   for torch.optim.SGD and Adam/AdamW. amp_patch.precision.onepass prepares
   the call (raw pointers of contiguous CPU tensors, checked there) and falls
   back to the plain step for everything else.

   Same numbers as torch. Each update is written with the float operations of
   torch's single-tensor CPU implementation (torch/optim/sgd.py, adam.py) in
   the order its kernels evaluate them: a.add(b, alpha=s) is fma(b, s, a),
   addcmul_ is fma(s * t1, t2, self), lerp_ with a small weight is
   fma(w, end - self, self), mul_ and the division of addcdiv_ are plain. The
   file is compiled with -ffp-contract=off, so the compiler fuses nothing we
   did not write. torch.sqrt on an MKL build is MKL's vsSqrt, within 1 ulp but
   not always correctly rounded: Adam calls that very routine (set_sqrt; the
   Python side checks it against torch.sqrt first) on blocks small enough to
   stay in L1 between the two halves of its update. The masters and the
   state come out bit for bit as the plain step's (tests/precision/test_onepass_step.py).

   Vectorized by hand for AVX-512 and AVX2 (+FMA, F16C) in functions with
   target attributes, chosen at run time (__builtin_cpu_supports), with a
   scalar version of the same operations for other CPUs and for the tails.
   BF16 is rounded to nearest even by integer operations; FP16 goes through
   F16C where the CPU has it and a portable conversion otherwise. The work is
   cut into chunks that the calling thread and (threads - 1) pthreads take in
   turn, with the GIL released.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define FS_X86 1
#include <immintrin.h>
#else
#define FS_X86 0
#endif

enum { K_NONE = 0, K_F32 = 1, K_BF16 = 2, K_F16 = 3 };
enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

#define CHUNK 16384 /* elements per unit of work: a multiple of every vector width */

/* ------------------------------------------------------------------ what one call works on */

typedef struct {
    float *p;          /* FP32 master (or an FP32 parameter of its own) */
    const void *g;     /* gradient, kind gk */
    float *a;          /* SGD momentum buffer / Adam exp_avg (NULL: none) */
    float *b;          /* Adam exp_avg_sq */
    float *c;          /* Adam max_exp_avg_sq (amsgrad) */
    void *h;           /* half weight, kind hk (NULL: none) */
    int64_t n;
    int gk, hk;
    int init;          /* SGD: the momentum buffer is new: it becomes the gradient (torch's first step) */
    float *step;       /* Adam: the parameter's step count (FP32, as torch keeps it) */
    float neg_step;    /* Adam: -lr / bias_correction1 at this step */
    float bc2;         /* Adam: sqrt(bias_correction2) at this step */
} Item;

typedef struct {
    int adam;
    float inv;
    int maximize;
    /* SGD */
    int has_wd, has_mom, nesterov;
    float wd, mom, omd, neg_lr; /* omd: 1 - dampening */
    /* Adam */
    int decoupled, amsgrad, small;
    float w1, w1m1, beta2, omb2, eps, decay; /* w1: 1 - beta1 (lerp weight), w1m1: w1 - 1 */
} Hyper;

/* ------------------------------------------------------------------ scalar conversions */

static inline uint32_t f2u(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static inline float u2f(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

static inline float bf16_to_f32(uint16_t v) { return u2f((uint32_t)v << 16); }

static inline uint16_t f32_to_bf16(float x) {
    /* round to nearest even, as c10::BFloat16 does */
    uint32_t u = f2u(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f) return u2f(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0) return u2f(sign);
        /* subnormal: man * 2^-24, exact in FP32 */
        float f = (float)man * 5.9604644775390625e-08f;
        return u2f(sign | f2u(f));
    }
    return u2f(sign | ((exp + 112u) << 23) | (man << 13));
}

static inline uint16_t f32_to_f16(float x) {
    /* round to nearest even; overflow to inf, NaN stays NaN (quiet) */
    uint32_t u = f2u(x);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a >= 0x7f800000u) return sign | (a > 0x7f800000u ? (uint16_t)(0x7e00u | ((a >> 13) & 0x3ffu)) : 0x7c00u);
    if (a >= 0x477ff000u) return sign | 0x7c00u; /* rounds to 65536 or more */
    if (a < 0x38800000u) {                       /* below 2^-14: subnormal or zero */
        if (a < 0x33000000u) return sign;        /* below half the smallest subnormal: rounds to 0 */
        /* x / 2^-24 = m * 2^(e - 126): drop 126 - e (14 to 24) bits of m, rounding to nearest even */
        uint32_t e = a >> 23, m = (a & 0x7fffffu) | 0x800000u, drop = 126u - e;
        uint32_t half = 1u << (drop - 1), rest = m & ((1u << drop) - 1u), r = m >> drop;
        if (rest > half || (rest == half && (r & 1u))) r++;
        return sign | (uint16_t)r;
    }
    uint32_t r = a - 0x38000000u; /* rebias 127 -> 15 */
    r = r + 0xfffu + ((r >> 13) & 1u);
    return sign | (uint16_t)(r >> 13);
}

static inline float load_g(const void *g, int gk, int64_t i) {
    switch (gk) {
    case K_BF16: return bf16_to_f32(((const uint16_t *)g)[i]);
    case K_F16: return f16_to_f32(((const uint16_t *)g)[i]);
    default: return ((const float *)g)[i];
    }
}

static inline void store_h(void *h, int hk, int64_t i, float x) {
    if (hk == K_BF16) ((uint16_t *)h)[i] = f32_to_bf16(x);
    else if (hk == K_F16) ((uint16_t *)h)[i] = f32_to_f16(x);
    else if (hk == K_F32) ((float *)h)[i] = x;
}

/* torch.maximum: NaN if either is NaN (all ones, as its vectorized kernel gives) */
static inline float max_nan(float a, float b) {
    if (a != a || b != b) return u2f(0xffffffffu);
    return a > b ? a : b;
}

/* ------------------------------------------------------------------ scalar kernels (also the tails) */

/* Returns nonzero when a gradient element was inf or NaN (after unscaling). */
static int sgd_scalar(const Item *it, const Hyper *hp, int64_t lo, int64_t hi) {
    int bad = 0;
    for (int64_t i = lo; i < hi; i++) {
        float p = it->p[i];
        float g = load_g(it->g, it->gk, i) * hp->inv;
        bad |= !isfinite(g);
        if (hp->maximize) g = -g;
        if (hp->has_wd) g = fmaf(p, hp->wd, g);
        if (hp->has_mom) {
            float b = g;
            if (!it->init) b = fmaf(g, hp->omd, it->a[i] * hp->mom);
            it->a[i] = b;
            g = hp->nesterov ? fmaf(b, hp->mom, g) : b;
        }
        p = fmaf(g, hp->neg_lr, p);
        it->p[i] = p;
        store_h(it->h, it->hk, i, p);
    }
    return bad;
}

/* Adam in two halves around the square root (torch takes it from its own routine, which a
   block of this kernel calls too, see sqrt_block): first the moments (and AdamW's decay), then
   the denominator and the master. A block is small enough to stay in L1 between the halves. */
static int adam_moments_scalar(const Item *it, const Hyper *hp, int64_t lo, int64_t hi) {
    int bad = 0;
    for (int64_t i = lo; i < hi; i++) {
        float p = it->p[i];
        float g = load_g(it->g, it->gk, i) * hp->inv;
        bad |= !isfinite(g);
        if (hp->maximize) g = -g;
        if (hp->has_wd) {
            if (hp->decoupled) it->p[i] = p = p * hp->decay;
            else g = fmaf(p, hp->wd, g);
        }
        float m = it->a[i];
        m = hp->small ? fmaf(hp->w1, g - m, m) : fmaf(hp->w1m1, g - m, g);
        it->a[i] = m;
        float v = it->b[i] * hp->beta2;
        v = fmaf(hp->omb2 * g, g, v);
        it->b[i] = v;
        if (hp->amsgrad) it->c[i] = max_nan(it->c[i], v);
    }
    return bad;
}

/* root[i - lo] = sqrt of the second moment the denominator uses */
static void adam_master_scalar(const Item *it, const Hyper *hp, int64_t lo, int64_t hi, const float *root) {
    for (int64_t i = lo; i < hi; i++) {
        float den = root[i - lo] / it->bc2 + hp->eps;
        float p = it->p[i] + (it->neg_step * it->a[i]) / den;
        it->p[i] = p;
        store_h(it->h, it->hk, i, p);
    }
}

static void sqrt_scalar(const float *x, float *r, int64_t n) {
    for (int64_t i = 0; i < n; i++) r[i] = sqrtf(x[i]);
}

/* Gradient absorption: p (an FP32 master gradient) takes the gradient g times inv, as
   torch's unscale-and-check computes it (the element is checked before the multiply, and
   inv == 1 multiplies nothing). it->init is the mode: ABS_WRITE p = v, ABS_ADD p = p + v,
   ABS_ZERO_ADD p = 0 + v (what adding into a zeroed buffer gives, -0 becoming +0).
   h (kind gk, or NULL): where the new p, rounded to the gradient's kind, is written too, in
   the same pass: the model's .grad as a view of the master's (usually g itself, in place),
   so it need not be read back from p afterwards. */
enum { ABS_WRITE = 0, ABS_ADD = 1, ABS_ZERO_ADD = 2 };

/* Whether absorb writes h: not where h is g and p = g exactly (written, not scaled), so
   rounding p gives g back: the half gradient holds the view already. */
static inline int writes_back(const Item *it, const Hyper *hp) {
    return it->h != NULL && !(it->h == it->g && hp->inv == 1.0f && it->init == ABS_WRITE);
}

static int absorb_scalar(const Item *it, const Hyper *hp, int64_t lo, int64_t hi) {
    int bad = 0;
    const int scale = hp->inv != 1.0f, mode = it->init, mirror = writes_back(it, hp);
    for (int64_t i = lo; i < hi; i++) {
        float v = load_g(it->g, it->gk, i);
        bad |= !isfinite(v);
        if (scale) v = v * hp->inv;
        if (mode == ABS_ADD) v = it->p[i] + v;
        else if (mode == ABS_ZERO_ADD) v = 0.0f + v;
        it->p[i] = v;
        if (mirror) store_h(it->h, it->gk, i, v);
    }
    return bad;
}

static int check_scalar(const Item *it, int64_t lo, int64_t hi) {
    int bad = 0;
    for (int64_t i = lo; i < hi; i++) bad |= !isfinite(load_g(it->g, it->gk, i));
    return bad;
}

/* ------------------------------------------------------------------ vector kernels

   One body per operation, instantiated for AVX-512 and AVX2 through the V_*
   macros below: the same operations as the scalar kernels, W lanes at a time. */

#if FS_X86

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx2")))
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

/* --- AVX-512 */
AVX512_TARGET static inline __m512 z_load_g(const void *g, int gk, int64_t i) {
    if (gk == K_F32) return _mm512_loadu_ps((const float *)g + i);
    __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)g + i));
    if (gk == K_F16) return _mm512_cvtph_ps(raw);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

/* nt: a streaming store (h + i is 32-byte aligned): the half weight is only written */
AVX512_TARGET static inline void z_put16(void *dst, __m256i v, int nt) {
    if (nt) _mm256_stream_si256((__m256i *)dst, v);
    else _mm256_storeu_si256((__m256i *)dst, v);
}

AVX512_TARGET static inline void z_store_h(void *h, int hk, int64_t i, __m512 x, int nt) {
    if (hk == K_F16) {
        z_put16((uint16_t *)h + i, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), nt);
    } else if (hk == K_BF16) {
        __m512i u = _mm512_castps_si512(x);
        __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
        __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
        z_put16((uint16_t *)h + i, _mm512_cvtepi32_epi16(r), nt);
    } else if (hk == K_F32) {
        _mm512_storeu_ps((float *)h + i, x);
    }
}

AVX512_TARGET static inline __m512 z_max_nan(__m512 a, __m512 b) {
    __m512 m = _mm512_max_ps(a, b); /* b where equal or unordered; a > b ? a : b otherwise */
    __mmask16 un = _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
    return _mm512_mask_mov_ps(m, un, _mm512_castsi512_ps(_mm512_set1_epi32(-1)));
}

#define z_ANY_NAN(acc) (_mm512_cmp_ps_mask(acc, acc, _CMP_UNORD_Q) != 0)

/* --- AVX2 */
AVX2_TARGET static inline __m256 y_load_g(const void *g, int gk, int64_t i) {
    if (gk == K_F32) return _mm256_loadu_ps((const float *)g + i);
    __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)g + i));
    if (gk == K_F16) return _mm256_cvtph_ps(raw);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

AVX2_TARGET static inline void y_put8(void *dst, __m128i v, int nt) {
    if (nt) _mm_stream_si128((__m128i *)dst, v);
    else _mm_storeu_si128((__m128i *)dst, v);
}

AVX2_TARGET static inline void y_store_h(void *h, int hk, int64_t i, __m256 x, int nt) {
    if (hk == K_F16) {
        y_put8((uint16_t *)h + i, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), nt);
    } else if (hk == K_BF16) {
        __m256i u = _mm256_castps_si256(x);
        __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
        __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
        r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc0)), nan));
        /* 8 x u32 (each < 2^16) -> 8 x u16: pack within lanes, then gather the two lanes' low halves */
        __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
        y_put8((uint16_t *)h + i, _mm256_castsi256_si128(packed), nt);
    } else if (hk == K_F32) {
        _mm256_storeu_ps((float *)h + i, x);
    }
}

AVX2_TARGET static inline __m256 y_max_nan(__m256 a, __m256 b) {
    __m256 m = _mm256_max_ps(a, b);
    __m256 un = _mm256_cmp_ps(a, b, _CMP_UNORD_Q);
    return _mm256_or_ps(m, un);
}

#define y_ANY_NAN(acc) (_mm256_movemask_ps(_mm256_cmp_ps(acc, acc, _CMP_UNORD_Q)) != 0)

/* Half weights of at least this many elements are written with streaming stores: they
   are far larger than the caches, and a plain store would read each line in first. */
static int64_t g_stream_min = (int64_t)1 << 21;

static inline int streams(const Item *it) {
    return it->h != NULL && it->n >= g_stream_min && ((uintptr_t)it->h & 31) == 0;
}

/* The vector kernels, once for both instruction sets: SUF names them, P is the
   intrinsics' prefix (_mm512, _mm256), VF the vector type, W its lanes, PRE the
   helpers' prefix (z_, y_). Each loop is an always-inline function specialized
   by the switch below it on the gradient and half kinds, with every field it
   reads copied into a local first (the stores through float pointers could
   otherwise alias the Item and Hyper it reads, and the compiler would reload
   them, and branch on them, in every iteration). */
#define BAD(P, acc, g) acc = P##_add_ps(acc, P##_mul_ps(g, P##_setzero_ps())) /* NaN iff g is inf/NaN */
#define NEG(P, VF, g) P##_xor_ps(g, P##_castsi##VF##_ps(P##_set1_epi32((int)0x80000000u)))

#define KIND_SWITCH(call_g_h)                                                                     \
    switch (it->gk * 4 + it->hk) {                                                                \
    case 1 * 4 + 0: call_g_h(1, 0); break;                                                        \
    case 1 * 4 + 2: call_g_h(1, 2); break;                                                        \
    case 1 * 4 + 3: call_g_h(1, 3); break;                                                        \
    case 2 * 4 + 0: call_g_h(2, 0); break;                                                        \
    case 2 * 4 + 2: call_g_h(2, 2); break;                                                        \
    case 2 * 4 + 3: call_g_h(2, 3); break;                                                        \
    case 3 * 4 + 0: call_g_h(3, 0); break;                                                        \
    case 3 * 4 + 2: call_g_h(3, 2); break;                                                        \
    case 3 * 4 + 3: call_g_h(3, 3); break;                                                        \
    default: call_g_h(it->gk, it->hk); break;                                                     \
    }

#define DEFINE_VECTOR_KERNELS(SUF, TARGET, P, VF, W, PRE)                                         \
TARGET static inline __attribute__((always_inline)) int sgd_loop_##SUF(                          \
        const Item *it, const Hyper *hp, int64_t lo, int64_t end, const int gk, const int hk) {   \
    float *const pp = it->p, *const aa = it->a;                                                   \
    const void *const gg = it->g;                                                                 \
    void *const hh = it->h;                                                                       \
    const int maximize = hp->maximize, has_wd = hp->has_wd, has_mom = hp->has_mom;                \
    const int nesterov = hp->nesterov, nt = streams(it), init = it->init;                         \
    const __m##VF inv = P##_set1_ps(hp->inv), wd = P##_set1_ps(hp->wd), mom = P##_set1_ps(hp->mom); \
    const __m##VF omd = P##_set1_ps(hp->omd), nlr = P##_set1_ps(hp->neg_lr);                      \
    __m##VF acc = P##_setzero_ps();                                                               \
    for (int64_t i = lo; i < end; i += W) {                                                       \
        __m##VF p = P##_loadu_ps(pp + i);                                                         \
        __m##VF g = P##_mul_ps(PRE##load_g(gg, gk, i), inv);                                      \
        BAD(P, acc, g);                                                                           \
        if (maximize) g = NEG(P, VF, g);                                                          \
        if (has_wd) g = P##_fmadd_ps(p, wd, g);                                                   \
        if (has_mom) {                                                                            \
            __m##VF b = g;                                                                        \
            if (!init) b = P##_fmadd_ps(g, omd, P##_mul_ps(P##_loadu_ps(aa + i), mom));           \
            P##_storeu_ps(aa + i, b);                                                             \
            g = nesterov ? P##_fmadd_ps(b, mom, g) : b;                                           \
        }                                                                                         \
        p = P##_fmadd_ps(g, nlr, p);                                                              \
        P##_storeu_ps(pp + i, p);                                                                 \
        PRE##store_h(hh, hk, i, p, nt);                                                           \
    }                                                                                             \
    return PRE##ANY_NAN(acc);                                                                     \
}                                                                                                 \
                                                                                                  \
TARGET static int sgd_##SUF(const Item *it, const Hyper *hp, int64_t lo, int64_t hi) {            \
    int64_t end = lo + (hi - lo) / W * W;                                                         \
    int bad = 0;                                                                                  \
    KIND_SWITCH(SGD_CALL_##SUF)                                                                   \
    return bad | sgd_scalar(it, hp, end, hi);                                                     \
}                                                                                                 \
                                                                                                  \
TARGET static inline __attribute__((always_inline)) int adam_moments_loop_##SUF(                 \
        const Item *it, const Hyper *hp, int64_t lo, int64_t end, const int gk) {                 \
    float *const pp = it->p, *const aa = it->a, *const bb = it->b, *const cc = it->c;            \
    const void *const gg = it->g;                                                                 \
    const int maximize = hp->maximize, has_wd = hp->has_wd, decoupled = hp->decoupled;            \
    const int amsgrad = hp->amsgrad, small = hp->small;                                           \
    const __m##VF inv = P##_set1_ps(hp->inv), wd = P##_set1_ps(hp->wd), decay = P##_set1_ps(hp->decay); \
    const __m##VF w = P##_set1_ps(small ? hp->w1 : hp->w1m1), b2 = P##_set1_ps(hp->beta2);        \
    const __m##VF omb2 = P##_set1_ps(hp->omb2);                                                   \
    __m##VF acc = P##_setzero_ps();                                                               \
    for (int64_t i = lo; i < end; i += W) {                                                       \
        __m##VF g = P##_mul_ps(PRE##load_g(gg, gk, i), inv);                                      \
        BAD(P, acc, g);                                                                           \
        if (maximize) g = NEG(P, VF, g);                                                          \
        if (has_wd) {                                                                             \
            __m##VF p = P##_loadu_ps(pp + i);                                                     \
            if (decoupled) P##_storeu_ps(pp + i, P##_mul_ps(p, decay));                           \
            else g = P##_fmadd_ps(p, wd, g);                                                      \
        }                                                                                         \
        __m##VF m = P##_loadu_ps(aa + i);                                                         \
        m = P##_fmadd_ps(w, P##_sub_ps(g, m), small ? m : g);                                     \
        P##_storeu_ps(aa + i, m);                                                                 \
        __m##VF v = P##_mul_ps(P##_loadu_ps(bb + i), b2);                                         \
        v = P##_fmadd_ps(P##_mul_ps(omb2, g), g, v);                                              \
        P##_storeu_ps(bb + i, v);                                                                 \
        if (amsgrad) P##_storeu_ps(cc + i, PRE##max_nan(P##_loadu_ps(cc + i), v));                \
    }                                                                                             \
    return PRE##ANY_NAN(acc);                                                                     \
}                                                                                                 \
                                                                                                  \
TARGET static int adam_moments_##SUF(const Item *it, const Hyper *hp, int64_t lo, int64_t hi) {   \
    int64_t end = lo + (hi - lo) / W * W;                                                         \
    int bad;                                                                                      \
    switch (it->gk) {                                                                             \
    case K_BF16: bad = adam_moments_loop_##SUF(it, hp, lo, end, K_BF16); break;                  \
    case K_F16: bad = adam_moments_loop_##SUF(it, hp, lo, end, K_F16); break;                    \
    default: bad = adam_moments_loop_##SUF(it, hp, lo, end, K_F32); break;                       \
    }                                                                                             \
    return bad | adam_moments_scalar(it, hp, end, hi);                                            \
}                                                                                                 \
                                                                                                  \
TARGET static inline __attribute__((always_inline)) void adam_master_loop_##SUF(                 \
        const Item *it, const Hyper *hp, int64_t lo, int64_t end, const float *root, const int hk) { \
    float *const pp = it->p;                                                                      \
    const float *const aa = it->a;                                                                \
    void *const hh = it->h;                                                                       \
    const __m##VF eps = P##_set1_ps(hp->eps), bc2 = P##_set1_ps(it->bc2);                         \
    const __m##VF nstep = P##_set1_ps(it->neg_step);                                              \
    const int nt = streams(it);                                                                   \
    for (int64_t i = lo; i < end; i += W) {                                                       \
        __m##VF den = P##_add_ps(P##_div_ps(P##_loadu_ps(root + (i - lo)), bc2), eps);            \
        __m##VF q = P##_div_ps(P##_mul_ps(nstep, P##_loadu_ps(aa + i)), den);                     \
        __m##VF p = P##_add_ps(P##_loadu_ps(pp + i), q);                                          \
        P##_storeu_ps(pp + i, p);                                                                 \
        PRE##store_h(hh, hk, i, p, nt);                                                           \
    }                                                                                             \
}                                                                                                 \
                                                                                                  \
TARGET static void adam_master_##SUF(const Item *it, const Hyper *hp, int64_t lo, int64_t hi, const float *root) { \
    int64_t end = lo + (hi - lo) / W * W;                                                         \
    switch (it->hk) {                                                                             \
    case K_BF16: adam_master_loop_##SUF(it, hp, lo, end, root, K_BF16); break;                    \
    case K_F16: adam_master_loop_##SUF(it, hp, lo, end, root, K_F16); break;                      \
    default: adam_master_loop_##SUF(it, hp, lo, end, root, it->hk); break;                        \
    }                                                                                             \
    adam_master_scalar(it, hp, end, hi, root + (end - lo));                                       \
}                                                                                                 \
                                                                                                  \
TARGET static void sqrt_##SUF(const float *x, float *r, int64_t n) {                              \
    int64_t end = n / W * W;                                                                      \
    for (int64_t i = 0; i < end; i += W) P##_storeu_ps(r + i, P##_sqrt_ps(P##_loadu_ps(x + i)));  \
    sqrt_scalar(x + end, r + end, n - end);                                                       \
}                                                                                                 \
                                                                                                  \
TARGET static inline __attribute__((always_inline)) int check_loop_##SUF(                        \
        const void *gg, int64_t lo, int64_t end, const int gk) {                                  \
    __m##VF acc = P##_setzero_ps();                                                               \
    for (int64_t i = lo; i < end; i += W) BAD(P, acc, PRE##load_g(gg, gk, i));                    \
    return PRE##ANY_NAN(acc);                                                                     \
}                                                                                                 \
                                                                                                  \
TARGET static int check_##SUF(const Item *it, int64_t lo, int64_t hi) {                           \
    int64_t end = lo + (hi - lo) / W * W;                                                         \
    int bad;                                                                                      \
    switch (it->gk) {                                                                             \
    case K_BF16: bad = check_loop_##SUF(it->g, lo, end, K_BF16); break;                           \
    case K_F16: bad = check_loop_##SUF(it->g, lo, end, K_F16); break;                             \
    default: bad = check_loop_##SUF(it->g, lo, end, K_F32); break;                                \
    }                                                                                             \
    return bad | check_scalar(it, end, hi);                                                       \
}                                                                                                 \
                                                                                                  \
TARGET static inline __attribute__((always_inline)) int absorb_loop_##SUF(                       \
        const Item *it, const Hyper *hp, int64_t lo, int64_t end, const int gk, const int mode) { \
    float *const pp = it->p;                                                                      \
    const void *const gg = it->g;                                                                 \
    void *const hh = it->h;                                                                       \
    const int scale = hp->inv != 1.0f;                                                            \
    const int mirror = writes_back(it, hp);                                                       \
    const int nt = mode == ABS_WRITE && it->n >= g_stream_min && ((uintptr_t)pp & 63) == 0;       \
    const __m##VF inv = P##_set1_ps(hp->inv), zero = P##_setzero_ps();                            \
    __m##VF acc = P##_setzero_ps();                                                               \
    for (int64_t i = lo; i < end; i += W) {                                                       \
        __m##VF v = PRE##load_g(gg, gk, i);                                                       \
        BAD(P, acc, v);                                                                           \
        if (scale) v = P##_mul_ps(v, inv);                                                        \
        if (mode == ABS_ADD) v = P##_add_ps(P##_loadu_ps(pp + i), v);                             \
        else if (mode == ABS_ZERO_ADD) v = P##_add_ps(zero, v);                                   \
        if (nt) P##_stream_ps(pp + i, v);                                                         \
        else P##_storeu_ps(pp + i, v);                                                            \
        if (mirror) PRE##store_h(hh, gk, i, v, 0);                                                \
    }                                                                                             \
    return PRE##ANY_NAN(acc);                                                                     \
}                                                                                                 \
                                                                                                  \
TARGET static int absorb_##SUF(const Item *it, const Hyper *hp, int64_t lo, int64_t hi) {        \
    int64_t end = lo + (hi - lo) / W * W;                                                         \
    int bad;                                                                                      \
    switch (it->gk * 4 + it->init) {                                                              \
    case K_BF16 * 4 + ABS_WRITE: bad = absorb_loop_##SUF(it, hp, lo, end, K_BF16, ABS_WRITE); break; \
    case K_F16 * 4 + ABS_WRITE: bad = absorb_loop_##SUF(it, hp, lo, end, K_F16, ABS_WRITE); break; \
    case K_BF16 * 4 + ABS_ADD: bad = absorb_loop_##SUF(it, hp, lo, end, K_BF16, ABS_ADD); break;  \
    case K_F16 * 4 + ABS_ADD: bad = absorb_loop_##SUF(it, hp, lo, end, K_F16, ABS_ADD); break;    \
    default: bad = absorb_loop_##SUF(it, hp, lo, end, it->gk, it->init); break;                   \
    }                                                                                             \
    return bad | absorb_scalar(it, hp, end, hi);                                                  \
}

#define SGD_CALL_avx512(G, H) bad = sgd_loop_avx512(it, hp, lo, end, G, H)
#define SGD_CALL_avx2(G, H) bad = sgd_loop_avx2(it, hp, lo, end, G, H)

DEFINE_VECTOR_KERNELS(avx512, AVX512_TARGET, _mm512, 512, 16, z_)
DEFINE_VECTOR_KERNELS(avx2, AVX2_TARGET, _mm256, 256, 8, y_)

#endif /* FS_X86 */

/* ------------------------------------------------------------------ dispatch */

static int best_isa(void) {
#if FS_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx2"))
        return ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return ISA_AVX2;
#endif
    return ISA_SCALAR;
}

static int g_best = ISA_SCALAR; /* what this CPU can run */
static int g_isa = ISA_SCALAR;  /* what runs (tests lower it to compare the versions) */

enum { OP_SGD = 0, OP_ADAM = 1, OP_CHECK = 2, OP_ABSORB = 3 };

/* torch's own square root routine, when amp_patch.precision.onepass found one that gives
   exactly what torch.sqrt gives (set_sqrt); NULL: the CPU's correctly rounded one */
typedef void (*sqrt_fn)(int n, const float *x, float *r);
static sqrt_fn g_sqrt = NULL;
/* MKL's MKL_Set_Num_Threads_Local (mkl_set_num_threads_local in its C header), where
   g_sqrt is MKL's: each thread of this kernel makes MKL sequential while it runs.
   Otherwise, after torch.set_num_threads(n), every sqrt call from these threads starts
   an OpenMP team of its own (n threads each, on a machine the kernel's threads already
   fill): measured 3x slower than sequential on 2 cores. */
typedef int (*local_threads_fn)(int n);
static local_threads_fn g_local_threads = NULL;

#define BLOCK 4096 /* Adam's elements per half-pass pair: p, m, v and the roots stay in L2; few calls of torch's sqrt */

static int adam_range(int isa, const Item *it, const Hyper *hp, int64_t lo, int64_t hi) {
    float root[BLOCK];
    int bad = 0;
    for (int64_t b = lo; b < hi; b += BLOCK) {
        int64_t e = b + BLOCK < hi ? b + BLOCK : hi;
        const float *second = (hp->amsgrad ? it->c : it->b) + b;
#if FS_X86
        if (isa == ISA_AVX512) {
            bad |= adam_moments_avx512(it, hp, b, e);
            if (g_sqrt) g_sqrt((int)(e - b), second, root); else sqrt_avx512(second, root, e - b);
            adam_master_avx512(it, hp, b, e, root);
            continue;
        }
        if (isa == ISA_AVX2) {
            bad |= adam_moments_avx2(it, hp, b, e);
            if (g_sqrt) g_sqrt((int)(e - b), second, root); else sqrt_avx2(second, root, e - b);
            adam_master_avx2(it, hp, b, e, root);
            continue;
        }
#endif
        (void)isa;
        bad |= adam_moments_scalar(it, hp, b, e);
        if (g_sqrt) g_sqrt((int)(e - b), second, root); else sqrt_scalar(second, root, e - b);
        adam_master_scalar(it, hp, b, e, root);
    }
    return bad;
}

static int run_range(int op, int isa, const Item *it, const Hyper *hp, int64_t lo, int64_t hi) {
    if (op == OP_ADAM) return adam_range(isa, it, hp, lo, hi);
    if (op == OP_ABSORB) {
#if FS_X86
        if (isa == ISA_AVX512) return absorb_avx512(it, hp, lo, hi);
        if (isa == ISA_AVX2) return absorb_avx2(it, hp, lo, hi);
#endif
        return absorb_scalar(it, hp, lo, hi);
    }
#if FS_X86
    if (isa == ISA_AVX512) return op == OP_SGD ? sgd_avx512(it, hp, lo, hi) : check_avx512(it, lo, hi);
    if (isa == ISA_AVX2) return op == OP_SGD ? sgd_avx2(it, hp, lo, hi) : check_avx2(it, lo, hi);
#endif
    (void)isa;
    return op == OP_SGD ? sgd_scalar(it, hp, lo, hi) : check_scalar(it, lo, hi);
}

/* ------------------------------------------------------------------ threads over chunks */

typedef struct {
    int op, isa;
    const Item *items;
    Py_ssize_t nitems;
    const Hyper *hp;
    const int64_t *starts; /* chunk c of the whole list: item index = owner[c], elements [begin[c], end) */
    const Py_ssize_t *owner;
    Py_ssize_t nchunks;
    Py_ssize_t next;       /* the next chunk to take (atomic) */
    int bad;               /* any inf/NaN seen (atomic or) */
} Work;

static void *worker(void *arg) {
    Work *w = (Work *)arg;
    int bad = 0;
    int mkl_local = (w->op == OP_ADAM && g_sqrt && g_local_threads) ? g_local_threads(1) : -1;
    for (;;) {
        Py_ssize_t c = __atomic_fetch_add(&w->next, 1, __ATOMIC_RELAXED);
        if (c >= w->nchunks) break;
        const Item *it = &w->items[w->owner[c]];
        int64_t lo = w->starts[c], hi = lo + CHUNK < it->n ? lo + CHUNK : it->n;
        bad |= run_range(w->op, w->isa, it, w->hp, lo, hi);
    }
#if FS_X86
    _mm_sfence(); /* streaming stores are seen by the other threads before the step returns */
#endif
    if (mkl_local >= 0) g_local_threads(mkl_local); /* the calling thread's setting, as it was */
    if (bad) __atomic_fetch_or(&w->bad, 1, __ATOMIC_RELAXED);
    return NULL;
}

/* Runs op over every item; returns 1 if a gradient held inf/NaN, 0 if not, -1 on error (exception set). */
static int run_all(int op, const Item *items, Py_ssize_t nitems, const Hyper *hp, int threads) {
    Py_ssize_t nchunks = 0;
    for (Py_ssize_t k = 0; k < nitems; k++) nchunks += (Py_ssize_t)((items[k].n + CHUNK - 1) / CHUNK);
    int64_t *starts = PyMem_RawMalloc(sizeof(int64_t) * (size_t)(nchunks + 1));
    Py_ssize_t *owner = PyMem_RawMalloc(sizeof(Py_ssize_t) * (size_t)(nchunks + 1));
    if (!starts || !owner) {
        PyMem_RawFree(starts);
        PyMem_RawFree(owner);
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t c = 0;
    for (Py_ssize_t k = 0; k < nitems; k++)
        for (int64_t lo = 0; lo < items[k].n; lo += CHUNK) {
            starts[c] = lo;
            owner[c++] = k;
        }
    Work w = {op, g_isa, items, nitems, hp, starts, owner, nchunks, 0, 0};
    if (threads > nchunks) threads = (int)nchunks;
    if (threads < 1) threads = 1;
    pthread_t tids[256];
    if (threads > 256) threads = 256;
    int started = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&tids[started], NULL, worker, &w) != 0) break; /* the others share the work */
        started++;
    }
    worker(&w);
    for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(starts);
    PyMem_RawFree(owner);
    return w.bad;
}

/* ------------------------------------------------------------------ Python interface */

static int as_ptr(PyObject *o, void **out) {
    if (o == Py_None) {
        *out = NULL;
        return 0;
    }
    *out = PyLong_AsVoidPtr(o);
    return PyErr_Occurred() ? -1 : 0;
}

/* items: a sequence of tuples (p, g, gk, a, b, c, h, hk, n, step, init), read by position: onepass.py's
   Item names the positions (absorb's items hold the mode in the last one); pointers as ints (0/None: absent) */
static Item *parse_items(PyObject *seq, Py_ssize_t *count) {
    PyObject *fast = PySequence_Fast(seq, "items must be a sequence of tuples");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Item *items = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Item));
    if (!items) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *t = PySequence_Fast_GET_ITEM(fast, k);
        PyObject *p, *g, *a, *b, *c, *h, *st;
        long long nel;
        Item *it = &items[k];
        if (!PyArg_ParseTuple(t, "OOiOOOOiLOi", &p, &g, &it->gk, &a, &b, &c, &h, &it->hk, &nel, &st, &it->init) ||
            as_ptr(p, (void **)&it->p) || as_ptr(g, (void **)&it->g) || as_ptr(a, (void **)&it->a) ||
            as_ptr(b, (void **)&it->b) || as_ptr(c, (void **)&it->c) || as_ptr(h, &it->h) || as_ptr(st, (void **)&it->step)) {
            PyMem_Free(items);
            Py_DECREF(fast);
            return NULL;
        }
        it->n = nel;
        if (!it->h) it->hk = K_NONE;
        if (it->gk < K_F32 || it->gk > K_F16 || it->hk < K_NONE || it->hk > K_F16 || nel < 0 || !it->g) {
            PyErr_Format(PyExc_ValueError, "item %zd: bad gradient/half kind or size", k);
            PyMem_Free(items);
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    *count = n;
    return items;
}

static PyObject *finish(Item *items, int bad) {
    PyMem_Free(items);
    if (bad < 0) return NULL;
    return PyBool_FromLong(bad);
}

/* skip: the address of an FP32 flag (0/None: none); when it holds a value other than 0 the step
   is skipped: nothing is read or written, Adam's step counts do not advance. Read here, in host
   memory, as the step starts: the sync-free skip of amp_patch.scaling on the CPU. */
static int skipped(PyObject *o) {
    void *flag = NULL;
    if (!o || as_ptr(o, &flag) || !flag) return 0;
    return *(const float *)flag != 0.0f;
}

PyDoc_STRVAR(sgd_doc,
"sgd(items, threads, inv, maximize, weight_decay, momentum, dampening, nesterov, lr, skip=0) -> found_inf\n\n"
"torch.optim.SGD's update of each item (p, g, gk, momentum_buffer, _, _, h, hk, n, _, init), the gradient\n"
"multiplied by inv as it is read; returns True if a gradient element was inf or NaN. skip: the address\n"
"of an FP32 flag; when it is not 0 nothing is done (returns False).");

static PyObject *py_sgd(PyObject *self, PyObject *args) {
    PyObject *seq, *skip = NULL;
    int threads, maximize, nesterov;
    double inv, wd, mom, damp, lr;
    if (!PyArg_ParseTuple(args, "Oidpdddpd|O", &seq, &threads, &inv, &maximize, &wd, &mom, &damp, &nesterov, &lr, &skip))
        return NULL;
    if (skipped(skip)) Py_RETURN_FALSE;
    if (PyErr_Occurred()) return NULL;
    Hyper hp;
    memset(&hp, 0, sizeof hp);
    hp.inv = (float)inv;
    hp.maximize = maximize;
    hp.has_wd = wd != 0;
    hp.wd = (float)wd;
    hp.has_mom = mom != 0;
    hp.mom = (float)mom;
    hp.omd = (float)(1.0 - damp);
    hp.nesterov = nesterov;
    hp.neg_lr = (float)(-lr);
    Py_ssize_t n;
    Item *items = parse_items(seq, &n);
    if (!items) return NULL;
    for (Py_ssize_t k = 0; k < n; k++)
        if (hp.has_mom && !items[k].a) {
            PyMem_Free(items);
            return PyErr_Format(PyExc_ValueError, "item %zd: momentum needs a momentum buffer", k);
        }
    return finish(items, run_all(OP_SGD, items, n, &hp, threads));
}

PyDoc_STRVAR(adam_doc,
"adam(items, threads, inv, maximize, weight_decay, decoupled, lr, beta1, beta2, eps, amsgrad, skip=0) -> found_inf\n\n"
"torch.optim.Adam's (AdamW's: decoupled) update of each item (p, g, gk, exp_avg, exp_avg_sq, max_exp_avg_sq,\n"
"h, hk, n, step, _), its step count advanced by one. skip: as for sgd.");

static PyObject *py_adam(PyObject *self, PyObject *args) {
    PyObject *seq, *skip = NULL;
    int threads, maximize, decoupled, amsgrad;
    double inv, wd, lr, beta1, beta2, eps;
    if (!PyArg_ParseTuple(args, "Oidpdpddddp|O", &seq, &threads, &inv, &maximize, &wd, &decoupled, &lr, &beta1, &beta2, &eps,
                          &amsgrad, &skip))
        return NULL;
    if (skipped(skip)) Py_RETURN_FALSE;
    if (PyErr_Occurred()) return NULL;
    Hyper hp;
    memset(&hp, 0, sizeof hp);
    hp.adam = 1;
    hp.inv = (float)inv;
    hp.maximize = maximize;
    hp.has_wd = wd != 0;
    hp.wd = (float)wd;
    hp.decoupled = decoupled;
    hp.decay = (float)(1.0 - lr * wd);
    hp.w1 = (float)(1.0 - beta1);
    hp.w1m1 = hp.w1 - 1.0f;
    hp.small = fabsf(hp.w1) < 0.5f;
    hp.beta2 = (float)beta2;
    hp.omb2 = (float)(1.0 - beta2);
    hp.eps = (float)eps;
    hp.amsgrad = amsgrad;
    Py_ssize_t n;
    Item *items = parse_items(seq, &n);
    if (!items) return NULL;
    for (Py_ssize_t k = 0; k < n; k++)
        if (!items[k].a || !items[k].b || !items[k].step || (amsgrad && !items[k].c)) {
            PyMem_Free(items);
            return PyErr_Format(PyExc_ValueError, "item %zd: Adam needs exp_avg, exp_avg_sq, step (and max_exp_avg_sq with amsgrad)", k);
        }
    /* As adam.py: step_t += 1 (an FP32 add), then in double (Python floats): bias_correction1 =
       1 - beta1 ** step, step_size = lr / bias_correction1, bias_correction2 ** 0.5 (pow, not
       sqrt, as Python's ** is), each made FP32 where the tensor op takes it. */
    for (Py_ssize_t k = 0; k < n; k++) {
        Item *it = &items[k];
        float s = *it->step + 1.0f;
        *it->step = s;
        double bc1 = 1.0 - pow(beta1, (double)s), bc2 = 1.0 - pow(beta2, (double)s);
        double step_size = lr / bc1;
        it->neg_step = (float)(-step_size);
        it->bc2 = (float)pow(bc2, 0.5);
    }
    return finish(items, run_all(OP_ADAM, items, n, &hp, threads));
}

PyDoc_STRVAR(check_doc,
"non_finite(items, threads) -> bool\n\n"
"Whether any gradient of items (each (_, g, gk, ..., n, ...) as for sgd) holds inf or NaN.");

static PyObject *py_check(PyObject *self, PyObject *args) {
    PyObject *seq;
    int threads;
    if (!PyArg_ParseTuple(args, "Oi", &seq, &threads)) return NULL;
    Py_ssize_t n;
    Item *items = parse_items(seq, &n);
    if (!items) return NULL;
    Hyper hp;
    memset(&hp, 0, sizeof hp);
    return finish(items, run_all(OP_CHECK, items, n, &hp, threads));
}

PyDoc_STRVAR(absorb_doc,
"absorb(items, threads, inv, found, inv_at=0) -> found_inf\n\n"
"Move gradients into FP32 master gradients in one pass: each item (p, g, gk, _, _, _, h, hk, n, _, mode)\n"
"reads the gradient g (kind gk), multiplies it by inv (not when inv is 1) and writes p = v (mode 0),\n"
"p = p + v (1) or p = 0 + v (2), and the new p rounded to kind gk at h (hk == gk; 0: not written;\n"
"not where h is g and p = g exactly); an inf or NaN gradient element sets the FP32 at address found\n"
"(0: none) to 1.0, as torch's unscale-and-check does. Returns whether one was found. inv_at: the address\n"
"of an FP32 inverse scale read instead of inv as the call starts (the loss scale kept as a tensor).");

static PyObject *py_absorb(PyObject *self, PyObject *args) {
    PyObject *seq, *fo, *io = NULL;
    int threads;
    double inv;
    void *found, *inv_at = NULL;
    if (!PyArg_ParseTuple(args, "OidO|O", &seq, &threads, &inv, &fo, &io) || as_ptr(fo, &found)) return NULL;
    if (io && as_ptr(io, &inv_at)) return NULL;
    Hyper hp;
    memset(&hp, 0, sizeof hp);
    hp.inv = inv_at ? *(const float *)inv_at : (float)inv;
    Py_ssize_t n;
    Item *items = parse_items(seq, &n);
    if (!items) return NULL;
    for (Py_ssize_t k = 0; k < n; k++)
        if (!items[k].p || items[k].init < ABS_WRITE || items[k].init > ABS_ZERO_ADD) {
            PyMem_Free(items);
            return PyErr_Format(PyExc_ValueError, "item %zd: absorb needs a destination and a mode 0, 1 or 2", k);
        } else if (items[k].h && (items[k].hk != items[k].gk || items[k].gk == K_F32)) {
            PyMem_Free(items);
            return PyErr_Format(PyExc_ValueError, "item %zd: absorb writes back a half gradient of the gradient's kind only", k);
        }
    int bad = run_all(OP_ABSORB, items, n, &hp, threads);
    if (bad > 0 && found) *(float *)found = 1.0f;
    return finish(items, bad);
}

PyDoc_STRVAR(set_sqrt_doc,
"set_sqrt(address, local_threads=0) -> None\n\n"
"The square root routine Adam's denominator uses: the address of a C function void(int n, const float *x,\n"
"float *r) (torch's own), or 0 for the CPU's correctly rounded square root. local_threads: the address of\n"
"MKL's int MKL_Set_Num_Threads_Local(int) where the routine is MKL's (each kernel thread calls it\n"
"sequentially), or 0.");

static PyObject *py_set_sqrt(PyObject *self, PyObject *args) {
    PyObject *addr, *local = NULL;
    void *ptr, *lptr = NULL;
    if (!PyArg_ParseTuple(args, "O|O", &addr, &local) || as_ptr(addr, &ptr)) return NULL;
    if (local && as_ptr(local, &lptr)) return NULL;
    g_sqrt = (sqrt_fn)ptr;
    g_local_threads = ptr ? (local_threads_fn)lptr : NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(sqrt_doc,
"sqrt(x, r, n) -> None\n\n"
"r[i] = the square root of x[i] for n FP32 values at addresses x and r, as Adam's step takes it (tests).");

static PyObject *py_sqrt(PyObject *self, PyObject *args) {
    PyObject *xo, *ro;
    void *x, *r;
    long long n;
    if (!PyArg_ParseTuple(args, "OOL", &xo, &ro, &n) || as_ptr(xo, &x) || as_ptr(ro, &r)) return NULL;
    for (long long b = 0; b < n; b += BLOCK) {
        long long e = b + BLOCK < n ? b + BLOCK : n;
        if (g_sqrt) g_sqrt((int)(e - b), (const float *)x + b, (float *)r + b);
        else sqrt_scalar((const float *)x + b, (float *)r + b, e - b);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(stream_doc,
"stream_min(n=None) -> int\n\n"
"The size (elements) from which half weights are written with streaming stores; n sets it.");

static PyObject *py_stream_min(PyObject *self, PyObject *args) {
    long long n = -1;
    if (!PyArg_ParseTuple(args, "|L", &n)) return NULL;
    if (n >= 0) g_stream_min = n;
    return PyLong_FromLongLong(g_stream_min);
}

static const char *ISA_NAMES[] = {"scalar", "avx2", "avx512"};

PyDoc_STRVAR(isa_doc,
"isa(name=None) -> str\n\n"
"The instruction set the kernels run with; name ('scalar', 'avx2', 'avx512') selects one this CPU has\n"
"(ValueError otherwise); None leaves it.");

static PyObject *py_isa(PyObject *self, PyObject *args) {
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|z", &name)) return NULL;
    if (name) {
        int want = -1;
        for (int k = 0; k < 3; k++)
            if (strcmp(name, ISA_NAMES[k]) == 0) want = k;
        if (want < 0 || want > g_best)
            return PyErr_Format(PyExc_ValueError, "isa %R: this CPU runs up to %s", PyTuple_GET_ITEM(args, 0), ISA_NAMES[g_best]);
        g_isa = want;
    }
    return PyUnicode_FromString(ISA_NAMES[g_isa]);
}

PyDoc_STRVAR(bits_doc,
"round_bits(values, kind) -> list[int]\n\n"
"Each float rounded to BF16 (kind 2) or FP16 (kind 3) by the scalar conversions (tests).");

static PyObject *py_round_bits(PyObject *self, PyObject *args) {
    PyObject *seq;
    int kind;
    if (!PyArg_ParseTuple(args, "Oi", &seq, &kind)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "values must be a sequence");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t k = 0; out && k < n; k++) {
        double d = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(fast, k));
        if (d == -1.0 && PyErr_Occurred()) {
            Py_CLEAR(out);
            break;
        }
        float x = (float)d;
        uint16_t r = kind == K_BF16 ? f32_to_bf16(x) : f32_to_f16(x);
        PyObject *back = PyFloat_FromDouble(kind == K_BF16 ? bf16_to_f32(r) : f16_to_f32(r));
        PyObject *pair = back ? Py_BuildValue("(iN)", (int)r, back) : NULL;
        if (!pair) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, k, pair);
    }
    Py_DECREF(fast);
    return out;
}

static PyMethodDef methods[] = {
    {"sgd", py_sgd, METH_VARARGS, sgd_doc},
    {"adam", py_adam, METH_VARARGS, adam_doc},
    {"non_finite", py_check, METH_VARARGS, check_doc},
    {"absorb", py_absorb, METH_VARARGS, absorb_doc},
    {"isa", py_isa, METH_VARARGS, isa_doc},
    {"set_sqrt", py_set_sqrt, METH_VARARGS, set_sqrt_doc},
    {"stream_min", py_stream_min, METH_VARARGS, stream_doc},
    {"sqrt", py_sqrt, METH_VARARGS, sqrt_doc},
    {"round_bits", py_round_bits, METH_VARARGS, bits_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "amp_patch.precision._onepass",
    "The fused O2/O5 optimizer step (see amp_patch.precision.onepass).", -1, methods,
};

PyMODINIT_FUNC PyInit__onepass(void) {
    g_best = g_isa = best_isa();
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "CHUNK", CHUNK) || PyModule_AddStringConstant(m, "BEST", ISA_NAMES[g_best]))) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
