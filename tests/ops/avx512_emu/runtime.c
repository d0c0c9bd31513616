/* The C library and OpenMP calls that the kernels of src/tokenloom/ops/csrc make, for an image
 * that runs without an operating system inside an x86 emulator (emulator.py): one thread, a bump
 * heap, an environment handed in by tl_emu_init. Compiled with -fno-builtin so that these loops
 * do not turn back into calls to themselves. */
#include <stddef.h>
#include <stdint.h>
#include <immintrin.h>

static char *heap_next, *heap_end;
static const char *env_block; /* "KEY=VALUE\0KEY=VALUE\0\0" */

void tl_emu_init(char *heap, int64_t heap_bytes, const char *env) {
    heap_next = heap;
    heap_end = heap + heap_bytes;
    env_block = env;
}

void *aligned_alloc(size_t align, size_t n) {
    if (align < 64) align = 64;
    uintptr_t p = ((uintptr_t)heap_next + align - 1) & ~(uintptr_t)(align - 1);
    if (p + n > (uintptr_t)heap_end) return NULL;
    heap_next = (char *)(p + n);
    return (void *)p;
}
void *malloc(size_t n) { return aligned_alloc(64, n); }
void *memset(void *d, int c, size_t n);
void *calloc(size_t n, size_t size) {
    void *p = malloc(n * size);
    if (p) memset(p, 0, n * size);
    return p;
}
void free(void *p) { (void)p; } /* a bump heap: each call starts from a fresh image */

void *memcpy(void *d, const void *s, size_t n) {
    char *dc = d;
    const char *sc = s;
    for (size_t i = 0; i < n; i++) dc[i] = sc[i];
    return d;
}
void *memset(void *d, int c, size_t n) {
    char *dc = d;
    for (size_t i = 0; i < n; i++) dc[i] = (char)c;
    return d;
}
int strcmp(const char *a, const char *b) {
    while (*a && *a == *b) a++, b++;
    return (unsigned char)*a - (unsigned char)*b;
}
long strtol(const char *s, char **end, int base) {
    (void)base; /* decimal only: the kernels read row thresholds */
    long sign = 1, v = 0;
    if (*s == '-') sign = -1, s++;
    while (*s >= '0' && *s <= '9') v = 10 * v + (*s++ - '0');
    if (end) *end = (char *)s;
    return sign * v;
}
char *getenv(const char *name) {
    for (const char *e = env_block; e && *e; ) {
        const char *n = name, *p = e;
        while (*n && *p == *n) n++, p++;
        if (!*n && *p == '=') return (char *)(p + 1);
        while (*e) e++;
        e++;
    }
    return NULL;
}
long syscall(long number, ...) { (void)number; return -1; } /* arch_prctl: no AMX state here */

int omp_get_thread_num(void) { return 0; }
int omp_get_num_threads(void) { return 1; }
int omp_get_max_threads(void) { return 1; }

float fabsf(float x) { return x < 0 ? -x : x; }
float fmaxf(float a, float b) { return a > b ? a : b; }
float fminf(float a, float b) { return a < b ? a : b; }
float fmaf(float a, float b, float c) { return _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c))); }
float sqrtf(float x) { return _mm_cvtss_f32(_mm_sqrt_ss(_mm_set_ss(x))); }
float nearbyintf(float x) { /* round to nearest even, as under the default MXCSR */
    return _mm_cvtss_f32(_mm_round_ss(_mm_set_ss(x), _mm_set_ss(x), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
/* exp in double precision, rounded once to float: within an ulp of glibc's expf. */
float expf(float xf) {
    if (xf > 88.8f) return __builtin_inff();
    if (xf < -104.0f) return 0.0f;
    const double x = xf, ln2 = 0.6931471805599453;
    const double n = _mm_cvtsd_f64(_mm_round_sd(_mm_set_sd(x / ln2), _mm_set_sd(x / ln2), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const double r = x - n * ln2; /* |r| <= ln2 / 2 */
    double p = 1.0, term = 1.0;
    for (int i = 1; i <= 13; i++) { term *= r / i; p += term; }
    union { double d; int64_t i; } two_n = {.i = (int64_t)(1023 + (int64_t)n) << 52};
    if (n < -1022) return (float)(p * 0x1p-1022 * (union { double d; int64_t i; }){.i = (int64_t)(1023 + (int64_t)n + 1022) << 52}.d);
    return (float)(p * two_n.d);
}

/* glibc's libmvec names for expf over 4, 8 and 16 lanes, which GCC calls for loops it vectorizes
 * under -ffast-math (math.h declares expf as a SIMD function). */
__m128 _ZGVbN4v_expf(__m128 x) {
    float v[4];
    _mm_storeu_ps(v, x);
    for (int i = 0; i < 4; i++) v[i] = expf(v[i]);
    return _mm_loadu_ps(v);
}
__m256 _ZGVdN8v_expf(__m256 x) {
    float v[8];
    _mm256_storeu_ps(v, x);
    for (int i = 0; i < 8; i++) v[i] = expf(v[i]);
    return _mm256_loadu_ps(v);
}
__m512 _ZGVeN16v_expf(__m512 x) {
    float v[16];
    _mm512_storeu_ps(v, x);
    for (int i = 0; i < 16; i++) v[i] = expf(v[i]);
    return _mm512_loadu_ps(v);
}
